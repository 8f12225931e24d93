"""Weights-only reading (sampling, conversion, --ckpt-path, tools): the model's weight items of a
step folder, in either layout, verified against the record; the optimizer's item is never opened."""
from __future__ import annotations

import os
from typing import Any

import jax

from jaxsora.checkpoint.integrity import _check_json_digest, _compare, _fingerprints, _read_record
from jaxsora.checkpoint.layout import (
    ARRAY_ITEMS,
    LEGACY_ITEM,
    CheckpointError,
    _fields,
    _read_json_item,
    _Unusable,
    is_legacy_layout,
)
from jaxsora.checkpoint.orbax_errors import install_noise_filters, one_line_error, quiet_orbax
from jaxsora.checkpoint.orbax_io import _host_item, item_metadata_tree

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


def verify_arrays(step_dir: str, tree) -> bool | None:
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
    names, info, fps = _fingerprints(tree, on_device=bool(leaves) and all(isinstance(x, jax.Array) for x in leaves))
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
            _check_json_digest(_read_record(step_dir), name, value)
        except _Unusable as e:
            raise CheckpointError(f"checkpoint {step_dir} is not usable: {e}") from None
    return value
