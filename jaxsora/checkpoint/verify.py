"""Checking checkpoints without a model or devices (the `python -m jaxsora.ckpt` CLI): what a step
folder holds (`step_contents`) and whether every item matches its record (`verify_step`)."""
from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from jaxsora.checkpoint.fingerprint import array_name
from jaxsora.checkpoint.integrity import (
    _check_json_digest,
    _compare,
    _host_fingerprints,
    _read_record,
    _recorded_items,
)
from jaxsora.checkpoint.layout import (
    ARRAY_ITEMS,
    INTEGRITY_FILE,
    ITEMS,
    JSON_ITEMS,
    LEGACY_ITEM,
    OPT_ITEM,
    _check_items,
    _entries,
    _read_json_item,
    _Unusable,
)
from jaxsora.checkpoint.orbax_errors import install_noise_filters, one_line_error, quiet_orbax
from jaxsora.checkpoint.orbax_io import _host_item, _item_metadata, item_metadata_tree


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
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
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
                _check_json_digest(record, name, value)
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
