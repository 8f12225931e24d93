"""Reading stored checkpoint items with orbax: an item's array metadata, an item as host numpy
arrays (all or some arrays), an item read into a target's shardings."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxsora.checkpoint.fingerprint import array_name
from jaxsora.checkpoint.layout import CheckpointError
from jaxsora.checkpoint.orbax_errors import one_line_error


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
