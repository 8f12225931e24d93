"""Writing an orbax PyTree item whose numpy leaves are computed one at a time, each just before
orbax writes it, so that host memory holds one output array at a time, not the whole item
(`jaxsora.tools.average` writes its averaged weights this way).

    tree = {"params": {"w": LazyArray((4096, 4096), "float32", compute_w), ...}}
    save_item("<step>/params", tree)            # the files of a plain np.ndarray PyTree item

The leaves are written as orbax's numpy type writes them (restored as np.ndarray), in the tree's
order. The streaming rides on orbax's `NumpyHandler._open_and_write(value, tspec, ts_context)`
(orbax 0.11–0.12), a private hook: `can_stream` checks it, and without it every leaf is computed
first and the item written whole (the same files; said once through `note`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np


class LazyArray:
    """An array leaf of `shape` and `dtype` whose values `compute()` gives when it is written."""

    def __init__(self, shape: tuple, dtype, compute: Callable[[], np.ndarray]):
        self.shape, self.dtype, self.compute = tuple(shape), np.dtype(dtype), compute
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize


def _streaming_handler():
    """orbax's numpy TypeHandler for `LazyArray` leaves, written one after the other, each computed
    just before its write. A new one per save (its semaphore belongs to that save's event loop)."""
    import tensorstore as ts
    from orbax.checkpoint import type_handlers

    class _StreamingHandler(type_handlers.NumpyHandler):
        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)
            self._one = None

        async def _open_and_write(self, value, tspec, ts_context):
            if self._one is None:
                self._one = asyncio.Semaphore(1)
            async with self._one:  # FIFO: the arrays are computed in the tree's order
                t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
                array = await asyncio.to_thread(value.compute)
                await t.write(array, can_reference_source_data_indefinitely=True)

    return _StreamingHandler()


def can_stream() -> bool:
    """Whether this orbax writes numpy arrays through `NumpyHandler._open_and_write(value, tspec,
    ts_context)`, the hook `_streaming_handler` overrides. It is private, so it is checked here
    rather than assumed."""
    import inspect

    from orbax.checkpoint import type_handlers

    hook = getattr(type_handlers.NumpyHandler, "_open_and_write", None)
    try:
        params = list(inspect.signature(hook).parameters) if callable(hook) else []
    except (TypeError, ValueError):
        return False
    return params[1:] == ["value", "tspec", "ts_context"]


_said_no_streaming = False


def save_item(item_dir: str, tree, note: Callable[[str], None] = print) -> None:
    """Write `tree` (LazyArray leaves) as an orbax PyTree item at `item_dir`, streaming when
    `can_stream()`, else computing every leaf first (`note` says so once per process)."""
    import jax
    import orbax.checkpoint as ocp

    global _said_no_streaming
    if can_stream():
        handler = ocp.PyTreeCheckpointHandler(
            type_handler_registry=ocp.type_handlers.create_type_handler_registry((LazyArray, _streaming_handler())))
    else:  # the same files and metadata (np.ndarray leaves), with the whole item in host memory
        if not _said_no_streaming:
            _said_no_streaming = True
            note(f"orbax {ocp.__version__} has no numpy write hook to stream through: each output item is "
                 f"computed whole before it is written (host memory: one item, e.g. all params)")
        tree = jax.tree.map(lambda leaf: leaf.compute(), tree, is_leaf=lambda x: isinstance(x, LazyArray))
        handler = ocp.PyTreeCheckpointHandler()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(item_dir, args=ocp.args.PyTreeSave(tree))
