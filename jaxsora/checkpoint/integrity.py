"""Checkpoint integrity: the integrity.json record (its layout, writing it, reading it) and the
comparison of the arrays and JSON items read with it."""
from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxsora.checkpoint.fingerprint import (
    array_name,
    device_fingerprints,
    fetch_fingerprints,
    format_fingerprint,
    host_fingerprint,
)
from jaxsora.checkpoint.layout import FINGERPRINT_METHOD, INTEGRITY_FILE, INTEGRITY_FORMAT, _array_item, _Unusable
from jaxsora.checkpoint.orbax_errors import one_line_error, write_json_atomic


def _json_digest(obj) -> str:
    """sha256 of a JSON item in canonical form (what JsonSave writes, read back, keys sorted)."""
    canon = json.dumps(json.loads(json.dumps(obj)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def _read_record(step_dir: str) -> dict | None:
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


def _recorded_items(record: dict | None) -> set | None:
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


def _check_json_digest(record: dict | None, name: str, value) -> None:
    """Raise _Unusable when a JSON item read differs from its checksum in the record (no record,
    or no checksum of that item: nothing to check)."""
    want = ((record or {}).get("json_sha256") or {}).get(name)
    if want is not None and _json_digest(value) != want:
        raise _Unusable(f"checksum mismatch in the {name} item")


def _fingerprints(tree, *, on_device: bool) -> tuple[list, list, list]:
    """(names, [{"shape", "dtype"}], hex fingerprints) of the arrays read: of device arrays by one
    jitted program (fetched here), of host arrays with numpy."""
    if on_device:
        names, info, dev = device_fingerprints(tree)
        return names, info, fetch_fingerprints(dev)
    return _host_fingerprints(tree)


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


def _integrity_doc(step: int, json_digests: dict, items: dict, arrays: dict) -> dict:
    """The integrity record (format 2) of a step: {item: {arrays, bytes}}, per-array shape, dtype,
    item and fingerprint, and the sha256 of each JSON item. The one place its layout is written."""
    from jaxsora import __version__

    return dict(complete=True, format=INTEGRITY_FORMAT, step=int(step), jaxsora=__version__,
                fingerprint=FINGERPRINT_METHOD, state_bytes=sum(int(it["bytes"]) for it in items.values()),
                json_sha256=json_digests, items=items, arrays=arrays)


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
