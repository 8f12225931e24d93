"""Training checkpoints (orbax CheckpointManager, async), with an integrity record per step.

Folder layout (`<outputs>/<experiment>/checkpoints/`):

    <step>/                     one checkpoint; <step> = optimizer steps applied
      params/                   the weights: trainable params (nnx.State)           ┐ all that sampling,
      frozen/                   the weights: frozen Params and Buffers (nnx.State)  │ `convert to-torch`
      ema/                      the weights: EMA of the params (float32)            ┘ and --ckpt-path read
      opt_state/                the rest of the TrainState, for --load: optimizer state, step, rng
      config/                   JSON: the resolved run config, with "model" = STDiT3Config fields
      data/                     JSON: the loader state (epoch, index, fingerprint)
      meta/                     JSON: wandb run id, jaxsora version, mesh, process count, wall time,
                                "checkpoint_format": 3 (see "Older layouts" below)
      integrity.json            the completion marker and checksums (see below)
    <step>.orbax-checkpoint-tmp a save in progress (or one that died): never read

Every array item is an orbax item of its own (its own folder, OCDBT database and metadata), so the
weights never share a file with the optimizer state: `rsync -a --exclude opt_state RUN/ COPY/`
gives a copy that sampling (`python -m jaxsora.sample`, the inference server), `python -m
jaxsora.convert to-torch` and `--ckpt-path` read as they read the run, and that `--load` refuses
with one line naming the missing `opt_state` item. An item holds a dict {TrainState field:
subtree}: params/ holds {"params": ...}, opt_state/ holds {"opt_state": ..., "step": ..., "rng":
...} (step and rng go with the optimizer: only a full resume needs them, and a weights-only reader
takes the step from the folder's name). So an array's name inside its item is its TrainState path
(e.g. "params.blocks.0.attn.qkv.kernel.value"), whatever the layout. `split_items` is the rule:
fields params, frozen, ema → the item of that name; every other field → opt_state.

Older layouts, still read everywhere (full resume, weights only, convert, sample, serve, `ckpt`):
a step folder with a `state/` folder holds the whole TrainState in that one item (checkpoint_format
2 with integrity.json; no "checkpoint_format" and no integrity.json before that; `convert
from-torch` outputs wrote a `state/` item with params and ema). The layout is recognised by the
`state/` folder alone; reading only the weights of such a step reads only their arrays of it.

Integrity. When `Checkpointer.save` is called, one jitted program computes a 64-bit fingerprint
of every array of the TrainState on the device (`train.fingerprint.device_fingerprints`); it is dispatched
asynchronously, like the save itself, so the step loop does not wait for it. The fingerprint is
layout independent: each array is read as its logical C-order sequence of 32-bit words (2-byte
and 1-byte dtypes widened, 8-byte dtypes split in two, low word first) and reduced with integer
sums modulo 2^32, which are exact whatever the sharding or the reduction order — a checkpoint
saved on one mesh verifies on another, and `host_fingerprint` (numpy) gives the same bits.
Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` when every
process has finished; just before that rename, in orbax's finalize thread, process 0 fetches the
fingerprints and writes `integrity.json` into the folder ({"complete": true, "items": {item:
{"arrays", "bytes"}} of every array item written, "arrays": {array name: {"item", "shape",
"dtype", "fingerprint"}} covering every item, a sha256 of each JSON item, the jaxsora version}).
The marker is therefore committed by the same atomic rename as the data: a `<step>/` folder of
this format without it was not written by a finished save. Multi-host: the fingerprints are
global reductions, so every process holds the same values; only process 0 writes the record and
prints, and restore's skip decisions are agreed between processes. (Records of the `state/`
layout, format 1, have no "item"s: an array's item follows from its name's first part.)

`restore` reads the newest step (or the one asked for) — all items (a full resume) or some (e.g.
`WEIGHT_ITEMS`: the optimizer's folder is then never opened) — recomputes the fingerprints of the
arrays it read and compares them with the record's arrays of those items only; a step that is
partial, unreadable or does not match is skipped with one line on stderr and the next older one
is tried (an explicitly named step raises `CheckpointError`). A step without the opt_state item
(a copy of the weights) stops a full restore at once with one line naming the item. Checkpoints
older than integrity records restore with a one-line note that they are unverified. A failed
write (disk full, I/O error) raises `CheckpointWriteError` with one line, and the unfinished step
folder is removed so the earlier checkpoints stay the newest.

The newest `keep` checkpoints are kept (`keep=0`: all). Restoring uses an abstract target that
carries the *current* mesh's shardings, so a checkpoint saved on one mesh/device count restores on
another. `python -m jaxsora.ckpt list|verify DIR` checks checkpoints without a model config;
`python -m jaxsora.convert to-torch <step dir or checkpoints/>` reads the same folders
(`read_weights` / `weight_fields` / `verify_arrays` / `read_json_item` are the weights-only readers'
pieces; `write_integrity_record` writes the record of a step assembled without a Checkpointer, as
`python -m jaxsora.tools.average` does).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxsora.errors import UserError
from jaxsora.train.orbax_errors import (fmt_bytes, install_noise_filters, io_failure, one_line_error, quiet_orbax, say,
                                        write_json_atomic)
from jaxsora.train.fingerprint import (array_name, device_fingerprints, fetch_fingerprints, format_fingerprint,
                                      host_fingerprint)

WEIGHT_ITEMS = ("params", "frozen", "ema")  # what sampling, conversion and --ckpt-path read
OPT_ITEM = "opt_state"  # optimizer state, step, rng: only --load reads it
ARRAY_ITEMS = WEIGHT_ITEMS + (OPT_ITEM,)
JSON_ITEMS = ("config", "data", "meta")
ITEMS = ARRAY_ITEMS + JSON_ITEMS
LEGACY_ITEM = "state"  # the older layout's single item holding the whole TrainState
INTEGRITY_FILE = "integrity.json"
INTEGRITY_FORMAT = 2  # the layout of integrity.json itself (1: the `state/` layout's, no items)
# meta["checkpoint_format"]: 3 = one item per part (params, frozen, ema, opt_state); 2 = one
# `state` item, with integrity.json; older checkpoints have no such key (and no integrity.json)
CHECKPOINT_FORMAT = 3
# Orbax's suffix for a step folder being written (orbax/checkpoint/_src/path/atomicity_types.py).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
FINGERPRINT_METHOD = "u32-words: sum(fmix32(w)), sum(fmix32(w)*(2i+1)) mod 2^32"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used, or a checkpoint folder that holds none; one-line message
    (commands print it as one line and exit with code 2, see `jaxsora.errors`)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No such checkpoint folder, or a folder without any checkpoint."""


class CheckpointWriteError(CheckpointError):
    """A save that failed on the filesystem (disk full, quota, I/O error)."""


def _json_digest(obj) -> str:
    """sha256 of a JSON item in canonical form (what JsonSave writes, read back, keys sorted)."""
    canon = json.dumps(json.loads(json.dumps(obj)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# items: which folder holds which part of the TrainState
# ----------------------------------------------------------------------------------------------
def item_of(field: str) -> str:
    """The array item that stores a TrainState field: params, frozen and ema their own; every other
    field (opt_state, step, rng, and the fields of other trees saved with a Checkpointer) opt_state."""
    return field if field in WEIGHT_ITEMS else OPT_ITEM


def _array_item(name: str, entry: Optional[dict] = None) -> str:
    """The item of an array of the integrity record (format 1 records name none: from the name)."""
    item = entry.get("item") if isinstance(entry, dict) else None
    return item if item else item_of(name.split(".", 1)[0])


def _fields(tree) -> dict:
    """{field: subtree} of a TrainState (a dataclass) or of a dict of fields."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, dict) or hasattr(tree, "keys"):
        return dict(tree.items())
    raise TypeError(f"a checkpointed state is a TrainState or a dict of fields, got {type(tree).__name__}")


def split_items(state) -> dict[str, dict]:
    """{array item: {field: subtree}} of a state, in ARRAY_ITEMS order; items without arrays are left out."""
    parts: dict[str, dict] = {}
    for field, value in _fields(state).items():
        parts.setdefault(item_of(field), {})[field] = value
    return {it: parts[it] for it in ARRAY_ITEMS if it in parts and jax.tree.leaves(parts[it])}


def _join(target, fields: dict):
    """`target` (a TrainState or dict) with the fields read; fields that were not read keep the
    target's value (only fields without arrays: nothing to read)."""
    if dataclasses.is_dataclass(target) and not isinstance(target, type):
        return dataclasses.replace(target, **{k: v for k, v in fields.items() if k in _fields(target)})
    return {k: fields.get(k, v) for k, v in _fields(target).items()}


def is_legacy_layout(step_dir: str) -> bool:
    """A step folder of the older layout: the whole TrainState in one `state/` item."""
    return os.path.isdir(os.path.join(step_dir, LEGACY_ITEM))


def has_weights(step_dir: str) -> bool:
    """A step folder that holds model weights in either layout (new: params/ or ema/; old: state/)."""
    return any(os.path.isdir(os.path.join(step_dir, it)) for it in ("params", "ema", LEGACY_ITEM))


# ----------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Pending:
    """What the integrity record of a save in flight needs."""

    step: int
    names: list
    info: list
    fingerprints: list  # uint32[n, 2] arrays (replicated), maybe still being computed
    json_digests: dict
    nbytes: int
    items: dict  # {array item: {"arrays": n, "bytes": b}}


# Steps that `restore` skipped as corrupt or partial, per checkpoints root: a Checkpointer on that
# root replaces such a step folder when training reaches the step again (instead of keeping it).
_REPLACE_STEPS: dict[str, set] = {}


class Checkpointer:
    """Asynchronous saves of (TrainState, config, loader state, meta) with integrity records; the
    TrainState goes into the array items of `split_items` (params, frozen, ema, opt_state).

    keep: the newest `keep` checkpoints are kept; 0 or None keeps all.
    async_save: False waits for each save to be written before `save` returns.
    """

    def __init__(self, directory: str, *, keep: Optional[int] = 3, async_save: bool = True):
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
        install_noise_filters()
        self.directory = os.path.abspath(directory)
        self._key = os.path.realpath(self.directory)  # for _REPLACE_STEPS
        self.keep = None if not keep else int(keep)  # orbax: max_to_keep=0 would delete every step
        self.async_save = async_save
        self._pending: Optional[_Pending] = None
        self._in_flight: Optional[tuple[int, int]] = None  # (step, state bytes) of the save being written
        self._lock = threading.Lock()
        self._closed = False
        self.manager = self._new_manager()

    def _new_manager(self) -> ocp.CheckpointManager:
        # Always orbax's async checkpointer: the integrity record is written from its finalize
        # thread (post_finalization_callback, which runs before the tmp folder is renamed).
        # cleanup_tmp_directories: unfinished saves of an earlier (killed) run are removed.
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True,
            async_options=ocp.options.AsyncOptions(post_finalization_callback=self._on_finalized))
        try:
            return ocp.CheckpointManager(self.directory, options=opts, item_names=ITEMS)
        except OSError as e:
            raise CheckpointWriteError(f"cannot create the checkpoint folder {self.directory}: "
                                       f"{io_failure(e)}") from None

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state, *, config: dict, data: dict, meta: dict, force: bool = False) -> bool:
        """Start saving `step` (returns at once unless async_save=False); False if it exists.
        Raises CheckpointWriteError when this or the previous save could not be written."""
        step = int(step)
        self._wait_previous()
        if step in self.manager.all_steps():
            if step not in _REPLACE_STEPS.get(self._key, ()):
                return False
            self._remove_skipped_step(step)
        names, info, fps = device_fingerprints(state)  # dispatched before orbax copies the state
        parts = split_items(state)
        meta = {**meta, "checkpoint_format": CHECKPOINT_FORMAT}
        jsons = dict(config=config, data=data, meta=meta)
        sizes = {it: [int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")]
                 for it, tree in parts.items()}
        items = {it: dict(arrays=len(jax.tree.leaves(parts[it])), bytes=sum(b)) for it, b in sizes.items()}
        nbytes = sum(sum(b) for b in sizes.values())
        with self._lock:
            self._pending = _Pending(step, names, info, fps, {k: _json_digest(v) for k, v in jsons.items()}, nbytes,
                                     items)
        self._in_flight = (step, nbytes)
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(
                    **{it: ocp.args.StandardSave(tree) for it, tree in parts.items()},
                    **{k: ocp.args.JsonSave(v) for k, v in jsons.items()},
                ),
                force=force,
            )
        except Exception as e:  # noqa: BLE001 — filesystem errors become one line, others re-raise
            self._failed(step, nbytes, e)
            raise
        if not saved:
            with self._lock:
                self._pending = None
            self._in_flight = None
        elif not self.async_save:
            self.wait()
        return saved

    def _wait_previous(self):
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            step, nbytes = self._in_flight or (None, 0)
            self._failed(step, nbytes, e)
            raise
        self._in_flight = None

    def wait(self):
        """Block until the save in flight is written (and its integrity record with it)."""
        self._wait_previous()

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self._wait_previous()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 — a failure already raised by _wait_previous
                pass

    def _remove_skipped_step(self, step: int):
        """Delete a step folder that restore skipped as corrupt, so this save can replace it."""
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxsora-ckpt-replace-{step}")
        _REPLACE_STEPS.get(self._key, set()).discard(step)
        self.manager.reload()

    def _on_finalized(self):
        """Orbax's finalize thread, after every item is written and before the step folder's
        rename: process 0 writes integrity.json into the folder."""
        with self._lock:
            rec, self._pending = self._pending, None
        if rec is None or jax.process_index() != 0:
            return
        fps = fetch_fingerprints(rec.fingerprints)
        doc = _integrity_doc(rec.step, rec.json_digests, rec.items,
                             {n: dict(i, item=_array_item(n), fingerprint=f) for n, i, f in zip(rec.names, rec.info, fps)})
        tmp = sorted(glob.glob(os.path.join(self.directory, f"{rec.step}{TMP_SUFFIX}*")))
        folder = tmp[-1] if tmp else os.path.join(self.directory, str(rec.step))
        write_json_atomic(os.path.join(folder, INTEGRITY_FILE), doc)

    def _failed(self, step: Optional[int], nbytes: int, exc: BaseException):
        """A save that raised: filesystem errors → remove the partial folder, fresh manager,
        CheckpointWriteError (raised from here); anything else returns (the caller re-raises)."""
        reason = io_failure(exc)
        with self._lock:
            self._pending = None
        self._in_flight = None
        if reason is None:
            return
        where = os.path.join(self.directory, str(step)) if step is not None else self.directory
        _wait_for_orbax_writers()  # other items of the step may still be writing into its folder
        if jax.process_index() == 0 and step is not None:
            for tmp in glob.glob(os.path.join(self.directory, f"{step}{TMP_SUFFIX}*")):
                shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(where, INTEGRITY_FILE)):
                shutil.rmtree(where, ignore_errors=True)
        try:
            free = fmt_bytes(shutil.disk_usage(self.directory).free)
        except OSError:
            free = "unknown"
        try:  # the failed manager re-raises its error on every call: replace it
            self.manager.close()
        except Exception:  # noqa: BLE001
            pass
        self.manager = self._new_manager()
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        raise CheckpointWriteError(
            f"{what} could not be written to {where}: {reason} (it needs about "
            f"{fmt_bytes(nbytes)}, {free} free); the partial folder was removed, earlier checkpoints "
            f"are intact") from None


# How long a failed save waits for orbax's other writer threads of that save before removing its
# folder (they stop quickly when the disk is full; a bound, so that a hung filesystem cannot hang us).
_WRITER_JOIN_SECONDS = 60.0


def _wait_for_orbax_writers(timeout: float = _WRITER_JOIN_SECONDS):
    """Join orbax's background writer threads (its `_SignalingThread`s): when one item of a save
    fails, orbax reports it while the other items' threads still write."""
    deadline = time.monotonic() + timeout
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and type(t).__module__.startswith("orbax.") and t.is_alive():
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 — orbax's join re-raises the thread's error, reported already
                pass


# ----------------------------------------------------------------------------------------------
# finding and checking checkpoints
# ----------------------------------------------------------------------------------------------
def _numeric_children(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(d) for d in names if d.isdigit() and os.path.isdir(os.path.join(path, d)))


def resolve_checkpoint(path: str, step: Optional[int] = None) -> tuple[str, Optional[int]]:
    """(checkpoints root, step or None) from a run's outputs folder, a `checkpoints/` folder or
    one step folder `checkpoints/N` (which means step N; a different `step` is an error).
    Raises CheckpointNotFoundError for a missing folder, a folder without any `<step>/` folder, or
    a `step` that is not there — before anything is read."""
    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(p):
        raise CheckpointNotFoundError(f"checkpoint folder not found: {p}")
    if os.path.isdir(os.path.join(p, "checkpoints")):
        p = os.path.join(p, "checkpoints")
    base = os.path.basename(p)
    if base.isdigit() and not _numeric_children(p):  # a step folder
        if step is not None and int(step) != int(base):
            raise CheckpointError(f"{p} is the checkpoint of step {int(base)}, but step {step} was asked for")
        return os.path.dirname(p), int(base)
    steps = checkpoint_steps(p)
    if not steps:
        tmp = unfinished_saves(p)
        raise CheckpointNotFoundError(f"{p} holds no checkpoint (no <step>/ folder"
                                      + (f"; unfinished saves: {', '.join(tmp)})" if tmp else ")"))
    if step is not None and int(step) not in steps:
        raise CheckpointNotFoundError(f"{p} has no checkpoint of step {step} (it has {steps})")
    return p, step


def checkpoint_steps(root: str) -> list[int]:
    """The step folders of a checkpoints root, ascending (unfinished `*.orbax-checkpoint-tmp` excluded)."""
    return _numeric_children(root)


def unfinished_saves(root: str) -> list[str]:
    """Names of step folders orbax never finished (`<step>.orbax-checkpoint-tmp*`)."""
    try:
        return sorted(d for d in os.listdir(root) if TMP_SUFFIX in d)
    except OSError:
        return []


class _Unusable(Exception):
    """Why one step cannot be used (internal; becomes a skip line or a CheckpointError)."""


def _read_record(step_dir: str) -> Optional[dict]:
    """The step's integrity record; None for a checkpoint older than integrity records.
    Raises _Unusable when the record is missing from a new-format checkpoint, or broken."""
    path = os.path.join(step_dir, INTEGRITY_FILE)
    if not os.path.exists(path):
        try:
            with open(os.path.join(step_dir, "meta", "metadata")) as f:
                fmt = json.load(f).get("checkpoint_format")
        except (OSError, ValueError, AttributeError):
            fmt = None
        if fmt is not None:
            raise _Unusable(f"partial: no {INTEGRITY_FILE} (the save did not finish)")
        return None
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise _Unusable(f"{INTEGRITY_FILE} unreadable ({one_line_error(e)})") from None
    if not isinstance(rec, dict) or rec.get("complete") is not True or not isinstance(rec.get("arrays"), dict):
        raise _Unusable(f"partial: {INTEGRITY_FILE} does not mark the save complete")
    return rec


def _no_opt_state(step_dir: str) -> str:
    return (f"has no {OPT_ITEM} item (a copy of the weights only): a full resume (--load) needs the optimizer "
            f"state; start from these weights with --ckpt-path {step_dir}")


class _MissingItem(_Unusable):
    """A step that is intact but lacks an item that was asked for on purpose (a copy without the
    optimizer): no fallback to older steps, the restore stops with one line."""


def _entries(step_dir: str) -> set:
    try:
        entries = set(os.listdir(step_dir))
    except OSError as e:
        raise _Unusable(f"unreadable folder ({one_line_error(e)})") from None
    if not entries:
        raise _Unusable("empty folder")
    return entries


def _check_items(step_dir: str, items) -> None:
    _entries(step_dir)
    missing = [it for it in items if not os.path.isdir(os.path.join(step_dir, it))]
    if missing:
        raise _Unusable(f"partial: no {', '.join(missing)} folder{'s' if len(missing) > 1 else ''}")


def _recorded_items(record: Optional[dict]) -> Optional[set]:
    """The array items a (format 2) record says were written; None when it does not say."""
    items = record.get("items") if isinstance(record, dict) else None
    return set(items) if isinstance(items, dict) else None


def _compare(record: dict, names: list, info: list, fps: list, items=None, *, subset: bool = False) -> None:
    """Raise _Unusable when the arrays read differ from the integrity record. `items`: only the
    record's arrays of these items are expected (None: all); `subset`: the arrays read may be a part
    of those (each one read is checked, none is required)."""
    want = {n: e for n, e in record["arrays"].items() if items is None or _array_item(n, e) in items}
    got = {n: dict(i, fingerprint=f) for n, i, f in zip(names, info, fps)}
    missing = [] if subset else sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        what = (f"{len(missing)} recorded arrays were not read (e.g. {missing[0]})" if missing
                else f"{len(extra)} arrays are not in the record (e.g. {extra[0]})")
        raise _Unusable(f"the state does not match {INTEGRITY_FILE}: {what}")
    bad = [n for n in sorted(got) if (want[n].get("shape"), want[n].get("dtype"), want[n].get("fingerprint"))
           != (got[n]["shape"], got[n]["dtype"], got[n]["fingerprint"])]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise _Unusable(f"checksum mismatch in {bad[0]}{more}")


def _agree(ok: bool) -> bool:
    """Multi-host: True only when every process read its part (all then take the same branch)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _read_json_item(step_dir: str, name: str):
    """A JsonSave item (orbax writes it to `<item>/metadata`), read without orbax."""
    with open(os.path.join(step_dir, name, "metadata")) as f:
        return json.load(f)


def _restore_tree(item_dir: str, target, *, partial: bool = False):
    """One array item (or the legacy state item) read into `target`'s shardings. partial: `target`
    names only some of the stored arrays (the others are not read)."""
    if not partial:
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            return ckptr.restore(item_dir, args=ocp.args.StandardRestore(target))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                                     partial_restore=True))


def _array_items_to_read(step_dir: str, entries: set, record, arrays: list, tfields) -> tuple[list, list]:
    """(items to read, items missing that are needed) of a step of the per-item layout. An item is
    needed when the record lists it or the target has arrays in it; others are read when present."""
    recorded = _recorded_items(record)
    read, missing = [], []
    for it in arrays:
        has = None if tfields is None else bool(jax.tree.leaves({f: v for f, v in tfields.items() if item_of(f) == it}))
        if has is False:
            continue  # nothing of the target lives there
        needed = (recorded is not None and it in recorded) or has is True
        if it in entries and os.path.isdir(os.path.join(step_dir, it)):
            read.append(it)
        elif needed:
            missing.append(it)
    return read, missing


def _restore_step(root: str, step: int, target, items, verify: bool) -> tuple[dict, Optional[str]]:
    """(restored items, note or None) of one step; raises _Unusable."""
    step_dir = os.path.join(root, str(step))
    if not os.path.isdir(step_dir):
        raise _Unusable("no such step folder")
    entries = _entries(step_dir)
    record = _read_record(step_dir)
    arrays = [it for it in ARRAY_ITEMS if it in items]
    jsons = [it for it in JSON_ITEMS if it in items]
    tfields = None if target is None else _fields(target)
    legacy = LEGACY_ITEM in entries
    if legacy:
        read = list(arrays)
        _check_items(step_dir, ([LEGACY_ITEM] if arrays else []) + jsons)
    else:
        read, missing = _array_items_to_read(step_dir, entries, record, arrays, tfields)
        _check_items(step_dir, [it for it in ITEMS if (it in missing and it != OPT_ITEM) or it in jsons])
        if OPT_ITEM in missing:
            raise _MissingItem(_no_opt_state(step_dir))
    out: dict[str, Any] = {"step": int(step)}
    fields: dict[str, Any] = {}
    failure = None
    for name in ([LEGACY_ITEM] if legacy and read else read) + jsons:  # one item at a time: the reason names it
        try:
            if name in JSON_ITEMS:
                out[name] = _read_json_item(step_dir, name)
            elif legacy:
                fields.update(_read_legacy(os.path.join(step_dir, LEGACY_ITEM), target, tfields, set(read)))
            elif tfields is None:
                fields.update(_host_item(os.path.join(step_dir, name)))
            else:
                sub = {f: v for f, v in tfields.items() if item_of(f) == name}
                fields.update(_fields(_restore_tree(os.path.join(step_dir, name), sub)))
        except Exception as e:  # noqa: BLE001 — any orbax/tensorstore/json error: this step is unusable
            failure = f"{name} unreadable ({one_line_error(e)})"
            break
    if not _agree(failure is None):
        raise _Unusable(failure or "unreadable on another process")
    if arrays:
        full = set(arrays) == set(ARRAY_ITEMS) and target is not None
        out["state"] = _join(target, fields) if full else fields
        out["items"] = [it for it in ARRAY_ITEMS if any(item_of(f) == it for f in fields)]
    if record is None:
        return out, (f"checkpoint step {step} has no {INTEGRITY_FILE} (written before integrity records): "
                     f"restored unverified")
    if verify:
        for name in jsons:
            want = record.get("json_sha256", {}).get(name)
            if want is not None and _json_digest(out[name]) != want:
                raise _Unusable(f"checksum mismatch in the {name} item")
        if read:
            if target is None:
                names, info, fps = _host_fingerprints(fields)
            else:
                names, info, dev = device_fingerprints(fields)
                fps = fetch_fingerprints(dev)
            _compare(record, names, info, fps, items=set(read))
    return out, None


def _read_legacy(state_dir: str, target, tfields, items: set) -> dict:
    """{field: subtree} of the fields of `items` from an older checkpoint's single `state` item;
    with only some items, only their arrays are read."""
    if set(items) == set(ARRAY_ITEMS):
        if target is None:
            return _fields(_host_item(state_dir))
        return _fields(_restore_tree(state_dir, target))
    if target is None:
        tree = _host_item(state_dir, keep=lambda name: _array_item(name) in items)
        return {f: v for f, v in _fields(tree).items() if item_of(f) in items}
    sub = {f: v for f, v in tfields.items() if item_of(f) in items}
    return _fields(_restore_tree(state_dir, sub, partial=True))


def _item_metadata(item_dir: str):
    """(flat [(key path, orbax ArrayMetadata)], treedef) of a stored item, read from its metadata."""
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(item_dir)
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
        return jax.tree_util.tree_flatten_with_path(tree if tree is not None else dict(meta))
    except (OSError, ValueError, TypeError, KeyError) as e:  # a damaged _METADATA file reads as no tree
        raise CheckpointError(f"checkpoint item {item_dir}: its metadata is unreadable "
                              f"({one_line_error(e)}); `python -m jaxsora.ckpt verify` checks the run") from None


def item_metadata_tree(item_dir: str) -> dict:
    """The stored tree of an item as nested dicts of orbax array metadata (shape, dtype)."""
    flat, treedef = _item_metadata(item_dir)
    return jax.tree_util.tree_unflatten(treedef, [m for _, m in flat])


def _host_item(item_dir: str, keep=None) -> Any:
    """A stored item as numpy arrays (no target, no devices). `keep(name)`: only those arrays;
    the others come back as ocp.PLACEHOLDER (orbax leaves such leaves unread)."""
    flat, treedef = _item_metadata(item_dir)
    wanted = [keep is None or keep(array_name(p)) for p, _ in flat]
    item = jax.tree_util.tree_unflatten(treedef, [m if w else ocp.PLACEHOLDER for (_, m), w in zip(flat, wanted)])
    args = jax.tree_util.tree_unflatten(
        treedef, [ocp.RestoreArgs(restore_type=np.ndarray) if w else ocp.PLACEHOLDER for w in wanted])
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))


def _host_fingerprints(tree) -> tuple[list, list, list]:
    """(names, [{"shape", "dtype"}], hex fingerprints) of a tree of host arrays (placeholders skipped)."""
    names, info, fps = [], [], []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if x is ocp.PLACEHOLDER:
            continue
        a = np.asarray(x)
        names.append(array_name(p))
        info.append(dict(shape=list(a.shape), dtype=str(a.dtype)))
        fps.append(format_fingerprint(host_fingerprint(a)))
    return names, info, fps


def _expand_items(items) -> tuple:
    """`items` with "state" (the older name of all the array items) expanded; unknown names refused."""
    out = []
    for it in items:
        for name in (ARRAY_ITEMS if it == LEGACY_ITEM else (it,)):
            if name not in ITEMS:
                raise ValueError(f"unknown checkpoint item {name!r} (items: {', '.join(ITEMS)})")
            if name not in out:
                out.append(name)
    return tuple(out)


def restore(directory: str, target, *, step: Optional[int] = None, items: tuple = ITEMS,
            verify: bool = True) -> dict[str, Any]:
    """Restore `items` of a checkpoint: `directory` is a run's outputs folder, its `checkpoints/`
    folder, or one step folder `checkpoints/N` (= step N).

    items: ITEMS (everything: a full resume, --load), or some of them, e.g. WEIGHT_ITEMS (+ JSON
    items): the other items' folders are never opened, and only the arrays read are verified.
    "state" stands for all the array items (ARRAY_ITEMS).
    target: the TrainState as ShapeDtypeStructs carrying the target shardings (`StatePlan.
    abstract_sharded`): each array is read straight into its shards, on whatever mesh this run has.
    None: the state as host numpy arrays.
    step=None: the newest intact step — a partial, unreadable or mismatching one is skipped with
    one line on stderr; an explicit step that is not intact raises CheckpointError. A step that
    lacks the opt_state item when it is asked for (a copy of the weights only) raises
    CheckpointError naming the item (no fallback).
    Returns {"step": int, "state": TrainState (all array items read, with a target) or
    {field: subtree} of the fields read, "items": [array items read], "config": dict, "data": dict,
    "meta": dict (those asked for), "skipped": [(step, reason), ...]}.
    """
    install_noise_filters()
    items = _expand_items(items)
    root, named = resolve_checkpoint(directory, step)
    candidates = [int(named)] if named is not None else checkpoint_steps(root)[::-1]
    skipped: list[tuple[int, str]] = []
    for i, s in enumerate(candidates):
        try:
            with quiet_orbax():
                res, note = _restore_step(root, s, target, items, verify)
        except _MissingItem as e:
            raise CheckpointError(f"checkpoint step {s} in {root} {e}") from None
        except _Unusable as e:
            if named is not None:
                raise CheckpointError(f"checkpoint step {s} in {root} is not usable: {e}") from None
            skipped.append((s, str(e)))
            _REPLACE_STEPS.setdefault(os.path.realpath(root), set()).add(s)
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            say(f"checkpoint step {s} skipped: {e}; "
                 + (f"trying step {nxt}" if nxt is not None else "no older checkpoint left"))
            continue
        if note:
            say(note)
        res["skipped"] = skipped
        return res
    raise CheckpointError(f"no intact checkpoint in {root}: "
                          + "; ".join(f"step {s} ({why})" for s, why in skipped))


def check_resumable(directory: str, step: Optional[int] = None) -> None:
    """--load's early check, from the folders alone (nothing is read; meant to run before anything
    compiles): raises the CheckpointError `restore` would raise when the step it would resume from —
    the one asked for, or the newest one with every JSON item — lacks the opt_state item (a copy of
    the weights only). Checksums are still checked by `restore`."""
    root, named = resolve_checkpoint(directory, step)
    for s in ([int(named)] if named is not None else checkpoint_steps(root)[::-1]):
        step_dir = os.path.join(root, str(s))
        if is_legacy_layout(step_dir) or os.path.isdir(os.path.join(step_dir, OPT_ITEM)):
            return
        if not all(os.path.isdir(os.path.join(step_dir, it)) for it in JSON_ITEMS) or not has_weights(step_dir):
            continue  # partial: restore skips it
        raise CheckpointError(f"checkpoint step {s} in {root} {_no_opt_state(step_dir)}")


# ----------------------------------------------------------------------------------------------
# weights only (sampling, conversion, --ckpt-path): never the optimizer's item
# ----------------------------------------------------------------------------------------------
# Fields of an older `state` item that may hold model variables besides params/ema.
LEGACY_EXTRA_FIELDS = ("frozen", "buffers", "model_state")


def weight_fields(step_dir: str, ema: bool = False) -> list[tuple[str, str, Any]]:
    """[(field, item folder, stored tree of the field as array metadata)] holding the model's
    variables, in lookup order: "ema" or "params", then the frozen variables — read from the items'
    metadata only (the per-item layout: params/, ema/, frozen/; the older one: state/). Raises
    CheckpointError when the weights asked for are not there ("... has no 'ema' entry ...")."""
    install_noise_filters()
    with quiet_orbax():
        return _weight_fields(step_dir, "ema" if ema else "params")


def _weight_fields(step_dir: str, first: str) -> list[tuple[str, str, Any]]:
    if is_legacy_layout(step_dir):
        item_dir = os.path.join(step_dir, LEGACY_ITEM)
        tree = item_metadata_tree(item_dir)
        if first not in tree:
            raise CheckpointError(f"{step_dir}: the checkpoint's state has no {first!r} entry (it has {sorted(tree)})")
        return [(f, item_dir, tree[f]) for f in (first, *LEGACY_EXTRA_FIELDS) if f in tree]
    out = []
    for f in (first, "frozen"):
        item_dir = os.path.join(step_dir, f)
        if not os.path.isdir(item_dir):
            if f == first:
                have = [it for it in ARRAY_ITEMS if os.path.isdir(os.path.join(step_dir, it))]
                raise CheckpointError(f"{step_dir}: the checkpoint has no {first!r} entry (it has {have})")
            continue
        tree = item_metadata_tree(item_dir)
        if f in tree:
            out.append((f, item_dir, tree[f]))
        elif f == first:
            raise CheckpointError(f"{step_dir}/{f}: the checkpoint has no {first!r} entry (it has {sorted(tree)})")
    return out


def read_weights(step_dir: str, fields) -> dict:
    """{field: subtree of numpy arrays} of some weight fields ("params", "ema", "frozen", ... as
    `weight_fields` gives them) of one step folder, verified against its integrity record (the
    arrays read only). The optimizer's item is never opened."""
    install_noise_filters()
    fields = list(fields)
    out: dict[str, Any] = {}
    with quiet_orbax():
        if is_legacy_layout(step_dir):
            tree = _host_item(os.path.join(step_dir, LEGACY_ITEM), keep=lambda n: n.split(".", 1)[0] in fields)
            out = {f: v for f, v in _fields(tree).items() if f in fields}
        else:
            for f in fields:
                out.update({k: v for k, v in _fields(_host_item(os.path.join(step_dir, f))).items() if k == f})
    verify_arrays(step_dir, out)
    return out


def verify_arrays(step_dir: str, tree) -> Optional[bool]:
    """Check arrays read from a step folder (a tree whose key paths are their stored names, e.g.
    {"ema": {...}}; host or device arrays) against the step's integrity record: only these arrays
    are compared. True when they match, None for a checkpoint without a record (older, or a
    `convert from-torch` output); raises CheckpointError (one line) for a mismatch or a save that
    did not finish."""
    try:
        record = _read_record(step_dir)
    except _Unusable as e:
        raise CheckpointError(f"checkpoint {step_dir} is not usable: {e}") from None
    if record is None:
        return None
    leaves = jax.tree.leaves(tree)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        names, info, dev = device_fingerprints(tree)
        fps = fetch_fingerprints(dev)
    else:
        names, info, fps = _host_fingerprints(tree)
    try:
        _compare(record, names, info, fps, subset=True)
    except _Unusable as e:
        raise CheckpointError(f"checkpoint {step_dir} is not usable: {e} (python -m jaxsora.ckpt verify "
                              f"{step_dir} checks it all)") from None
    return True


def read_json_item(step_dir: str, name: str, *, verify: bool = True):
    """A JSON item (config, data, meta) of a step folder, checked against the step's integrity
    record when it has one (verify=True). Raises CheckpointError (one line) when it is missing,
    unreadable or does not match."""
    try:
        value = _read_json_item(step_dir, name)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: its {name} item is unreadable ({one_line_error(e)})") from None
    if verify:
        try:
            want = ((_read_record(step_dir) or {}).get("json_sha256") or {}).get(name)
        except _Unusable as e:
            raise CheckpointError(f"checkpoint {step_dir} is not usable: {e}") from None
        if want is not None and _json_digest(value) != want:
            raise CheckpointError(f"checkpoint {step_dir} is not usable: checksum mismatch in the {name} item")
    return value


def write_integrity_record(step_dir: str, step: int, arrays: dict, jsons: dict) -> dict:
    """Write the integrity record (integrity.json, format 2) of a step folder assembled without a
    `Checkpointer` (e.g. by `python -m jaxsora.tools.average`): write it last, before the folder gets
    its final name. arrays: {array name: {"item", "shape", "dtype", "fingerprint"}} of every array
    written (fingerprints: `fingerprint.format_fingerprint(fingerprint.host_fingerprint(a))`);
    jsons: {JSON item: the value written}. Returns the record."""
    items: dict = {}
    for e in arrays.values():
        it = items.setdefault(e["item"], dict(arrays=0, bytes=0))
        it["arrays"] += 1
        it["bytes"] += int(np.prod(e["shape"], dtype=np.int64)) * jax.numpy.dtype(e["dtype"]).itemsize
    doc = _integrity_doc(step, {k: _json_digest(v) for k, v in jsons.items()}, items,
                         {n: dict(shape=[int(d) for d in e["shape"]], dtype=str(e["dtype"]), item=e["item"],
                                  fingerprint=e["fingerprint"]) for n, e in arrays.items()})
    write_json_atomic(os.path.join(step_dir, INTEGRITY_FILE), doc)
    return doc


def _integrity_doc(step: int, json_digests: dict, items: dict, arrays: dict) -> dict:
    """The integrity record (format 2) of a step: {item: {arrays, bytes}}, per-array shape, dtype,
    item and fingerprint, and the sha256 of each JSON item. The one place its layout is written."""
    from jaxsora import __version__

    return dict(complete=True, format=INTEGRITY_FORMAT, step=int(step), jaxsora=__version__,
                fingerprint=FINGERPRINT_METHOD, state_bytes=sum(int(it["bytes"]) for it in items.values()),
                json_sha256=json_digests, items=items, arrays=arrays)


# ----------------------------------------------------------------------------------------------
# checking without a model (the `python -m jaxsora.ckpt` CLI)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepReport:
    step: int
    status: str  # "intact" | "corrupt" | "partial" | "unverified"
    reason: str = ""
    bytes: int = 0
    items: tuple = ()  # the items there (folders), e.g. ("params", "frozen", "ema", "config", ...)
    contents: str = ""  # "full" | "weights only" | "full (state/ layout)" | ...


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def step_contents(step_dir: str) -> tuple[tuple, str]:
    """(items present, a short description) of a step folder, from its folders (and, for the
    older layout, the names in its state item's metadata): "full" (weights and optimizer),
    "weights only" (no opt_state: a copy for sampling, or a converter output), ..."""
    try:
        entries = set(os.listdir(step_dir))
    except OSError:
        return (), "unreadable"
    present = tuple(it for it in (LEGACY_ITEM, *ITEMS) if it in entries
                    and os.path.isdir(os.path.join(step_dir, it)))
    if LEGACY_ITEM in present:
        try:
            with quiet_orbax():
                fields = set(item_metadata_tree(os.path.join(step_dir, LEGACY_ITEM)))
        except Exception:  # noqa: BLE001 — reported by verify_step
            return present, "state/ layout"
        return present, ("full" if "opt_state" in fields else "weights only") + " (state/ layout)"
    if "params" in present or "ema" in present:
        if OPT_ITEM in present:
            return present, "full"
        return present, "weights only" + ("" if "ema" in present else ", no ema")
    return present, "no weights" if present else "empty"


# verify reads the state in groups of arrays of at most this many bytes (bounds host memory)
_VERIFY_GROUP_BYTES = 1 << 30


def _grouped_host_fingerprints(item_dir: str) -> tuple[list, list, list]:
    """Host fingerprints of every array of an item, read in groups of at most _VERIFY_GROUP_BYTES."""
    names, info, fps = [], [], []
    flat, _ = _item_metadata(item_dir)
    group, group_bytes = [], 0
    for i, (p, m) in enumerate(flat):
        group.append(array_name(p))
        group_bytes += int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
        if group_bytes >= _VERIFY_GROUP_BYTES or i == len(flat) - 1:
            n, inf, f = _host_fingerprints(_host_item(item_dir, keep=set(group).__contains__))
            names, info, fps = names + n, info + inf, fps + f
            group, group_bytes = [], 0
    return names, info, fps


def verify_step(root: str, step: int) -> StepReport:
    """Check one checkpoint on the host: items present, integrity record complete, every JSON item
    and every array readable and equal to its recorded checksum. No model config, no devices; the
    arrays are read in groups of at most _VERIFY_GROUP_BYTES. A step without the opt_state item (a
    copy of the weights) is intact when the items it has are."""
    install_noise_filters()
    step_dir = os.path.join(root, str(step))
    size = folder_bytes(step_dir)
    present, contents = step_contents(step_dir)
    report = dict(bytes=size, items=present, contents=contents)
    try:
        with quiet_orbax():
            record = _read_record(step_dir)
            if record is None:  # an older checkpoint: whatever items it has (converter outputs lack some)
                jsons = [n for n in JSON_ITEMS if os.path.isdir(os.path.join(step_dir, n))]
            else:
                jsons = list(record.get("json_sha256", {}))
            entries = _entries(step_dir)
            if LEGACY_ITEM in entries:
                folders, logical = [LEGACY_ITEM], set(ARRAY_ITEMS)
            else:
                recorded = _recorded_items(record)
                wanted = [it for it in ARRAY_ITEMS if (recorded is None and it in entries)
                          or (recorded is not None and it in recorded)]
                if not wanted:
                    wanted = ["params"]  # no arrays in either layout
                folders = [it for it in wanted if it != OPT_ITEM or it in entries]  # opt_state may be left out
                logical = set(folders)
            _check_items(step_dir, [*folders, *jsons])
            for name in jsons:
                try:
                    value = _read_json_item(step_dir, name)
                except (OSError, ValueError) as e:
                    raise _Unusable(f"{name} unreadable ({one_line_error(e)})") from None
                if record is not None and _json_digest(value) != record["json_sha256"][name]:
                    raise _Unusable(f"checksum mismatch in the {name} item")
            names, info, fps = [], [], []
            for folder in folders:
                try:
                    n, inf, f = _grouped_host_fingerprints(os.path.join(step_dir, folder))
                except Exception as e:  # noqa: BLE001 — any orbax/tensorstore error
                    raise _Unusable(f"{folder} unreadable ({one_line_error(e)})") from None
                names, info, fps = names + n, info + inf, fps + f
            if record is None:
                return StepReport(step, "unverified", f"no {INTEGRITY_FILE}: an older checkpoint or a converter output",
                                  **report)
            _compare(record, names, info, fps, items=logical)
    except _Unusable as e:
        status = "partial" if str(e).startswith("partial") or str(e) == "empty folder" else "corrupt"
        return StepReport(step, status, str(e), **report)
    return StepReport(step, "intact", "", **report)
