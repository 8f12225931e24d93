"""The shared front of the config-driven commands (`jaxsora.train`, `jaxsora.tools.search_bs`):
`--config FILE` with `--config.group.key=value` overrides (absl + ml_collections), the reference's
dashed flag names, and every mistake in them — a missing or broken config file, an unknown flag or
key, a value of the wrong type — as one line and exit code 2 (`jaxsora.errors`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from jaxsora.config_files import register_configs_package
from jaxsora.errors import debug_requested, fail, run_cli


def _config_path(argv):
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    if len(argv) > 1 and _positional_config(argv[1]):
        return argv[1]
    return None


def _positional_config(arg: str) -> bool:
    """The first argument names the config file as Open-Sora's scripts take it (`train.py CONFIG ...`)."""
    return not arg.startswith("-") and arg.split(":")[0].endswith(".py")


def _with_config_flag(argv):
    """argv with a positional config file (the first argument) spelled `--config FILE`."""
    if len(argv) > 1 and _positional_config(argv[1]) and not any(
            a == "--config" or a.startswith("--config=") for a in argv):
        return [argv[0], "--config", argv[1], *argv[2:]]
    return list(argv)


def _without_config_flag(argv):
    """argv less `--config FILE` / `--config=FILE` (the overrides --config.KEY=VALUE stay)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--config" and i + 1 < len(argv):
            skip = True
            continue
        if not a.startswith("--config="):
            out.append(a)
    return out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` of every argparse command: the description as written, and each flag's default after
    its help, unless the help says it already or the flag is required."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """Every argparse command's parser: `--help` with the flags' defaults (HelpFormatter), and a usage
    mistake (a bad value, an unknown flag or choice) as one line and exit code 2, not the usage block.
    Subcommand parsers are of this class too (argparse's default parser_class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        fail(self.prog.removeprefix("python -m ").split()[0], f"{message} (see --help)")  # a subcommand: its command

    def parse_known_args(self, args=None, namespace=None):
        """argparse's parse, then the required flags that have hidden aliases (`hidden_aliases`): argparse
        cannot require "one of these spellings", so they are checked here, with argparse's own message."""
        namespace, rest = super().parse_known_args(args, namespace)
        missing = [a.option_strings[0] for a in self._actions
                   if getattr(a, "required_with_aliases", False) and getattr(namespace, a.dest, None) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return namespace, rest


def hidden_aliases(container, action: argparse.Action, *names: str) -> argparse.Action:
    """Older spellings of `action`'s flag (`--out` for `--output`, `--ckpt` for `--ckpt-path`): they set the
    same value and keep working, and `--help` lists only the canonical name. `container` is the parser or
    argument group `action` was added to; a required `action` stays required under any of its spellings
    (checked by `ArgumentParser.parse_known_args`, so the parser must be of that class)."""
    kwargs = dict(dest=action.dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if isinstance(action, (argparse._StoreAction, argparse._AppendAction, argparse._ExtendAction)):
        kwargs.update(nargs=action.nargs, type=action.type, choices=action.choices, metavar=action.metavar)
        kwargs["action"] = {argparse._StoreAction: "store", argparse._AppendAction: "append",
                            argparse._ExtendAction: "extend"}[type(action)]
    elif isinstance(action, argparse._StoreTrueAction):
        kwargs["action"] = "store_true"
    else:
        raise TypeError(f"hidden_aliases: unsupported action {type(action).__name__} of {action.option_strings}")
    for name in names:
        container.add_argument(name, **kwargs)
    if action.required:
        action.required = False
        action.required_with_aliases = True
    return action


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


def _print_help(prog: str, define_flags: Callable[[], None], dashed: Sequence[str]) -> None:
    """`--help`, with or without `--config`: the command's docstring and its flags (exit code 0)."""
    from absl import flags

    before = set(flags.FLAGS)
    define_flags()
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    print(doc or f"python -m {prog} --config FILE [--config.KEY=VALUE ...] [flags]")
    print("\nflags:")
    rows = [("--config FILE", "the config file (get_config() → ConfigDict); required"),
            ("--config.KEY=VALUE", "override one config value, e.g. --config.optim.lr=2e-4"),
            ("--debug", "show tracebacks for user errors too (also JAXSORA_DEBUG=1)")]
    for name in [n for n in flags.FLAGS if n not in before]:
        flag = flags.FLAGS[name]
        if flag.help.startswith("Alias for --"):  # an older spelling (absl's DEFINE_alias): it works, unlisted
            continue
        spelled = "--" + name.replace("_", "-")
        rows.append((spelled if spelled in dashed else "--" + name,
                     flag.help + ("" if flag.default in (None, False) else f" (default: {flag.default})")))
    width = max(len(r[0]) for r in rows)
    for flag_name, text in rows:
        print(f"  {flag_name:<{width}}  {text}")


def _read_opensora(prog, path, argv):
    """(argv less Open-Sora's own training flags, the Open-Sora file read into jaxsora terms with those flags
    applied as Open-Sora applies them: `jaxsora.opensora_config`); a mistake in either is one line."""
    from jaxsora.errors import UserError
    from jaxsora.opensora_config.train import split_opensora_flags, translate_train

    try:
        argv, given = split_opensora_flags(argv)
        return argv, translate_train(path, given)
    except UserError as e:
        if debug_requested(argv):
            raise
        fail(prog, str(e))


def _refuse_opensora_flags(prog, argv):
    """Open-Sora's training flags belong to its config files: with a jaxsora config, one line naming the
    override that does the same."""
    from jaxsora.opensora_config.train import OPEN_SORA_TRAIN_FLAGS

    instead = {"--lr": "--config.optim.lr=2e-4", "--warmup-steps": "--config.optim.warmup_steps=1000",
               "--batch-size": "--config.data.batch_size_override=4", "--seed": "--config.train.seed=42",
               "--dtype": "--config.model.compute_dtype=bfloat16", "--wandb": "--config.wandb.enabled=true"}
    for a in argv[1:]:
        name = a.partition("=")[0]
        if name in OPEN_SORA_TRAIN_FLAGS:
            hint = f"; with a jaxsora config: {instead[name]}" if name in instead else " (it changes nothing here)"
            fail(prog, f"{name} is Open-Sora's flag for its own config files{hint}")


def _opensora_argv(prog, path, translation, argv, flag_values):
    """argv for absl with an Open-Sora file: without `--config FILE` (its config is the flag's default), with the
    run flags the file names (`load`, `model.from_pretrained` as --ckpt-path, `start_from_scratch`) unless the
    command line gives them, and --data-path sent where the file's dataset reads it; the notes printed once."""
    argv = _without_config_flag(argv)
    given = {a.split("=", 1)[0].lstrip("-") for a in argv[1:] if a.startswith("--")}
    for name, value in translation.flags.items():
        if name in flag_values and name not in given:
            argv.append(f"--{name}" if value is True else f"--{name}={value}")
    if translation.data_path_key != "data.table":
        for i, a in enumerate(argv):
            if a == "--data_path" and i + 1 < len(argv):
                argv[i:i + 2] = [f"--config.{translation.data_path_key}={argv[i + 1]}"]
                break
            if a.startswith("--data_path="):
                argv[i] = f"--config.{translation.data_path_key}={a.split('=', 1)[1]}"
                break
    for note in translation.notes:
        print(f"[{prog}] {os.path.basename(path)}: {note}", file=sys.stderr, flush=True)
    return argv


def config_app(prog: str, define_flags: Callable[[], None], body: Callable[[], int],
               dashed: Sequence[str] = ()) -> None:
    """Define `--config` and the command's flags, parse sys.argv (flags in `dashed` may be spelled
    with dashes), run `body()` (it reads absl's FLAGS) under `run_cli` and exit with its code."""
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in sys.argv[1:]):
        _print_help(prog, define_flags, dashed)
        sys.exit(0)
    sys.argv[:] = _with_config_flag(sys.argv)  # `python -m jaxsora.train FILE.py ...`, as Open-Sora's train.py
    path = _config_path(sys.argv)
    if path is None:
        fail(prog, "--config is required, e.g. --config configs/stage1.py (or the file first: jaxsora.train FILE.py)")
    if not os.path.isfile(path.split(":")[0]):
        fail(prog, f"no such config file: {path.split(':')[0]}")
    from jaxsora.opensora_config import is_opensora_config

    opensora = is_opensora_config(path)
    if not opensora:
        register_configs_package(path.split(":")[0])
    from absl import app, flags
    from ml_collections import config_flags

    argv = [next((a.replace(d, "--" + d[2:].replace("-", "_")) for d in dashed if a.startswith(d)), a)
            for a in sys.argv]
    flags.DEFINE_bool("debug", False, "show tracebacks for user errors too (also JAXSORA_DEBUG=1)")
    define_flags()
    if opensora:  # an Open-Sora (mmengine-style) file: read into the jaxsora config, its notes said once
        argv, translation = _read_opensora(prog, path, argv)
        argv = _opensora_argv(prog, path, translation, argv, flags.FLAGS)
        # sys_argv: the overrides (--config.KEY=VALUE) are looked up in the argv absl parses
        config_flags.DEFINE_config_dict("config", translation.config(), "the Open-Sora config, read into jaxsora's",
                                        lock_config=True, sys_argv=argv)
    else:
        _refuse_opensora_flags(prog, argv)
        config_flags.DEFINE_config_file("config", None, "config file (get_config() → ConfigDict)", lock_config=True)

    def run(_):
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
        return run_cli(prog, body, argv)

    app.run(lambda a: sys.exit(run(a)), argv=argv, flags_parser=lambda args: _parse_flags(prog, args))
