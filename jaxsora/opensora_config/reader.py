"""Reading an Open-Sora (mmengine-style) Python config file the way `mmengine.Config.fromfile` reads
it, without mmengine: the file's top-level variables are the config.

What is supported, as mmengine does it:

* `_base_ = "other.py"` or a list of files, paths relative to the file: the bases are read first
  (recursively), their variables form the starting config; the same key in two bases is an error.
  The file's own variables are then merged in: a dict merges key by key into the base's dict of
  the same name (recursively), unless it holds `_delete_=True` (then it replaces it); anything
  else replaces the base's value.
* the base's values inside the file: `_base_.model.type` (Python attribute access) and the
  text form `{{_base_.model}}` / `"{{_base_.model}}"`.
* the predefined variables `{{ fileDirname }}`, `{{ fileBasename }}`,
  `{{ fileBasenameNoExtension }}`, `{{ fileExtname }}`.
* names starting with `__`, modules, functions and classes are not config keys.

A file that does not parse or raises is a `ConfigError` naming the file (one line, exit code 2).
"""
from __future__ import annotations

import ast
import copy
import os
import re
import types
from collections.abc import Mapping
from typing import Any

from jaxsora.errors import ConfigError

BASE_KEY = "_base_"
DELETE_KEY = "_delete_"
_BASE_REF = re.compile(r"""(["']?)\{\{\s*_base_\.([\w.]+)\s*\}\}\1""")
_PREDEFINED = re.compile(r"\{\{\s*(fileDirname|fileBasename|fileBasenameNoExtension|fileExtname)\s*\}\}")


class AttrDict(dict):
    """A dict whose keys read as attributes too (`_base_.model.type`), as mmengine's ConfigDict."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the base config has no key {name!r}") from None


def _attr(value):
    if isinstance(value, Mapping):
        return AttrDict({k: _attr(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_attr(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_attr(v) for v in value)
    return value


def plain(value):
    """`value` with every mapping a plain dict (AttrDicts, ml_collections' ConfigDicts)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return value


def _predefined(path: str, text: str) -> str:
    base = os.path.basename(path)
    values = {"fileDirname": os.path.dirname(os.path.abspath(path)), "fileBasename": base,
              "fileBasenameNoExtension": os.path.splitext(base)[0], "fileExtname": os.path.splitext(base)[1]}
    return _PREDEFINED.sub(lambda m: values[m.group(1)], text)


def _base_files(path: str, tree: ast.Module) -> list[str]:
    """The `_base_` files named at the top level of `tree`, as absolute paths."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == BASE_KEY for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise ConfigError(f"{path}: line {node.lineno}: _base_ must be a file name or a list of file "
                                  "names") from None
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"{path}: line {node.lineno}: _base_ must be a file name or a list of file names, "
                                  f"got {value!r}")
            here = os.path.dirname(os.path.abspath(path))
            return [os.path.normpath(os.path.join(here, os.path.expanduser(n))) for n in names]
    return []


def _without_base(tree: ast.Module) -> ast.Module:
    body = [n for n in tree.body
            if not (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == BASE_KEY
                                                     for t in n.targets))]
    return ast.Module(body=body, type_ignores=[])


def merge(child: Mapping, base: Mapping) -> dict:
    """`child` merged into a copy of `base`: dicts key by key (unless the child's holds `_delete_=True`),
    anything else replaced."""
    out = copy.deepcopy(dict(base))
    for k, v in child.items():
        if isinstance(v, Mapping):
            v = dict(v)
            if v.pop(DELETE_KEY, False):
                out[k] = _strip_delete(v)
                continue
            if isinstance(out.get(k), Mapping):
                out[k] = merge(v, out[k])
                continue
            out[k] = _strip_delete(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _strip_delete(value):
    if isinstance(value, Mapping):
        return {k: _strip_delete(v) for k, v in value.items() if k != DELETE_KEY}
    return copy.deepcopy(value)


def read_config(path: str, _chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config of the Open-Sora file `path` as a plain dict (see the module docstring)."""
    path = os.path.abspath(path)
    if path in _chain:
        raise ConfigError(f"_base_ chain loops: {' -> '.join(_chain + (path,))}")
    if not os.path.isfile(path):
        where = f" (the _base_ of {_chain[-1]})" if _chain else ""
        raise ConfigError(f"no such config file: {path}{where}")
    with open(path, encoding="utf-8") as f:
        text = _predefined(path, f.read())
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise ConfigError(f"{path}: line {e.lineno}: {e.msg}") from None
    base: dict[str, Any] = {}
    for base_file in _base_files(path, tree):
        cfg = read_config(base_file, _chain + (path,))
        twice = sorted(set(cfg) & set(base))
        if twice:
            raise ConfigError(f"{path}: key(s) {twice} are set by more than one _base_ file")
        base.update(cfg)
    if _BASE_REF.search(text):  # {{_base_.x}} → the Python expression _base_.x
        text = _BASE_REF.sub(lambda m: f"_base_.{m.group(2)}", text)
        try:
            tree = ast.parse(text, filename=path)
        except SyntaxError as e:
            raise ConfigError(f"{path}: line {e.lineno}: {e.msg}") from None
    scope: dict[str, Any] = {BASE_KEY: _attr(copy.deepcopy(base)), "__file__": path, "__name__": "__opensora_config__"}
    try:
        exec(compile(_without_base(tree), path, "exec"), scope)  # noqa: S102 - a config file is Python, as in mmengine
    except Exception as e:
        raise ConfigError(f"config file {path} does not load: {type(e).__name__}: {e}") from None
    own = {k: plain(v) for k, v in scope.items()
           if not k.startswith("__") and k != BASE_KEY
           and not isinstance(v, (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType))}
    return merge(own, base)


def is_opensora_config(path: str) -> bool:
    """A Python config file that does not define `get_config()` (jaxsora's and ml_collections' form):
    an Open-Sora / mmengine-style file of top-level variables."""
    if not str(path).endswith(".py") or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return False  # the jaxsora loader reports it
    return not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "get_config"
                   for n in tree.body)
