"""`python -m jaxsora.tools.average CKPT [CKPT ...] --output DIR [--steps 400,500,600] [--weights 0.2,0.3,0.5]
[--ema]`: the (weighted) mean of the weights of several checkpoints, written as a weights-only
checkpoint `DIR/<step>/` that sampling, `convert to-torch`, `--ckpt-path` and `ckpt verify` read.

Inputs: step folders (`outputs/run/checkpoints/600`), or run / `checkpoints/` folders with `--steps`
(each of those steps of each such folder; without `--steps`, the newest step of each), in either
checkpoint layout (params/, ema/, frozen/ items, or the older single `state/` item). Two or more.

What is averaged (every floating-point array; other dtypes are copied from the first input):
    default   params ← mean of the params; ema ← mean of the EMAs when every input has an EMA
              (otherwise the output has no ema item, said on stderr)
    --ema     params ← mean of the EMAs (every input needs one); the output has no separate ema
              item, so every reader (sampling, to-torch, --ckpt-path) gets the averaged EMA (sampling
              says it uses the params)
    frozen    copied from the first input (a note when the inputs' records say they differ)
The optimizer state (opt_state/) is never opened. Weights: uniform by default; `--weights` gives one
non-negative number per input (in the order the inputs are listed, `--steps` expanding each folder
in place), normalized to sum 1. The output step is the newest input step (`--out-step` to choose).
The config item is the first input's (the run config: VAE, text encoder, model), the meta item
records the sources and weights ("average"), the data item holds no loader state (`--load` of the
output stops with the one line of a copy without optimizer state).

Streaming: arrays are read a group of consecutive arrays at a time (at most 32 MiB of each input,
a larger array alone), accumulated in float64, cast back to the stored dtype and written before the
next group is read, so peak host memory does not grow with the model: a few times max(32 MiB, the
largest array) above the process's baseline (measured: 0.6 GiB in all for 3 inputs of 1.6 GiB).
Every array read is checked against its input's integrity.json (a corrupt or unfinished input stops
the command with one line; inputs older than integrity records are read with a note); the output
gets its own integrity.json, its fingerprints computed from the arrays written. The step is written
to `DIR/<step>.orbax-checkpoint-tmp-<pid>` and renamed when complete; a failure leaves nothing
behind. DIR must be new or empty; `--overwrite` replaces an earlier average only (a folder whose
every step's meta names this tool), never a run's checkpoints nor a folder holding an input.
One process, on the host (no accelerator is taken).

Exit status: 0 written, 2 a usage mistake or an unusable input (one line on stderr; --debug shows
the traceback).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

# Host work only: never take an accelerator (a training job may hold it).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.cli import ArgumentParser, hidden_aliases  # noqa: E402
from jaxsora.errors import BadInput, OutputExists, run_cli  # noqa: E402
from jaxsora.tools.lazy_save import LazyArray, save_item  # noqa: E402

PROG = "jaxsora.tools.average"
# Arrays are read (and averaged) in groups of consecutive arrays of at most this many stored bytes
# per input (an array larger than that alone): bounds host memory, and amortizes orbax's per-read cost.
GROUP_BYTES = 32 << 20


def _remove_settled(path: str, settle_s: float = 0.3, limit_s: float = 20.0) -> None:
    """Remove `path` and keep removing it until it stays gone for `settle_s`: a save that failed midway
    can leave orbax/tensorstore writes in flight (other arrays, metadata) that land after a first
    rmtree, and a refused average must leave nothing behind."""
    deadline = time.monotonic() + limit_s
    gone_since = None
    while time.monotonic() < deadline:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= settle_s:
            return
        time.sleep(0.05)


def _note(msg: str):
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------
def parse_steps(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise BadInput(f"--steps expects step numbers separated by commas (e.g. 400,500,600), got {text!r}") from None
    if not steps or any(s < 0 for s in steps):
        raise BadInput(f"--steps expects step numbers separated by commas (e.g. 400,500,600), got {text!r}")
    return steps


def parse_weights(text: str | None, n: int) -> list[float]:
    """The weights of n inputs from `--weights` ("0.2,0.3,0.5"; None: uniform), normalized to sum 1."""
    if text is None:
        return normalize_weights(None, n)
    try:
        raw = [float(w) for w in text.split(",")]
    except ValueError:
        raise BadInput(f"--weights expects numbers separated by commas (e.g. 0.2,0.3,0.5), got {text!r}") from None
    return normalize_weights(raw, n)


def normalize_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """n finite non-negative weights, not all zero, divided by their sum (None: uniform)."""
    if weights is None:
        return [1.0 / n] * n
    raw = [float(w) for w in weights]
    shown = ",".join(f"{w:g}" for w in raw)
    if len(raw) != n:
        raise BadInput(f"--weights has {len(raw)} value{'s' if len(raw) != 1 else ''} ({shown}) for {n} checkpoints")
    if not all(math.isfinite(w) and w >= 0 for w in raw):
        raise BadInput(f"--weights must be finite and non-negative, got {shown}")
    total = sum(raw)
    if total <= 0:
        raise BadInput(f"--weights must not all be zero, got {shown}")
    return [w / total for w in raw]


def resolve_inputs(paths: Sequence[str], steps: Sequence[int]) -> list[str]:
    """Step folders from the CKPT arguments (see the module docstring)."""
    from jaxsora import checkpoint as ck

    out: list[str] = []
    for path in paths:
        root, named = ck.resolve_checkpoint(path)  # one line for a missing folder or one without checkpoints
        if named is not None:
            if steps:
                raise BadInput(f"--steps picks steps of run or checkpoints folders, but {path} is the folder of step "
                               f"{named}: give the steps' folders, or the checkpoints folder with --steps")
            dirs = [os.path.join(root, str(named))]
        elif steps:
            dirs = []
            for s in steps:
                ck.resolve_checkpoint(root, s)  # one line naming the steps there
                dirs.append(os.path.join(root, str(s)))
        else:
            dirs = [os.path.join(root, str(ck.checkpoint_steps(root)[-1]))]
        for d in dirs:
            if not ck.has_weights(d):
                raise BadInput(f"{d} is not a jaxsora checkpoint (no params/, ema/ or state/ folder)")
        out.extend(dirs)
    seen: dict[str, str] = {}
    for d in out:
        real = os.path.realpath(d)
        if real in seen:
            raise BadInput(f"the checkpoint {d} is given twice (use --weights to weigh it more)")
        seen[real] = d
    if len(out) < 2:
        raise BadInput(f"one checkpoint given ({out[0]}): averaging needs two or more (several step folders, or a "
                       "checkpoints folder with --steps 400,500,600)")
    return out


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output(out: str, inputs: Sequence[str], overwrite: bool) -> None:
    """Refuse an output folder that exists (unless --overwrite and it holds only earlier averages) or
    that holds, or is inside, an input — before anything is read."""
    from jaxsora import checkpoint as ck

    for d in inputs:
        if _inside(d, out) or _inside(out, d):
            raise BadInput(f"--output {out} would hold or be inside the input {d}: choose another folder")
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise OutputExists(f"--output {out} exists and is not a folder")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    if not overwrite:
        raise OutputExists(f"--output {out} exists and is not empty: pass --overwrite to replace it")
    for e in entries:
        path = os.path.join(out, e)
        if ck.TMP_SUFFIX in e and e.split(".", 1)[0].isdigit() and os.path.isdir(path):
            continue  # an unfinished save
        if not (e.isdigit() and os.path.isdir(path)):
            raise BadInput(f"--overwrite replaces only an earlier average: {out} holds {e}: not replaced")
        try:
            with open(os.path.join(path, "meta", "metadata")) as f:
                tool = json.load(f).get("tool")
        except (OSError, ValueError, AttributeError):
            tool = None
        if tool != PROG:
            raise BadInput(f"--overwrite replaces only an earlier average: {path} was not written by {PROG}: "
                           "not replaced")


# ----------------------------------------------------------------------------------------------
# reading the inputs: metadata, then groups of arrays, verified against integrity.json
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    """One array of a field: its name below the field (e.g. "blocks.0.attn.qkv.kernel.value")."""

    rel: str
    shape: tuple
    dtype: str


def _entries(subtree) -> list[Entry]:
    import jax
    import numpy as np

    from jaxsora.checkpoint.fingerprint import array_name

    flat = jax.tree_util.tree_flatten_with_path(subtree)[0]
    return [Entry(array_name(p), tuple(int(d) for d in m.shape), str(np.dtype(m.dtype))) for p, m in flat]


class _Reader:
    """Arrays of one item folder (a weight item, or the older layout's `state` item) as numpy
    arrays, a few at a time; the item's metadata is read once. Each read is checked against the
    step's integrity record."""

    def __init__(self, step_dir: str, item_dir: str, metadata_tree):
        import jax

        from jaxsora.checkpoint.fingerprint import array_name

        self.step_dir, self.item_dir = step_dir, item_dir
        self.flat, self.treedef = jax.tree_util.tree_flatten_with_path(metadata_tree)
        self.names = [array_name(p) for p, _ in self.flat]

    def read(self, names) -> dict:
        """{stored name (e.g. "params.blocks.0....value"): numpy array} of these arrays."""
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        from jaxsora import checkpoint as ck
        from jaxsora.checkpoint.fingerprint import array_name
        from jaxsora.checkpoint.orbax_errors import one_line_error

        names = set(names)
        wanted = [n in names for n in self.names]
        item = jax.tree_util.tree_unflatten(self.treedef, [m if w else ocp.PLACEHOLDER
                                                           for (_, m), w in zip(self.flat, wanted)])
        args = jax.tree_util.tree_unflatten(self.treedef, [ocp.RestoreArgs(restore_type=np.ndarray) if w
                                                           else ocp.PLACEHOLDER for w in wanted])
        try:
            with ocp.PyTreeCheckpointer() as ckptr:
                tree = ckptr.restore(self.item_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
        except Exception as e:  # noqa: BLE001 — any orbax/tensorstore error: this input is unusable
            raise ck.CheckpointError(f"checkpoint {self.step_dir} is not usable: {os.path.basename(self.item_dir)} "
                                     f"unreadable ({one_line_error(e)})") from None
        out = {array_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
               if x is not ocp.PLACEHOLDER}
        ck.verify_arrays(self.step_dir, out)  # one line for a mismatch (None: an older, unrecorded input)
        return out


@dataclasses.dataclass
class Source:
    """One input checkpoint: {field: (item folder, the field's metadata subtree, the item's metadata
    tree)} of the weight fields it has (params, ema, frozen)."""

    step_dir: str
    step: int
    weight: float
    fields: dict
    record: dict | None  # its integrity record (None: older than integrity records)
    config: dict | None

    @property
    def name(self) -> str:
        return self.step_dir


def open_source(step_dir: str, weight: float) -> Source:
    """An input's weight fields (metadata only) and integrity record; one line when it is unusable."""
    from jaxsora import checkpoint as ck
    from jaxsora.checkpoint.orbax_errors import one_line_error

    if ck.verify_arrays(step_dir, {}) is None:  # reads (only) the record: partial or broken → one line
        record = None
        _note(f"{step_dir} has no {ck.INTEGRITY_FILE} (older than integrity records): read unverified")
    else:
        with open(os.path.join(step_dir, ck.INTEGRITY_FILE)) as f:
            record = json.load(f)
    fields: dict[str, Any] = {}
    legacy = ck.is_legacy_layout(step_dir)
    for it in ([ck.LEGACY_ITEM] if legacy else ["params", "ema", "frozen"]):
        item_dir = os.path.join(step_dir, it)
        if not os.path.isdir(item_dir):
            continue
        try:
            tree = ck.item_metadata_tree(item_dir)
        except Exception as e:  # noqa: BLE001 — metadata that orbax cannot read: this input is unusable
            raise ck.CheckpointError(f"checkpoint {step_dir} is not usable: {it} unreadable ({one_line_error(e)})"
                                     ) from None
        for f in (["params", "ema", *ck.LEGACY_EXTRA_FIELDS] if legacy else [it]):
            if f in tree:
                fields[f] = (item_dir, tree[f], tree)
    extra = sorted(set(fields) - {"params", "ema", "frozen"})
    if extra:
        raise ck.CheckpointError(f"{step_dir}: the older layout's {extra[0]!r} field is not supported here "
                                 "(only params, ema and frozen)")
    config = None
    if os.path.isdir(os.path.join(step_dir, "config")):
        config = ck.read_json_item(step_dir, "config")
    step = int(os.path.basename(step_dir)) if os.path.basename(step_dir).isdigit() else 0
    return Source(step_dir, step, weight, fields, record, config)


def check_same_tree(sources: Sequence[Source], field: str) -> list[Entry]:
    """The entries of `field`, equal (names, shapes, dtypes) in every input; else one line naming
    the first array that differs and the two checkpoints."""
    from jaxsora import checkpoint as ck

    def show(e: Entry) -> str:
        return f"{e.dtype}[{', '.join(map(str, e.shape))}]"

    first = _entries(sources[0].fields[field][1])
    ref = {e.rel: e for e in first}
    for src in sources[1:]:
        other = _entries(src.fields[field][1])
        got = {e.rel: e for e in other}
        for e in first:
            g = got.get(e.rel)
            if g is None:
                raise ck.CheckpointError(f"the checkpoints differ: {field}.{e.rel} is in {sources[0].name} but not "
                                         f"in {src.name}")
            if g != e:
                raise ck.CheckpointError(f"the checkpoints differ: {field}.{e.rel} is {show(e)} in {sources[0].name} "
                                         f"but {show(g)} in {src.name}")
        for g in other:
            if g.rel not in ref:
                raise ck.CheckpointError(f"the checkpoints differ: {field}.{g.rel} is in {src.name} but not in "
                                         f"{sources[0].name}")
    return first


def _groups(entries: Sequence[Entry], budget: int) -> list[list[int]]:
    """Consecutive indices, each group at most `budget` stored bytes (an array larger than that alone)."""
    import jax.numpy as jnp
    import numpy as np

    groups: list[list[int]] = []
    size = 0
    for i, e in enumerate(entries):
        n = int(np.prod(e.shape, dtype=np.int64)) * jnp.dtype(e.dtype).itemsize
        if not groups or size + n > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


# ----------------------------------------------------------------------------------------------
# computing and writing one output item, an array at a time
# ----------------------------------------------------------------------------------------------
class _ItemJob:
    """One output item ({out_field: tree}): its arrays in the tree's order, computed a group at a
    time from the sources (average of `field` over all of them, or a copy from the first)."""

    def __init__(self, out_field: str, field: str, entries: list[Entry], sources: Sequence[Source],
                 readers: dict, *, copy: bool, bar, arrays: dict):
        import jax.numpy as jnp

        self.out_field, self.field, self.entries = out_field, field, entries
        self.sources = list(sources[:1]) if copy else list(sources)
        self.readers = [readers[src.fields[field][0]] for src in self.sources]
        self.floating = [jnp.issubdtype(jnp.dtype(e.dtype), jnp.floating) for e in entries]
        self.groups = _groups(entries, GROUP_BYTES)
        self.group_of = {i: g for g in self.groups for i in g}
        self.ready: dict[int, Any] = {}
        self.bar, self.arrays = bar, arrays
        self.differs: str | None = None  # a non-float array that is not the same in every input

    def tree(self):
        """{out_field: tree of LazyArray} shaped as the first source's stored tree of the field; the
        arrays are computed when `lazy_save.save_item` writes them."""
        import functools

        import jax

        subtree = self.sources[0].fields[self.field][1]
        leaves, treedef = jax.tree_util.tree_flatten(subtree)
        assert len(leaves) == len(self.entries)
        lazy = [LazyArray(e.shape, e.dtype, functools.partial(self.take, i)) for i, e in enumerate(self.entries)]
        return {self.out_field: jax.tree_util.tree_unflatten(treedef, lazy)}

    def take(self, i: int):
        from jaxsora.checkpoint.fingerprint import format_fingerprint, host_fingerprint

        if i not in self.ready:
            self._compute(self.group_of[i])
        a = self.ready.pop(i)
        e = self.entries[i]
        self.arrays[f"{self.out_field}.{e.rel}"] = dict(item=self.out_field, shape=list(a.shape), dtype=str(a.dtype),
                                                        fingerprint=format_fingerprint(host_fingerprint(a)))
        if self.bar is not None:
            self.bar.update(1)
        return a

    def _compute(self, group: list[int]):
        import numpy as np

        acc: dict[int, Any] = {}
        for k, (src, reader) in enumerate(zip(self.sources, self.readers)):
            got = reader.read(f"{self.field}.{self.entries[i].rel}" for i in group)
            for i in group:
                x = got.pop(f"{self.field}.{self.entries[i].rel}")
                if not self.floating[i] or len(self.sources) == 1:
                    if k == 0:
                        acc[i] = x
                    elif self.differs is None and not np.array_equal(acc[i], x):
                        self.differs = f"{self.field}.{self.entries[i].rel}"
                elif k == 0:
                    acc[i] = np.asarray(x, np.float64) * src.weight
                else:
                    acc[i] += np.asarray(x, np.float64) * src.weight
            del got
        for i in group:
            self.ready[i] = np.ascontiguousarray(acc.pop(i).astype(np.dtype(self.entries[i].dtype), copy=False))


def _save_json(item_dir: str, value) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        ckptr.save(item_dir, args=ocp.args.JsonSave(value))


# ----------------------------------------------------------------------------------------------
# the whole command
# ----------------------------------------------------------------------------------------------
def _frozen_differs(sources: Sequence[Source]) -> str | None:
    """The first frozen array whose recorded fingerprint differs between inputs (records only: no reads)."""
    base = sources[0].record
    if base is None:
        return None
    for src in sources[1:]:
        if src.record is None:
            continue
        for name, e in base["arrays"].items():
            if name.startswith("frozen.") and src.record["arrays"].get(name, {}).get("fingerprint") != e["fingerprint"]:
                return name
    return None


def _first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            d = _first_difference(x, y, f"{prefix}{k}.")
            if d:
                return d
        elif x != y:
            return f"{prefix}{k}: {x!r} vs {y!r}"
    return None


def average(inputs: Sequence[str], out: str, *, weights: Sequence[float] | None = None, ema: bool = False,
            out_step: int | None = None, overwrite: bool = False, progress: bool | None = None) -> dict:
    """Write the average of the step folders `inputs` as `out/<step>/` (see the module docstring).
    weights: one per input, normalized here (None: uniform). progress: a tqdm bar (None: on a
    terminal). Returns {"step_dir", "step", "weights", "items": {item: arrays}, "bytes"}."""
    from jaxsora import checkpoint as ck
    from jaxsora.checkpoint.orbax_errors import fmt_bytes, install_noise_filters, io_failure, quiet_orbax

    install_noise_filters()
    out = os.path.abspath(os.path.expanduser(out))
    inputs = [os.path.abspath(d) for d in inputs]
    weights = normalize_weights(weights, len(inputs))
    check_output(out, inputs, overwrite)
    with quiet_orbax():
        sources = [open_source(d, w) for d, w in zip(inputs, weights)]
    first = sources[0]
    if first.config is None or "model" not in first.config:
        raise ck.CheckpointError(f"{first.step_dir} has no config item with the model (needed by every reader)")
    for src in sources[1:]:
        d = _first_difference(first.config.get("model", {}), (src.config or {}).get("model", {}))
        if d:
            _note(f"the model configs differ ({d}; {first.step_dir} vs {src.step_dir}): the output keeps the first's")

    # what to write: (output field, source field, copy from the first input?)
    if ema:
        missing = [s.step_dir for s in sources if "ema" not in s.fields]
        if missing:
            raise ck.CheckpointError(f"--ema: {missing[0]} has no EMA weights")
        plan = [("params", "ema", False)]
    else:
        missing = [s.step_dir for s in sources if "params" not in s.fields]
        if missing:
            raise ck.CheckpointError(f"{missing[0]} has no params")
        plan = [("params", "params", False)]
        no_ema = [s.step_dir for s in sources if "ema" not in s.fields]
        if not no_ema:
            plan.append(("ema", "ema", False))
        else:
            _note(f"{no_ema[0]} has no EMA weights: the output has params only")
    has_frozen = ["frozen" in s.fields for s in sources]
    if any(has_frozen) and not all(has_frozen):
        odd = sources[has_frozen.index(not has_frozen[0])]
        raise ck.CheckpointError(f"the checkpoints differ: {first.step_dir} {'has' if has_frozen[0] else 'has no'} "
                                 f"frozen variables, {odd.step_dir} {'has' if not has_frozen[0] else 'has no'}")
    if has_frozen[0]:
        plan.append(("frozen", "frozen", True))
    entries = {field: check_same_tree(sources, field) for _, field, _ in plan}
    differs = _frozen_differs(sources) if has_frozen[0] else None
    if differs:
        _note(f"the frozen variables differ between the inputs (e.g. {differs}): copied from {first.step_dir}")

    step = max(s.step for s in sources) if out_step is None else int(out_step)
    if step < 0:
        raise BadInput(f"--out-step must be >= 0, got {step}")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f"{step}{ck.TMP_SUFFIX}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    total = sum(len(entries[field]) for _, field, _ in plan)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="array", desc="averaging", file=sys.stderr, leave=False,
               disable=None if progress is None else not progress)
    arrays: dict[str, dict] = {}
    readers: dict[str, _Reader] = {}
    jobs = []
    try:
        with quiet_orbax():
            for s in sources:
                for field in (f for _, f, _ in plan):
                    item_dir, _, item_tree = s.fields[field]
                    if item_dir not in readers:
                        readers[item_dir] = _Reader(s.step_dir, item_dir, item_tree)
            os.makedirs(tmp)
            for out_field, field, copy in plan:
                job = _ItemJob(out_field, field, entries[field], sources, readers, copy=copy, bar=bar, arrays=arrays)
                jobs.append(job)
                save_item(os.path.join(tmp, out_field), job.tree(), note=_note)
        bar.close()
        written = {job.out_field: len(job.entries) for job in jobs}
        if sum(written.values()) != len(arrays):  # every array was computed by us, and fingerprinted
            raise RuntimeError(f"{len(arrays)} arrays fingerprinted, {sum(written.values())} written")
        for job in jobs:
            if job.differs:
                _note(f"{job.differs} (not floating point) differs between the inputs: copied from {first.step_dir}")
        how = ("the EMA weights" if ema else "the params" + (" and the EMA weights" if "ema" in written else ""))
        meta = dict(
            checkpoint_format=ck.CHECKPOINT_FORMAT, jaxsora=_version(), tool=PROG, wall_time=time.time(),
            average=dict(
                sources=[dict(checkpoint=s.step_dir, step=s.step, weight=s.weight) for s in sources],
                averaged=how, into="params" if ema else "params" + (", ema" if "ema" in written else ""),
                frozen_from=first.step_dir if has_frozen[0] else None,
                method="weighted mean accumulated in float64, cast to each array's stored dtype; "
                       "other dtypes copied from the first input"))
        data = dict(note="averaged weights (jaxsora.tools.average): no loader state; start a run from them with "
                         "--ckpt-path")
        jsons = dict(config=first.config, data=data, meta=meta)
        with quiet_orbax():
            for name, value in jsons.items():
                _save_json(os.path.join(tmp, name), value)
        ck.write_integrity_record(tmp, step, arrays, jsons)
        if overwrite:
            for e in os.listdir(out):
                if os.path.join(out, e) != tmp:
                    shutil.rmtree(os.path.join(out, e))
        final = os.path.join(out, str(step))
        os.rename(tmp, final)
    except BaseException as e:
        bar.close()
        _remove_settled(out if created else tmp)
        error = _job_error(e)
        if error is not None:
            raise error from None
        reason = io_failure(e)
        if reason is not None and not isinstance(e, ck.CheckpointError):
            raise ck.CheckpointWriteError(f"the average could not be written to {out}: {reason}") from None
        raise
    nbytes = sum(int(math.prod(a["shape"])) * _itemsize(a["dtype"]) for a in arrays.values())
    return dict(step_dir=final, step=step, weights=[s.weight for s in sources], items=written, bytes=nbytes,
                size=fmt_bytes(nbytes))


def _job_error(exc: BaseException):
    """A CheckpointError raised while computing an array inside orbax's save (maybe wrapped)."""
    from jaxsora import checkpoint as ck
    from jaxsora.checkpoint.orbax_errors import chain

    for e in chain(exc):
        if isinstance(e, ck.CheckpointError):
            return e
    return None


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _version() -> str:
    from jaxsora import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0],
                        epilog="exit status: 0 written, 2 a usage mistake or an unusable input")
    ap.add_argument("ckpt", nargs="+",
                    help="step folders (…/checkpoints/600), or run / checkpoints folders with --steps")
    hidden_aliases(ap, ap.add_argument("--output", dest="out", metavar="OUT", required=True,
                                       help="output folder: the average is written to OUT/<step>/"), "--out")
    ap.add_argument("--steps", default=None, help="steps of each run / checkpoints folder, e.g. 400,500,600")
    ap.add_argument("--weights", default=None,
                    help="one non-negative weight per checkpoint, e.g. 0.2,0.3,0.5 (normalized; default uniform)")
    ap.add_argument("--ema", action="store_true",
                    help="average the EMA weights into the output's params (no separate ema item)")
    ap.add_argument("--out-step", type=int, default=None, help="the output's step number (default: the newest input's)")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT when it holds an earlier average (only)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out_step is not None and args.out_step < 0:
        raise BadInput(f"--out-step must be >= 0, got {args.out_step}")
    inputs = resolve_inputs(args.ckpt, parse_steps(args.steps))
    weights = parse_weights(args.weights, len(inputs))
    res = average(inputs, args.out, weights=weights, ema=args.ema, out_step=args.out_step, overwrite=args.overwrite,
                  progress=False if args.no_progress else None)
    what = ", ".join(f"{k} ({n} array{'s' if n != 1 else ''})" for k, n in res["items"].items())
    print(f"wrote {res['step_dir']}: {what}, {res['size']}; the {'EMA' if args.ema else 'weights'} of "
          f"{len(inputs)} checkpoints, weights " + ", ".join(f"{w:.4g}" for w in res["weights"]))
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: main(argv), argv)


if __name__ == "__main__":
    sys.exit(run())
