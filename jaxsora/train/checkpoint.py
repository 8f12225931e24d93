"""Training checkpoints (orbax CheckpointManager, async), with an integrity record per step.

Folder layout (`<outputs>/<experiment>/checkpoints/`):

    <step>/                     one checkpoint; <step> = optimizer steps applied
      state/                    TrainState: step, params (trainable), frozen (frozen Params and
                                Buffers), opt_state, ema, rng — sharded arrays (OCDBT/zarr)
      config/                   JSON: the resolved run config, with "model" = STDiT3Config fields
      data/                     JSON: the loader state (epoch, index, fingerprint)
      meta/                     JSON: wandb run id, jaxsora version, mesh, process count, wall time,
                                "checkpoint_format": 2 (absent in checkpoints older than integrity.json)
      integrity.json            the completion marker and checksums (see below)
    <step>.orbax-checkpoint-tmp a save in progress (or one that died): never read

Integrity. When `Checkpointer.save` is called, one jitted program computes a 64-bit fingerprint
of every array of the TrainState on the device (`train.fingerprint.device_fingerprints`); it is dispatched
asynchronously, like the save itself, so the step loop does not wait for it. The fingerprint is
layout independent: each array is read as its logical C-order sequence of 32-bit words (2-byte
and 1-byte dtypes widened, 8-byte dtypes split in two, low word first) and reduced with integer
sums modulo 2^32, which are exact whatever the sharding or the reduction order — a checkpoint
saved on one mesh verifies on another, and `host_fingerprint` (numpy) gives the same bits.
Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` when every
process has finished; just before that rename, in orbax's finalize thread, process 0 fetches the
fingerprints and writes `integrity.json` into the folder ({"complete": true, per-array shape,
dtype and fingerprint keyed by orbax's array name, a sha256 of each JSON item, the jaxsora
version}). The marker is therefore committed by the same atomic rename as the data: a `<step>/`
folder of this format without it was not written by a finished save. Multi-host: the fingerprints
are global reductions, so every process holds the same values; only process 0 writes the record
and prints, and restore's skip decisions are agreed between processes.

`restore` reads the newest step (or the one asked for), recomputes the fingerprints of what it
read and compares; a step that is partial, unreadable or does not match is skipped with one line
on stderr and the next older one is tried (an explicitly named step raises `CheckpointError`).
Checkpoints older than integrity records restore with a one-line note that they are unverified.
A failed write (disk full, I/O error) raises `CheckpointWriteError` with one line, and the
unfinished step folder is removed so the earlier checkpoints stay the newest.

The newest `keep` checkpoints are kept (`keep=0`: all). Restoring uses an abstract target that
carries the *current* mesh's shardings, so a checkpoint saved on one mesh/device count restores on
another. `python -m jaxsora.ckpt list|verify DIR` checks checkpoints without a model config;
`python -m jaxsora.convert to-torch <step dir or checkpoints/>` reads the same folders.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxsora.errors import UserError
from jaxsora.train.fingerprint import (array_name, device_fingerprints, fetch_fingerprints, format_fingerprint,
                                      host_fingerprint)

ITEMS = ("state", "config", "data", "meta")
JSON_ITEMS = ("config", "data", "meta")
INTEGRITY_FILE = "integrity.json"
INTEGRITY_FORMAT = 1  # the layout of integrity.json itself
# meta["checkpoint_format"]: 2 = written with integrity.json (older checkpoints have no such key)
CHECKPOINT_FORMAT = 2
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
# quiet failures: orbax/tensorstore print tracebacks from background threads
# ----------------------------------------------------------------------------------------------
# What a failed read or write leaves behind besides the exception we turn into one line:
# - orbax logs the exception (with traceback) from its save threads (absl logger, ERROR);
# - when one read fails, orbax closes its event loop while other tensorstore reads are still
#   running; their completion callbacks then raise "Event loop is closed", the abandoned read
#   coroutines raise when garbage collected (both reported through sys.unraisablehook), and the
#   abandoned futures log "Future exception was never retrieved" (asyncio logger).
# The filters below drop exactly those records; everything else passes.
_IO_TEXT = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|Input/output error|"
                      r"os_error_code='\d+'|RESOURCE_EXHAUSTED|Stale file handle")
_STORE_TEXT = re.compile(r"OCDBT|TensorStore|tensorstore|zarr|Encountered error while reading|Event loop is closed")


def _chain(exc):
    """An exception, its causes/contexts and the members of exception groups (depth-limited)."""
    todo, seen, out = [exc], set(), []
    while todo and len(out) < 32:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])
    return out


def _io_failure(exc) -> Optional[str]:
    """The reason (e.g. 'No space left on device') when `exc` is, or wraps, a filesystem error."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return os.strerror(e.errno)
    for e in _chain(exc):
        m = re.search(r"os_error_code='(\d+)'", str(e))
        if m:
            return os.strerror(int(m.group(1)))
        m = _IO_TEXT.search(str(e))
        if m:
            return m.group(0)
    for e in _chain(exc):
        if isinstance(e, OSError):
            return str(e) or type(e).__name__
    return None


class _OrbaxIOErrorLogs(logging.Filter):
    """Drops orbax's own ERROR logs of a filesystem failure (re-raised to the caller in one line)."""

    def filter(self, record):
        if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in (record.pathname or ""):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and _io_failure(exc)) or _IO_TEXT.search(record.getMessage()))


class _AbandonedReadLogs(logging.Filter):
    """Drops asyncio's reports of tensorstore reads abandoned after another read failed."""

    def filter(self, record):
        msg = record.getMessage()
        if "exception was never retrieved" not in msg and not msg.startswith("Exception in callback"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not _STORE_TEXT.search(msg + " " + " ".join(str(e) for e in _chain(exc)))


class _OrbaxChatter(logging.Filter):
    """While reading checkpoints: drops orbax's own log records (warnings about metadata files of
    the item folders it reads, errors it also raises — which become one line)."""

    def filter(self, record):
        return f"{os.sep}orbax{os.sep}" not in (record.pathname or "")


@contextlib.contextmanager
def _quiet_orbax():
    f = _OrbaxChatter()
    logger = logging.getLogger("absl")
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _abandoned_read_noise(unraisable) -> bool:
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    # orbax's read coroutines abandoned by the failed gather, closed at garbage collection
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _install_noise_filters():
    """Idempotent. The unraisable hook is re-installed when something replaced it (pytest does,
    per test)."""
    for name, cls in (("absl", _OrbaxIOErrorLogs), ("asyncio", _AbandonedReadLogs)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())
    previous = sys.unraisablehook
    if getattr(previous, "_jaxsora_filter", False):
        return

    def hook(unraisable):
        if not _abandoned_read_noise(unraisable):
            previous(unraisable)

    hook._jaxsora_filter = True
    sys.unraisablehook = hook


def _one_line(exc, limit: int = 240) -> str:
    """The root cause of an orbax/tensorstore exception as one line of at most `limit` characters
    (tensorstore appends its whole spec and source locations; they are cut)."""
    chain = [e for e in _chain(exc) if str(e).strip()]
    e = chain[-1] if chain else exc
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.split(r" \[(?:source locations|tensorstore_spec)=", text)[0]
    if isinstance(e, KeyError):
        text = text.strip("'\"")
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _say(msg: str):
    if jax.process_index() == 0:
        print(f"[jaxsora] {msg}", file=sys.stderr, flush=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _write_json_atomic(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


# Steps that `restore` skipped as corrupt or partial, per checkpoints root: a Checkpointer on that
# root replaces such a step folder when training reaches the step again (instead of keeping it).
_REPLACE_STEPS: dict[str, set] = {}


class Checkpointer:
    """Asynchronous saves of (TrainState, config, loader state, meta) with integrity records.

    keep: the newest `keep` checkpoints are kept; 0 or None keeps all.
    async_save: False waits for each save to be written before `save` returns.
    """

    def __init__(self, directory: str, *, keep: Optional[int] = 3, async_save: bool = True):
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
        _install_noise_filters()
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
                                       f"{_io_failure(e)}") from None

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
        meta = {**meta, "checkpoint_format": CHECKPOINT_FORMAT}
        jsons = dict(config=config, data=data, meta=meta)
        nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        with self._lock:
            self._pending = _Pending(step, names, info, fps, {k: _json_digest(v) for k, v in jsons.items()}, nbytes)
        self._in_flight = (step, nbytes)
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
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
        from jaxsora import __version__

        doc = dict(complete=True, format=INTEGRITY_FORMAT, step=rec.step, jaxsora=__version__,
                   fingerprint=FINGERPRINT_METHOD, state_bytes=rec.nbytes, json_sha256=rec.json_digests,
                   arrays={n: dict(i, fingerprint=f) for n, i, f in zip(rec.names, rec.info, fps)})
        tmp = sorted(glob.glob(os.path.join(self.directory, f"{rec.step}{TMP_SUFFIX}*")))
        folder = tmp[-1] if tmp else os.path.join(self.directory, str(rec.step))
        _write_json_atomic(os.path.join(folder, INTEGRITY_FILE), doc)

    def _failed(self, step: Optional[int], nbytes: int, exc: BaseException):
        """A save that raised: filesystem errors → remove the partial folder, fresh manager,
        CheckpointWriteError (raised from here); anything else returns (the caller re-raises)."""
        reason = _io_failure(exc)
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
            free = _fmt_bytes(shutil.disk_usage(self.directory).free)
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
            f"{_fmt_bytes(nbytes)}, {free} free); the partial folder was removed, earlier checkpoints "
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
        raise _Unusable(f"{INTEGRITY_FILE} unreadable ({_one_line(e)})") from None
    if not isinstance(rec, dict) or rec.get("complete") is not True or not isinstance(rec.get("arrays"), dict):
        raise _Unusable(f"partial: {INTEGRITY_FILE} does not mark the save complete")
    return rec


def _check_items(step_dir: str, items) -> None:
    try:
        entries = os.listdir(step_dir)
    except OSError as e:
        raise _Unusable(f"unreadable folder ({_one_line(e)})") from None
    if not entries:
        raise _Unusable("empty folder")
    missing = [it for it in items if not os.path.isdir(os.path.join(step_dir, it))]
    if missing:
        raise _Unusable(f"partial: no {', '.join(missing)} folder{'s' if len(missing) > 1 else ''}")


def _compare(record: dict, names: list, info: list, fps: list) -> None:
    """Raise _Unusable when the arrays read differ from the integrity record."""
    want = record["arrays"]
    got = {n: dict(i, fingerprint=f) for n, i, f in zip(names, info, fps)}
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        what = (f"{len(missing)} recorded arrays were not read (e.g. {missing[0]})" if missing
                else f"{len(extra)} arrays are not in the record (e.g. {extra[0]})")
        raise _Unusable(f"the state does not match {INTEGRITY_FILE}: {what}")
    bad = [n for n in sorted(want) if (want[n].get("shape"), want[n].get("dtype"), want[n].get("fingerprint"))
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


def _restore_step(root: str, step: int, target, items, verify: bool) -> tuple[dict, Optional[str]]:
    """(restored items, note or None) of one step; raises _Unusable."""
    step_dir = os.path.join(root, str(step))
    if not os.path.isdir(step_dir):
        raise _Unusable("no such step folder")
    _check_items(step_dir, items)
    record = _read_record(step_dir)
    out: dict[str, Any] = {"step": int(step)}
    failure = None
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        for name in items:  # one item at a time, so the reason names the item
            try:
                if name == "state" and target is None:
                    out[name] = _host_state(os.path.join(step_dir, "state"))
                    continue
                args = ocp.args.StandardRestore(target) if name == "state" else ocp.args.JsonRestore()
                out[name] = ckptr.restore(step_dir, args=ocp.args.Composite(**{name: args}))[name]
            except Exception as e:  # noqa: BLE001 — any orbax/tensorstore/json error: this step is unusable
                failure = f"{name} unreadable ({_one_line(e)})"
                break
    if not _agree(failure is None):
        raise _Unusable(failure or "unreadable on another process")
    if record is None:
        return out, (f"checkpoint step {step} has no {INTEGRITY_FILE} (written before integrity records): "
                     f"restored unverified")
    if verify:
        for name in JSON_ITEMS:
            want = record.get("json_sha256", {}).get(name)
            if name in out and want is not None and _json_digest(out[name]) != want:
                raise _Unusable(f"checksum mismatch in the {name} item")
        if "state" in out:
            if target is None:
                names, info, fps = _host_fingerprints(out["state"])
            else:
                names, info, dev = device_fingerprints(out["state"])
                fps = fetch_fingerprints(dev)
            _compare(record, names, info, fps)
    return out, None


def _state_metadata(state_dir: str):
    """(flat [(key path, orbax ArrayMetadata)], treedef) of a stored state, read from its metadata."""
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(state_dir)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    return jax.tree_util.tree_flatten_with_path(tree if tree is not None else dict(meta))


def _host_state(state_dir: str, names: Optional[set] = None) -> Any:
    """The stored TrainState as numpy arrays (no target, no devices). `names`: only those arrays;
    the others come back as ocp.PLACEHOLDER (orbax leaves such leaves unread)."""
    flat, treedef = _state_metadata(state_dir)
    wanted = [names is None or array_name(p) in names for p, _ in flat]
    item = jax.tree_util.tree_unflatten(treedef, [m if w else ocp.PLACEHOLDER for (_, m), w in zip(flat, wanted)])
    args = jax.tree_util.tree_unflatten(
        treedef, [ocp.RestoreArgs(restore_type=np.ndarray) if w else ocp.PLACEHOLDER for w in wanted])
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))


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


def restore(directory: str, target, *, step: Optional[int] = None, items: tuple = ITEMS,
            verify: bool = True) -> dict[str, Any]:
    """Restore `items` of a checkpoint: `directory` is a run's outputs folder, its `checkpoints/`
    folder, or one step folder `checkpoints/N` (= step N).

    target: the TrainState as ShapeDtypeStructs carrying the target shardings (`StatePlan.
    abstract_sharded`): each array is read straight into its shards, on whatever mesh this run has.
    None: the state as host numpy arrays.
    step=None: the newest intact step — a partial, unreadable or mismatching one is skipped with
    one line on stderr; an explicit step that is not intact raises CheckpointError.
    Returns {"step": int, "state": TrainState, "config": dict, "data": dict, "meta": dict,
    "skipped": [(step, reason), ...]}.
    """
    _install_noise_filters()
    root, named = resolve_checkpoint(directory, step)
    candidates = [int(named)] if named is not None else checkpoint_steps(root)[::-1]
    skipped: list[tuple[int, str]] = []
    for i, s in enumerate(candidates):
        try:
            with _quiet_orbax():
                res, note = _restore_step(root, s, target, tuple(items), verify)
        except _Unusable as e:
            if named is not None:
                raise CheckpointError(f"checkpoint step {s} in {root} is not usable: {e}") from None
            skipped.append((s, str(e)))
            _REPLACE_STEPS.setdefault(os.path.realpath(root), set()).add(s)
            nxt = candidates[i + 1] if i + 1 < len(candidates) else None
            _say(f"checkpoint step {s} skipped: {e}; "
                 + (f"trying step {nxt}" if nxt is not None else "no older checkpoint left"))
            continue
        if note:
            _say(note)
        res["skipped"] = skipped
        return res
    raise CheckpointError(f"no intact checkpoint in {root}: "
                          + "; ".join(f"step {s} ({why})" for s, why in skipped))


# ----------------------------------------------------------------------------------------------
# checking without a model (the `python -m jaxsora.ckpt` CLI)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepReport:
    step: int
    status: str  # "intact" | "corrupt" | "partial" | "unverified"
    reason: str = ""
    bytes: int = 0


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


# verify reads the state in groups of arrays of at most this many bytes (bounds host memory)
_VERIFY_GROUP_BYTES = 1 << 30


def verify_step(root: str, step: int) -> StepReport:
    """Check one checkpoint on the host: items present, integrity record complete, every JSON item
    and every array readable and equal to its recorded checksum. No model config, no devices; the
    state is read in groups of arrays of at most _VERIFY_GROUP_BYTES."""
    _install_noise_filters()
    step_dir = os.path.join(root, str(step))
    size = folder_bytes(step_dir)
    try:
        with _quiet_orbax():
            record = _read_record(step_dir)
            if record is None:  # an older checkpoint: whatever items it has (converter outputs lack some)
                jsons = [n for n in JSON_ITEMS if os.path.isdir(os.path.join(step_dir, n))]
            else:
                jsons = list(record.get("json_sha256", {}))
            _check_items(step_dir, ["state", *jsons])
            for name in jsons:
                try:
                    with open(os.path.join(step_dir, name, "metadata")) as f:
                        value = json.load(f)
                except (OSError, ValueError) as e:
                    raise _Unusable(f"{name} unreadable ({_one_line(e)})") from None
                if record is not None and _json_digest(value) != record["json_sha256"][name]:
                    raise _Unusable(f"checksum mismatch in the {name} item")
            state_dir = os.path.join(step_dir, "state")
            names, info, fps = [], [], []
            try:
                flat, _ = _state_metadata(state_dir)
                group, group_bytes = [], 0
                for i, (p, m) in enumerate(flat):
                    group.append(array_name(p))
                    group_bytes += int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
                    if group_bytes >= _VERIFY_GROUP_BYTES or i == len(flat) - 1:
                        n, inf, f = _host_fingerprints(_host_state(state_dir, set(group)))
                        names, info, fps = names + n, info + inf, fps + f
                        group, group_bytes = [], 0
            except Exception as e:  # noqa: BLE001 — any orbax/tensorstore error
                raise _Unusable(f"state unreadable ({_one_line(e)})") from None
            if record is None:
                return StepReport(step, "unverified", f"old format: no {INTEGRITY_FILE}", size)
            _compare(record, names, info, fps)
    except _Unusable as e:
        status = "partial" if str(e).startswith("partial") or str(e) == "empty folder" else "corrupt"
        return StepReport(step, status, str(e), size)
    return StepReport(step, "intact", "", size)
