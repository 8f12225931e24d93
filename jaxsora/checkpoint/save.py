"""Saving checkpoints: `Checkpointer`, orbax's async CheckpointManager (keep the newest `keep`),
with the integrity record written in orbax's finalize thread and failed writes cleaned up."""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp

from jaxsora import lazy_imports
from jaxsora.checkpoint.fingerprint import device_fingerprints, fetch_fingerprints
from jaxsora.checkpoint.integrity import _integrity_doc, _json_digest
from jaxsora.checkpoint.layout import (
    _REPLACE_STEPS,
    CHECKPOINT_FORMAT,
    INTEGRITY_FILE,
    ITEMS,
    TMP_SUFFIX,
    CheckpointWriteError,
    _array_item,
    split_items,
)
from jaxsora.checkpoint.orbax_errors import fmt_bytes, install_noise_filters, io_failure, write_json_atomic


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


class Checkpointer:
    """Asynchronous saves of (TrainState, config, loader state, meta) with integrity records; the
    TrainState goes into the array items of `split_items` (params, frozen, ema, opt_state).

    keep: the newest `keep` checkpoints are kept; 0 or None keeps all.
    async_save: False waits for each save to be written before `save` returns.
    """

    def __init__(self, directory: str, *, keep: int | None = 3, async_save: bool = True):
        if keep is not None and keep < 0:
            raise ValueError(f"keep must be >= 0 (0 = keep all), got {keep}")
        install_noise_filters()
        lazy_imports.install()  # orbax's threads import while the loader may import grain (jaxsora.lazy_imports)
        self.directory = os.path.abspath(directory)
        self._key = os.path.realpath(self.directory)  # for _REPLACE_STEPS
        self.keep = None if not keep else int(keep)  # orbax: max_to_keep=0 would delete every step
        self.async_save = async_save
        self._pending: _Pending | None = None
        self._in_flight: tuple[int, int] | None = None  # (step, state bytes) of the save being written
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

    def latest_step(self) -> int | None:
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
            self._clear_pending()
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
            with contextlib.suppress(Exception):  # a failure already raised by _wait_previous
                self.manager.close()

    def _remove_skipped_step(self, step: int):
        """Delete a step folder that restore skipped as corrupt, so this save can replace it."""
        if jax.process_index() == 0:
            shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxsora-ckpt-replace-{step}")
        _REPLACE_STEPS.get(self._key, set()).discard(step)
        self.manager.reload()

    def _clear_pending(self):
        """No save in flight (and no integrity record to write)."""
        with self._lock:
            self._pending = None
        self._in_flight = None

    def _tmp_folders(self, step: int) -> list[str]:
        """The folders orbax is writing `step` into (`<step>.orbax-checkpoint-tmp*`), sorted."""
        return sorted(glob.glob(os.path.join(self.directory, f"{step}{TMP_SUFFIX}*")))

    def _on_finalized(self):
        """Orbax's finalize thread, after every item is written and before the step folder's
        rename: process 0 writes integrity.json into the folder."""
        with self._lock:
            rec, self._pending = self._pending, None
        if rec is None or jax.process_index() != 0:
            return
        fps = fetch_fingerprints(rec.fingerprints)
        arrays = {n: dict(i, item=_array_item(n), fingerprint=f) for n, i, f in zip(rec.names, rec.info, fps)}
        doc = _integrity_doc(rec.step, rec.json_digests, rec.items, arrays)
        tmp = self._tmp_folders(rec.step)
        folder = tmp[-1] if tmp else os.path.join(self.directory, str(rec.step))
        write_json_atomic(os.path.join(folder, INTEGRITY_FILE), doc)

    def _failed(self, step: int | None, nbytes: int, exc: BaseException):
        """A save that raised: filesystem errors → remove the partial folder, fresh manager,
        CheckpointWriteError (raised from here); anything else returns (the caller re-raises)."""
        reason = io_failure(exc)
        self._clear_pending()
        if reason is None:
            return
        where = os.path.join(self.directory, str(step)) if step is not None else self.directory
        _wait_for_orbax_writers()  # other items of the step may still be writing into its folder
        if jax.process_index() == 0 and step is not None:
            for tmp in self._tmp_folders(step):
                shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(where, INTEGRITY_FILE)):
                shutil.rmtree(where, ignore_errors=True)
        try:
            free = fmt_bytes(shutil.disk_usage(self.directory).free)
        except OSError:
            free = "unknown"
        with contextlib.suppress(Exception):  # the failed manager re-raises its error on every call: replace it
            self.manager.close()
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
            with contextlib.suppress(Exception):  # orbax's join re-raises the thread's error, reported already
                t.join(max(0.0, deadline - time.monotonic()))
