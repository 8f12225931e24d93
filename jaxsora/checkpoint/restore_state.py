"""Restoring checkpoints for training: `restore` (a full resume or some items, read into the current
mesh's shardings, verified, falling back to older steps; the older `state/` layout too) and
`check_resumable`, --load's early check from the folders alone."""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxsora.checkpoint.integrity import (
    _check_json_digest,
    _compare,
    _fingerprints,
    _read_record,
    _recorded_items,
)
from jaxsora.checkpoint.layout import (
    _REPLACE_STEPS,
    ARRAY_ITEMS,
    INTEGRITY_FILE,
    ITEMS,
    JSON_ITEMS,
    LEGACY_ITEM,
    OPT_ITEM,
    CheckpointError,
    _array_item,
    _check_items,
    _entries,
    _fields,
    _join,
    _MissingItem,
    _no_opt_state,
    _read_json_item,
    _Unusable,
    checkpoint_steps,
    has_weights,
    is_legacy_layout,
    item_of,
    resolve_checkpoint,
)
from jaxsora.checkpoint.orbax_errors import install_noise_filters, one_line_error, quiet_orbax, say
from jaxsora.checkpoint.orbax_io import _host_item, _restore_tree


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


def restore(directory: str, target, *, step: int | None = None, items: tuple = ITEMS,
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
    candidates = _candidates(root, named)
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


def check_resumable(directory: str, step: int | None = None) -> None:
    """--load's early check, from the folders alone (nothing is read; meant to run before anything
    compiles): raises the CheckpointError `restore` would raise when the step it would resume from —
    the one asked for, or the newest one with every JSON item — lacks the opt_state item (a copy of
    the weights only). Checksums are still checked by `restore`."""
    root, named = resolve_checkpoint(directory, step)
    for s in _candidates(root, named):
        step_dir = os.path.join(root, str(s))
        if is_legacy_layout(step_dir) or os.path.isdir(os.path.join(step_dir, OPT_ITEM)):
            return
        if not all(os.path.isdir(os.path.join(step_dir, it)) for it in JSON_ITEMS) or not has_weights(step_dir):
            continue  # partial: restore skips it
        raise CheckpointError(f"checkpoint step {s} in {root} {_no_opt_state(step_dir)}")


def _candidates(root: str, named: int | None) -> list[int]:
    """The steps to try, in order: the one named, or every step from the newest."""
    return [int(named)] if named is not None else checkpoint_steps(root)[::-1]


def _item_fields(tfields: dict, items) -> dict:
    """{field: subtree} of the target fields stored in `items` (array item names)."""
    return {f: v for f, v in tfields.items() if item_of(f) in items}


def _restore_step(root: str, step: int, target, items, verify: bool) -> tuple[dict, str | None]:
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
                fields.update(_fields(_restore_tree(os.path.join(step_dir, name), _item_fields(tfields, {name}))))
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
            _check_json_digest(record, name, out[name])
        if read:
            names, info, fps = _fingerprints(fields, on_device=target is not None)
            _compare(record, names, info, fps, items=set(read))
    return out, None


def _array_items_to_read(step_dir: str, entries: set, record, arrays: list, tfields) -> tuple[list, list]:
    """(items to read, items missing that are needed) of a step of the per-item layout. An item is
    needed when the record lists it or the target has arrays in it; others are read when present."""
    recorded = _recorded_items(record)
    read, missing = [], []
    for it in arrays:
        has = None if tfields is None else bool(jax.tree.leaves(_item_fields(tfields, {it})))
        if has is False:
            continue  # nothing of the target lives there
        needed = (recorded is not None and it in recorded) or has is True
        if it in entries and os.path.isdir(os.path.join(step_dir, it)):
            read.append(it)
        elif needed:
            missing.append(it)
    return read, missing


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
    return _fields(_restore_tree(state_dir, _item_fields(tfields, items), partial=True))


def _agree(ok: bool) -> bool:
    """Multi-host: True only when every process read its part (all then take the same branch)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))
