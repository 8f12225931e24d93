"""Checkpoint layout: the items of a step folder and which TrainState field goes where, the
checkpoint errors, and finding checkpoints (`resolve_checkpoint`, `checkpoint_steps`).

Imports no jax at module level: the sampler finds its checkpoint step (and answers a wrong path or step)
before it imports jax."""
from __future__ import annotations

import dataclasses
import json
import os

from jaxsora.errors import UserError

WEIGHT_ITEMS = ("params", "frozen", "ema")  # what sampling, conversion and --ckpt-path read
OPT_ITEM = "opt_state"  # optimizer state, step, rng: only --load reads it
ARRAY_ITEMS = WEIGHT_ITEMS + (OPT_ITEM,)
JSON_ITEMS = ("config", "data", "meta")
ITEMS = ARRAY_ITEMS + JSON_ITEMS
LEGACY_ITEM = "state"  # the older layout's single item holding the whole TrainState
INTEGRITY_FILE = "integrity.json"
INTEGRITY_FORMAT = 2  # the layout of integrity.json itself (1: the `state/` layout's, no items)
# meta["checkpoint_format"]: 3 = one item per part (params, frozen, ema, opt_state); 2 = one
# `state` item, with integrity.json; older checkpoints have no such key (and no integrity.json)
CHECKPOINT_FORMAT = 3
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


class _Unusable(Exception):
    """Why one step cannot be used (internal; becomes a skip line or a CheckpointError)."""


class _MissingItem(_Unusable):
    """A step that is intact but lacks an item that was asked for on purpose (a copy without the
    optimizer): no fallback to older steps, the restore stops with one line."""


def item_of(field: str) -> str:
    """The array item that stores a TrainState field: params, frozen and ema their own; every other
    field (opt_state, step, rng, and the fields of other trees saved with a Checkpointer) opt_state."""
    return field if field in WEIGHT_ITEMS else OPT_ITEM


def _array_item(name: str, entry: dict | None = None) -> str:
    """The item of an array of the integrity record (format 1 records name none: from the name)."""
    item = entry.get("item") if isinstance(entry, dict) else None
    return item if item else item_of(name.split(".", 1)[0])


def _fields(tree) -> dict:
    """{field: subtree} of a TrainState (a dataclass) or of a dict of fields."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, dict) or hasattr(tree, "keys"):
        return dict(tree.items())
    raise TypeError(f"a checkpointed state is a TrainState or a dict of fields, got {type(tree).__name__}")


def split_items(state) -> dict[str, dict]:
    """{array item: {field: subtree}} of a state, in ARRAY_ITEMS order; items without arrays are left out."""
    import jax

    parts: dict[str, dict] = {}
    for field, value in _fields(state).items():
        parts.setdefault(item_of(field), {})[field] = value
    return {it: parts[it] for it in ARRAY_ITEMS if it in parts and jax.tree.leaves(parts[it])}


def _join(target, fields: dict):
    """`target` (a TrainState or dict) with the fields read; fields that were not read keep the
    target's value (only fields without arrays: nothing to read)."""
    if dataclasses.is_dataclass(target) and not isinstance(target, type):
        return dataclasses.replace(target, **{k: v for k, v in fields.items() if k in _fields(target)})
    return {k: fields.get(k, v) for k, v in _fields(target).items()}


def is_legacy_layout(step_dir: str) -> bool:
    """A step folder of the older layout: the whole TrainState in one `state/` item."""
    return os.path.isdir(os.path.join(step_dir, LEGACY_ITEM))


def has_weights(step_dir: str) -> bool:
    """A step folder that holds model weights in either layout (new: params/ or ema/; old: state/)."""
    return any(os.path.isdir(os.path.join(step_dir, it)) for it in ("params", "ema", LEGACY_ITEM))


def _numeric_children(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(d) for d in names if d.isdigit() and os.path.isdir(os.path.join(path, d)))


def resolve_checkpoint(path: str, step: int | None = None) -> tuple[str, int | None]:
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


def resolve_step_dir(path: str, step: int | None = None) -> str:
    """A step folder holding weights (`params/`, `ema/`, or the older `state/`): from a manager root (a run's
    checkpoints/, a `convert from-torch` output) its newest such step, or `step`; or a step folder itself."""
    from jaxsora.errors import MissingFile

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise MissingFile(f"checkpoint folder not found: {path}")
    if has_weights(path):
        return path
    steps = sorted(int(d) for d in os.listdir(path) if d.isdigit() and has_weights(os.path.join(path, d)))
    if not steps:
        raise MissingFile(f"{path} holds no jaxsora checkpoint (no <step>/params or <step>/state folder)")
    if step is None:
        return os.path.join(path, str(steps[-1]))
    if step not in steps:
        raise MissingFile(f"{path} has no step {step}; it has {steps}")
    return os.path.join(path, str(step))


def read_config(step_dir: str) -> dict:
    """A step folder's `config` JSON item (a converter output's older single `config` file too)."""
    from jaxsora.errors import MissingFile

    for name in ("config/metadata", "config"):
        f = os.path.join(step_dir, name)
        if os.path.isfile(f):
            with open(f) as fh:
                return json.load(fh)
    raise MissingFile(f"{step_dir} has no config item")


def checkpoint_steps(root: str) -> list[int]:
    """The step folders of a checkpoints root, ascending (unfinished `*.orbax-checkpoint-tmp` excluded)."""
    return _numeric_children(root)


def unfinished_saves(root: str) -> list[str]:
    """Names of step folders orbax never finished (`<step>.orbax-checkpoint-tmp*`)."""
    try:
        return sorted(d for d in os.listdir(root) if TMP_SUFFIX in d)
    except OSError:
        return []


def _entries(step_dir: str) -> set:
    try:
        entries = set(os.listdir(step_dir))
    except OSError as e:
        from jaxsora.checkpoint.orbax_errors import one_line_error

        raise _Unusable(f"unreadable folder ({one_line_error(e)})") from None
    if not entries:
        raise _Unusable("empty folder")
    return entries


def _check_items(step_dir: str, items) -> None:
    _entries(step_dir)
    missing = [it for it in items if not os.path.isdir(os.path.join(step_dir, it))]
    if missing:
        raise _Unusable(f"partial: no {', '.join(missing)} folder{'s' if len(missing) > 1 else ''}")


def _no_opt_state(step_dir: str) -> str:
    return (f"has no {OPT_ITEM} item (a copy of the weights only): a full resume (--load) needs the optimizer "
            f"state; start from these weights with --ckpt-path {step_dir}")


def _read_json_item(step_dir: str, name: str):
    """A JsonSave item (orbax writes it to `<item>/metadata`), read without orbax."""
    with open(os.path.join(step_dir, name, "metadata")) as f:
        return json.load(f)


# Steps that `restore` skipped as corrupt or partial, per checkpoints root: a Checkpointer on that
# root replaces such a step folder when training reaches the step again (instead of keeping it).
_REPLACE_STEPS: dict[str, set] = {}
