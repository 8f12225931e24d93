"""etils' `epy.lazy_imports()` made thread-local (`install`), so that a lazy import cannot reach another thread.

grain and tensorflow_datasets import some of their modules inside `with epy.lazy_imports():`, which
swaps `builtins.__import__` for the whole process while the block runs. Any import statement another
thread runs meanwhile gets an unloaded `LazyModule` instead: orbax's checkpoint thread, formatting its
write speed, ran humanize's `from math import log` while the loader's first `import grain` was in such a
block, and a training run died at its step-0 checkpoint with "TypeError: 'LazyModule' object is not
callable" (seen once in `make test`). Two such blocks in two threads can also leave the swap in place for
good (each restores what it found). `install` keeps one dispatching `builtins.__import__` and makes
`epy.lazy_imports()` lazy for its own thread only; every jaxsora command installs it first
(`jaxsora.errors.run_cli`), and so does the trainer's checkpointer for library use.

`lazy_names` is the package side of lazy importing: the packages whose commands answer mistakes before importing
jax (`jaxsora.checkpoint`, `jaxsora.convert`, `jaxsora.infer`) load a name's submodule when it is first used.
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import threading

_local = threading.local()  # .lazy: this thread's lazy importer while it is inside epy.lazy_imports()
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Make `etils.epy.lazy_imports()` affect only the thread that enters it (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        from etils import epy
        from etils.epy import lazy_imports_utils

        real_import = builtins.__import__

        def dispatch(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 (builtins' names)
            lazy = getattr(_local, "lazy", None)
            return (real_import if lazy is None else lazy)(name, globals, locals, fromlist, level)

        @contextlib.contextmanager
        def lazy_imports(*, error_callback=None, success_callback=None):
            outer = getattr(_local, "lazy", None)
            _local.lazy = functools.partial(lazy_imports_utils._lazy_import, error_callback=error_callback,
                                            success_callback=success_callback)
            try:
                yield
            finally:
                _local.lazy = outer

        lazy_imports.__doc__ = lazy_imports_utils.lazy_imports.__doc__
        builtins.__import__ = dispatch
        epy.lazy_imports = lazy_imports_utils.lazy_imports = lazy_imports
        _installed = True


def lazy_names(package: str, modules: dict[str, tuple[str, ...]]):
    """A package's `__getattr__`, `__dir__` and `__all__` (PEP 562) for names that live in its submodules
    ({submodule: names}): `from package import name` imports that submodule on first use, not with the package.
    A command can then use a light submodule (a checkpoint's layout, the sampler's settings) and answer a wrong
    path or setting before the heavy ones import jax."""
    import importlib
    import sys

    home = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return __getattr__, __dir__, sorted(home)
