"""The run folder of `python -m jaxsora.train`: `--run-dir DIR` exactly (refused when DIR already
holds another run's checkpoints or log, unless `--load` continues that run); with `--load` (a
folder or an experiment number, `jaxsora.runs.find_run`), the loaded run's own folder; otherwise a
new numbered folder `<outputs>/<NNN>-<experiment>` (`jaxsora.runs.new_run_dir`), claimed by
process 0 and broadcast to the other processes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import jax

from jaxsora.errors import OutputExists, UserError


def resolve_load_number(config, opts):
    """`--load 656` (no such path) → the run folder `<outputs>/656-*`; a copy of opts."""
    if opts.load is None or os.path.exists(opts.load) or not str(opts.load).isdigit():
        return opts
    from jaxsora.runs import find_run

    return dataclasses.replace(opts, load=find_run(opts.load, config.train.outputs, what="--load"))


def _loaded_run_folder(load: str, step) -> str | None:
    """The run folder a `--load` path belongs to (the parent of its `checkpoints/` folder), or None
    for a folder of step folders that is not a run's `checkpoints/`."""
    from jaxsora.checkpoint import resolve_checkpoint

    root, _ = resolve_checkpoint(load, step)
    return os.path.dirname(root) if os.path.basename(root) == "checkpoints" else None


def given_run_folder(opts) -> str | None:
    """--run-dir, else the loaded run's folder; None: a new numbered folder."""
    if opts.run_dir:
        if os.path.exists(opts.run_dir) and not os.path.isdir(opts.run_dir):
            raise OutputExists(f"--run-dir {opts.run_dir} is a file, not a folder")
        return os.path.abspath(os.path.expanduser(opts.run_dir))
    if opts.load:
        return _loaded_run_folder(opts.load, opts.step)
    return None


def _existing_run(path: str) -> str | None:
    """What in a folder shows that a run already wrote there (checkpoints, a metrics log), or None."""
    from jaxsora.checkpoint import checkpoint_steps

    ckpts = os.path.join(path, "checkpoints")
    steps = checkpoint_steps(ckpts)
    if steps:
        return f"checkpoints of steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"a checkpoint of step {steps[0]}"
    if os.path.isdir(ckpts) and os.listdir(ckpts):
        return "a checkpoints/ folder with unfinished saves"
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        return "a metrics.jsonl log"
    return None


def refuse_another_run(outdir: str, opts) -> None:
    """A given folder that holds a run is written to only by a --load of that very run: never append
    to another run's metrics.jsonl or step over its checkpoints."""
    if opts.load:
        loaded = _loaded_run_folder(opts.load, opts.step)
        if loaded is not None and os.path.realpath(loaded) == os.path.realpath(outdir):
            return
    found = _existing_run(outdir)
    if found is None:
        return
    if opts.load:
        raise OutputExists(f"--run-dir {outdir} already holds another run ({found}); give a new folder to continue "
                           f"--load {opts.load} into, or leave --run-dir out to continue in the loaded run's folder")
    raise OutputExists(f"--run-dir {outdir} already holds a run ({found}); resume it with --load {outdir}, "
                       f"or give a new folder (without --run-dir a new run gets a new numbered folder)")


def next_run_folder(config) -> str:
    """The folder a new run would get now (claims nothing: the dry run)."""
    from jaxsora.runs import next_run_number, run_folder_name

    outputs = os.path.abspath(config.train.outputs)
    return os.path.join(outputs, run_folder_name(next_run_number(outputs), config.train.experiment))


def new_run_folder(config) -> str:
    """A new numbered run folder `<outputs>/<NNN>-<experiment>`: process 0 claims the number and
    makes the folder, the other processes (same config, same filesystem) get the number from it."""
    from jaxsora.runs import new_run_dir, run_folder_name, run_number

    outputs = os.path.abspath(config.train.outputs)
    experiment = config.train.experiment
    if jax.process_count() == 1:
        return new_run_dir(outputs, experiment)
    import numpy as np
    from jax.experimental import multihost_utils

    number, error = -1, None
    if jax.process_index() == 0:
        try:
            number = run_number(new_run_dir(outputs, experiment))
        except Exception as e:  # noqa: BLE001 — raised below, after the others heard of it
            error = e
    number = int(multihost_utils.broadcast_one_to_all(np.asarray(number, np.int32)))
    if error is not None:
        raise error
    if number < 0:
        raise UserError(f"process 0 could not create a new run folder in {outputs} (see its log)")
    return os.path.join(outputs, run_folder_name(number, experiment))


class Claim:
    """What this invocation adds to the outputs before training starts, so that a refusal (a user error
    before step 0: the memory plan, a checkpoint, the features, the eval set) takes it back and the run
    leaves nothing behind — no folder, no experiment number, no index, heartbeat or log line.

    `Claim.begin(config, outdir)` before anything is made (outdir None: a new numbered folder), then
    `taken(outdir)` once the folder is known. A folder this invocation made (a new numbered one, or a
    --run-dir that did not exist) is removed whole by process 0, with its number's claim; in a folder
    that was there (--run-dir of an empty folder, --load) the entries that were not there are removed
    and the files each process appends to or rewrites (invocations.jsonl, its heartbeat, its stacks
    file) get their old bytes back."""

    def __init__(self, process_index: int, new: bool, created: bool, made: list):
        self.process, self.new, self.created, self.made = process_index, new, created, made
        self.outdir, self.entries, self.files = None, set(), {}

    @classmethod
    def begin(cls, config, outdir: str | None) -> Claim:
        from jaxsora.runs import CLAIMS_DIR

        outputs = os.path.abspath(config.train.outputs)
        made = [] if outdir is not None else [
            p for p in (os.path.join(outputs, CLAIMS_DIR), outputs) if not os.path.exists(p)]
        return cls(jax.process_index(), outdir is None, outdir is None or not os.path.exists(outdir), made)

    def taken(self, outdir: str) -> Claim:
        from jaxsora.runs import INVOCATIONS
        from jaxsora.train.run.supervise import HEARTBEAT_DIR, STACKS_DIR

        self.outdir = outdir
        self.entries = set(os.listdir(outdir)) if os.path.isdir(outdir) else set()
        p = self.process
        mine = [os.path.join(HEARTBEAT_DIR, f"{p}.json"), os.path.join(STACKS_DIR, f"{p}.txt")]
        self.files = {rel: self._read(rel) for rel in ([INVOCATIONS] if p == 0 else []) + mine}
        return self

    def _read(self, rel: str) -> bytes | None:
        try:
            with open(os.path.join(self.outdir, rel), "rb") as f:
                return f.read()
        except OSError:
            return None

    def undo(self) -> None:
        import shutil

        from jaxsora.runs import CLAIMS_DIR, run_number

        if self.outdir is None:
            return
        for rel, old in self.files.items():
            path = os.path.join(self.outdir, rel)
            with contextlib.suppress(OSError):
                if old is None:
                    os.remove(path)
                else:
                    with open(path, "wb") as f:
                        f.write(old)
        if self.process != 0:
            return
        if self.created:
            shutil.rmtree(self.outdir, ignore_errors=True)
            if self.new:  # the number goes back: the next new run takes it
                claims = os.path.join(os.path.dirname(self.outdir), CLAIMS_DIR)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(claims, f"{run_number(self.outdir):03d}"))
            for folder in self.made:  # .run_numbers/ and the outputs folder, when this run made them
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            return
        for name in set(os.listdir(self.outdir)) - self.entries if os.path.isdir(self.outdir) else ():
            path = os.path.join(self.outdir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
