"""Config files by path: `from configs import base` inside a config file means the `configs` folder
that file lives in (or, outside any, jaxsora's own `configs/`) — registered as the `configs` package
without touching sys.path. Below the CLI and the Open-Sora config reader, which both load config files."""
from __future__ import annotations

import os
import sys


def register_configs_package(path):
    """Config files import their base as `from configs import base`: make `configs` the package
    folder the config file lives in (the nearest folder named `configs` above it), by path —
    sys.path is left alone. A `configs` package already imported from that folder is kept."""
    import importlib.util

    folder = os.path.dirname(os.path.abspath(path))
    while os.path.basename(folder) != "configs":
        parent = os.path.dirname(folder)
        if parent == folder:
            # not under a configs/ folder (e.g. a `python -m jaxsora.config translate` output saved anywhere):
            # `from configs import base` is jaxsora's own configs/, unless a `configs` package is importable
            folder = own_configs_folder()
            if folder is None or "configs" in sys.modules or importlib.util.find_spec("configs") is not None:
                return
            break
        folder = parent
    have = sys.modules.get("configs")
    if have is not None and os.path.abspath(list(getattr(have, "__path__", [""]))[0]) == folder:
        return
    init = os.path.join(folder, "__init__.py")
    spec = importlib.util.spec_from_file_location("configs", init if os.path.exists(init) else None,
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["configs"] = module
    for name in [m for m in sys.modules if m.startswith("configs.")]:  # submodules of another configs folder
        del sys.modules[name]
    if spec.loader is not None:
        spec.loader.exec_module(module)


def own_configs_folder() -> str | None:
    """The `configs/` folder of the jaxsora checkout this package runs from (None when installed without it)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    return folder if os.path.isfile(os.path.join(folder, "base.py")) else None
