"""Test helper (run as a script by tests/test_docs.py): parse documented command lines with each command's own
parser, and run nothing else.

stdin: a JSON list of {"kind": "module" | "script", "target": "jaxsora.train" | "bench/step.py", "argv": [...],
"loose": bool}; stdout: a JSON list of {"ok": bool, "message": str}, one per command, in order.

Each command is checked in a fork of this process, as `python -m TARGET ARGV` would start:
- argparse commands: the command's module runs as `__main__` until it first asks its parser to parse; that parser
  (the real one, subcommands and hidden aliases included) is taken there, the module is stopped, and the
  documented argv is parsed by it. A command that parses with `parse_known_args` (config overrides after its
  own flags) may leave only `--config.group.key=value` arguments, and those must name keys of its `--config`.
- absl commands (`jaxsora.train`, `jaxsora.tools.search_bs`): `jaxsora.cli.config_app` parses the flags and the
  config file with its overrides as the command does; the command's body is replaced by a no-op.
A mistake is the command's own one-line message (exit code 2). `loose` (a command written in prose, with
placeholders): only an unknown flag or config key counts.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNKNOWN = ("unrecognized arguments", "Unknown command line flag", "unknown config key", "ambiguous option",
           "not a --config.")


class _Captured(BaseException):
    def __init__(self, parser, known: bool):
        super().__init__()
        self.parser, self.known = parser, known


def _config_keys_exist(argv, rest) -> str | None:
    """`--config.a.b=v` leftovers of a parse_known_args command: each must name a key of its `--config` file."""
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    config = config or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        return f"unrecognized arguments: {' '.join(bad)} (not a --config.KEY=VALUE override)"
    if not rest:
        return None
    if not config:
        return f"{rest[0]}: no --config to override"
    from jaxsora.config_files import register_configs_package

    register_configs_package(config)
    import importlib.util

    spec = importlib.util.spec_from_file_location("_docs_config", config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for arg in rest:
        node = cfg
        for part in arg.split("=", 1)[0][len("--config."):].split("."):
            if part not in node:
                return f"unknown config key in {arg}"
            node = node[part]
    return None


def capture_parser(kind: str, target: str, argv: list[str] = ()) -> _Captured | None:
    """The argparse parser command `target` builds (`_Captured`: the parser, and whether it parses with
    parse_known_args), taken when the command first asks it to parse; None for a command that parses otherwise
    (absl: `jaxsora.cli.config_app`, which then parsed `argv` itself, raising SystemExit with its verdict)."""
    import jaxsora.cli

    sys.argv = [target, *argv]
    parse_args, parse_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture_args(self, args=None, namespace=None):
        raise _Captured(self, known=False)

    def capture_known(self, args=None, namespace=None):
        raise _Captured(self, known=True)

    argparse.ArgumentParser.parse_args = capture_args
    argparse.ArgumentParser.parse_known_args = capture_known
    jaxsora.cli.run_cli = lambda prog, body, argv=None: 0  # absl commands: parsed, nothing run
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.join(REPO, target), run_name="__main__")
    except _Captured as c:
        return c
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known
    return None


def _parse(c: _Captured, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of the captured parser parsing `argv`."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if not c.known:
                c.parser.parse_args(argv)
                return 0, ""
            _, rest = c.parser.parse_known_args(argv)
        problem = _config_keys_exist(argv, rest)
        return (2, problem) if problem else (0, "")
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), err.getvalue()


def _check_group(kind: str, target: str, argvs: list[list[str]]) -> list[tuple[int, str]]:
    """(exit code, stderr) of parsing each of `argvs` as command `target` does: an argparse command's parser is
    taken once and parses them all; an absl command parses the first only (the parent forks again for the rest,
    since absl's flags are process-global)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            c = capture_parser(kind, target, argvs[0])
        if c is None:
            return [(0, "")]
    except SystemExit as e:  # an absl command's parse (0: parsed), or a mistake found before any parser
        return [((e.code if isinstance(e.code, int) else (0 if e.code is None else 1)), err.getvalue())]
    return [_parse(c, argv) for argv in argvs]


def _in_child(kind: str, target: str, argvs: list[list[str]]) -> list[dict]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one command's parser
        os.close(read)
        try:
            got = _check_group(kind, target, argvs)
        except BaseException as e:  # noqa: BLE001 - reported, not raised: the parent reads it
            got = [(1, f"{type(e).__name__}: {e}")]
        with os.fdopen(write, "w") as f:
            json.dump([{"code": code, "message": message.strip()} for code, message in got], f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else [{"code": 1, "message": "the checking process died"}]


def main() -> None:
    jobs = json.load(sys.stdin)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault((job["kind"], job["target"]), []).append(i)
    got: dict[int, dict] = {}
    for (kind, target), members in groups.items():
        todo = members
        while todo:
            answers = _in_child(kind, target, [jobs[i]["argv"] for i in todo])
            got.update(zip(todo, answers))
            todo = todo[len(answers):]  # an absl command answers one at a time
    results = []
    for i, job in enumerate(jobs):
        g = got[i]
        ok = g["code"] == 0 or (job.get("loose") and not any(u in g["message"] for u in UNKNOWN))
        results.append({"ok": bool(ok), "message": g["message"]})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
