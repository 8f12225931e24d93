"""The shared front of the config-driven commands (`jaxsora.train`, `jaxsora.tools.search_bs`):
`--config FILE` with `--config.group.key=value` overrides (absl + ml_collections), the reference's
dashed flag names, and every mistake in them — a missing or broken config file, an unknown flag or
key, a value of the wrong type — as one line and exit code 2 (`jaxsora.errors`).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from jaxsora.errors import debug_requested, fail, run_cli


def _config_path(argv):
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _config_root_on_path(path):
    """Config files import `configs.base`: put the folder holding `configs/` on sys.path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)


def _parse_flags(prog, argv):
    """absl's parse, with every mistake (unknown flag or config key, bad value, a config file that
    does not load) as one line and exit code 2."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # unknown flag / config key, a value of the wrong type
        if debug_requested(argv):
            raise
        msg = str(e)
        if "Unknown command line flag 'config." in msg:
            msg = msg.replace("Unknown command line flag", "unknown config key") + " (see the config file for the keys)"
        fail(prog, msg)
    except Exception as e:  # an override of a key the config lacks, or the config file itself raised
        if debug_requested(argv):
            raise
        override = _unknown_override(e, argv)
        if override:
            fail(prog, override)
        fail(prog, f"config file {_config_path(argv)} does not load: {type(e).__name__}: {e}")


def _unknown_override(e, argv):
    """ml_collections raises AttributeError("'key'\nDid you mean ...") for `--config.a.key=v` when
    group `a` has no `key`: name the override and the suggestion."""
    import re

    if not isinstance(e, (AttributeError, KeyError)):
        return None
    text = str(e).strip("\"' ")
    m = re.search(r"([A-Za-z0-9_]+)", text)
    if not m:
        return None
    key = m.group(1)
    for a in argv:
        name = a.split("=", 1)[0]
        if name.startswith("--config.") and (name.endswith("." + key) or f".{key}." in name):
            hint = re.search(r"Did you mean (.*?)\?", text.replace("\\n", " "))
            return (f"unknown config key {name[len('--config.'):]!r} in {a}"
                    + (f" (did you mean {hint.group(1)}?)" if hint else ""))
    return None


def config_app(prog: str, define_flags: Callable[[], None], body: Callable[[], int],
               dashed: Sequence[str] = ()) -> None:
    """Define `--config` and the command's flags, parse sys.argv (flags in `dashed` may be spelled
    with dashes), run `body()` (it reads absl's FLAGS) under `run_cli` and exit with its code."""
    path = _config_path(sys.argv)
    if path is None:
        fail(prog, "--config is required, e.g. --config configs/stage1.py")
    if not os.path.isfile(path.split(":")[0]):
        fail(prog, f"no such config file: {path.split(':')[0]}")
    _config_root_on_path(path.split(":")[0])
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "config file (get_config() → ConfigDict)", lock_config=True)
    flags.DEFINE_bool("debug", False, "show tracebacks for user errors too (also JAXSORA_DEBUG=1)")
    define_flags()
    argv = [next((a.replace(d, "--" + d[2:].replace("-", "_")) for d in dashed if a.startswith(d)), a)
            for a in sys.argv]

    def run(_):
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
        return run_cli(prog, body, argv)

    app.run(lambda a: sys.exit(run(a)), argv=argv, flags_parser=lambda args: _parse_flags(prog, args))
