"""The machinery of reading an Open-Sora config into jaxsora terms: a `Translation` (the jaxsora settings,
each with the Open-Sora key it comes from, and the notes reported at the start), the `Row` of a key table
(where a key goes, Open-Sora's value when absent, the kind of value it takes, a note), and `apply_table`, which
applies a table to a file's values and refuses a key in no table. The tables themselves are the train map's
(`train.py`) and the inference map's (`inference.py`). Imports no jax.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxsora.errors import ConfigError

REQUIRED = object()  # Open-Sora fails without the key


# --------------------------------------------------------------------------------------------------------
# what a translation is
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Setting:
    key: str        # jaxsora key, "group.name"
    value: Any
    source: str     # the Open-Sora key (and value) it comes from, for the translated file's comments


@dataclasses.dataclass
class Translation:
    """An Open-Sora file read into jaxsora terms. `config()` builds the run config from configs/base.py."""
    path: str
    settings: list[Setting] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)       # reported once at the start
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)  # load / ckpt_path / start_from_scratch
    data_path_key: str = "data.table"  # where --data-path goes (data.features for BatchFeatureDataset)

    def set(self, key: str, value: Any, source: str) -> None:
        self.settings = [s for s in self.settings if s.key != key]
        self.settings.append(Setting(key, value, source))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def config(self):
        """configs/base.py's config with every setting applied (unlocked)."""
        c = base_config()
        for s in self.settings:
            assign(c, s.key, s.value)
        return c


def base_config():
    """jaxsora's `configs/base.py` `get_config()` (loaded by path as the `configs` package)."""
    import importlib

    from jaxsora.config_files import own_configs_folder, register_configs_package

    folder = own_configs_folder()
    if folder is None:
        raise ConfigError("jaxsora's configs/base.py is not beside this jaxsora package: an Open-Sora config is read "
                          "on top of it (run from a jaxsora checkout)")
    path = os.path.join(folder, "base.py")
    register_configs_package(path)
    return importlib.import_module("configs.base").get_config()


def assign(c, key: str, value) -> None:
    """c[group][name] = value (a dict value replaces the group's field whole)."""
    node = c
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    try:
        setattr(node, last, value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} = {value!r}: {e}") from None


# --------------------------------------------------------------------------------------------------------
# value checks
# --------------------------------------------------------------------------------------------------------
def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", is_int),
    "number": ("a number", is_num),
    "bool": ("True or False", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "dict": ("a dict", lambda v: isinstance(v, Mapping)),
    "int|None": ("an integer or None", lambda v: v is None or is_int(v)),
    "str|None": ("a string or None", lambda v: v is None or isinstance(v, str)),
    "dict|None": ("a dict or None", lambda v: v is None or isinstance(v, Mapping)),
    "any": ("anything", lambda v: True),
}


class Ctx:
    """What a handler sees: the file's whole config, the translation being built, and where it is."""

    def __init__(self, path: str, raw: dict, out: Translation):
        self.path, self.raw, self.out = path, raw, out

    def fail(self, msg: str):
        raise ConfigError(f"{self.path}: {msg}")

    def get(self, dotted: str, default=None):
        node = self.raw
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node


@dataclasses.dataclass(frozen=True)
class Row:
    """One Open-Sora key. `to`: a jaxsora key, a tuple of them, or a handler `f(value, ctx, key)`; None with
    `note`: meaningless here (the note, formatted with {value}, is reported when the file sets the key).
    `absent`: Open-Sora's value when the file leaves the key out (REQUIRED: Open-Sora fails without it;
    None with a None `to`: nothing to do)."""
    to: str | tuple | Callable | None
    absent: Any = None
    kind: str = "any"
    note: str | None = None
    convert: Callable | None = None


def fmt(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def apply_table(table: Mapping[str, Row], values: Mapping, ctx: Ctx, prefix: str = "") -> None:
    """Every key of `values` must be in `table`; each row of the table is applied (absent keys with
    Open-Sora's default)."""
    for key in values:
        if key not in table:
            where = f"{prefix}{key}"
            near = difflib.get_close_matches(str(key), list(table), n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            group = f"the {prefix[:-1]} dict" if prefix else "Open-Sora 1.2's scripts/train.py or the LambdaLabs fork"
            ctx.fail(f"unknown Open-Sora config key {where!r}{hint}: it is not a key of {group}; "
                     "jaxsora-only settings go in jaxsora = dict(group=dict(key=value))")
    for key, row in table.items():
        full = f"{prefix}{key}"
        present = key in values
        value = values[key] if present else row.absent
        if value is REQUIRED:
            ctx.fail(f"{full} is not set (Open-Sora's train.py needs it)")
        if present:
            what, ok = KINDS[row.kind]
            if not ok(value):
                ctx.fail(f"{full} = {value!r}: expected {what}")
        if row.to is None:
            if present and row.note:
                ctx.out.note(f"{full} {fmt(value)}: {row.note}")
            continue
        if callable(row.to):
            row.to(value, ctx, full, present)
            continue
        if not present and row.absent is None:
            continue  # Open-Sora has no default: jaxsora's stays
        if present and row.note:
            ctx.out.note(f"{full} {fmt(value)}: {row.note}")
        v = row.convert(value) if row.convert else value
        for target in (row.to,) if isinstance(row.to, str) else row.to:
            src = f"{full} = {fmt(value)}" if present else f"{full} absent: Open-Sora's {fmt(value)}"
            ctx.out.set(target, v, src)
