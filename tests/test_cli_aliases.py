"""One name per flag across commands: `--output`, `--ckpt-path`, `--prompt-path`, `--input`, `--num-workers`,
`--runs`. The older spellings stay as hidden aliases (`jaxsora.cli.hidden_aliases`): each sets the same value as
its canonical flag, `--help` does not list it, and a required flag is required under either spelling, missing
answered in one line naming the canonical one (exit code 2)."""
from __future__ import annotations

import json
import subprocess
import textwrap

from tests.zygote import PYTHON

# (command, the arguments before the flag, canonical, alias, its value, the rest, the namespace field)
CASES = [
    ("jaxsora.tools.average", ["a/600"], "--output", "--out", "o", [], "out"),
    ("jaxsora.tools.lora", ["merge", "--ckpt-path", "r"], "--output", "--out", "o", [], "out"),
    ("jaxsora.tools.lora", ["export-adapters", "--output", "o"], "--ckpt-path", "--ckpt", "r", [], "ckpt"),
    ("jaxsora.ckpt", ["list"], "--ckpt-path", "--ckpt", "r", [], "ckpt_opt"),
    ("jaxsora.serve", ["--preset", "demo"], "--runs", "--expnums", "656", [], "runs"),
    ("data_tools.shard", ["--input", "m.csv", "--num-shards", "2"], "--output", "--out-dir", "s", [], "output"),
    ("data_tools.precompute", ["--text-encoder", "{}", "--output", "c"], "--input", "--table", "m.csv", [], "table"),
    ("data_tools.precompute", ["--input", "m.csv", "--text-encoder", "{}"], "--output", "--out", "c", [], "out"),
    ("data_tools.precompute", ["--latents", "--output", "c"], "--num-workers", "--workers", "3", [], "workers"),
    ("data_tools.synthetic", [], "--output", "--out", "d", [], "out"),
    ("jaxsora.sample", [], "--ckpt-path", "--ckpt", "r", [], "ckpt_opt"),
    ("jaxsora.sample", [], "--prompt-path", "--prompt-file", "p.txt", [], "prompt_path"),
    ("jaxsora.sample", [], "--output", "--save-dir", "o", [], "save_dir"),
    ("jaxsora.sample", [], "--output", "--out", "o", [], "save_dir"),
]
OPTIONAL = ("jaxsora.ckpt", "data_tools.shard", "jaxsora.sample")  # their canonical flag is not required
# Each command's --help: the canonical spelling listed, the older one not.
HELP = [("jaxsora.tools.average", [], "--output", "--out "),
        ("jaxsora.tools.lora", ["merge"], "--ckpt-path", "--ckpt "),
        ("jaxsora.ckpt", ["list"], "--ckpt-path", "--ckpt "),
        ("jaxsora.serve", [], "--runs", "--expnums"),
        ("data_tools.shard", [], "--output", "--out-dir"),
        ("data_tools.precompute", [], "--num-workers", "--workers"),
        ("jaxsora.tools.search_bs", [], "--output", "--out "),
        ("data_tools.synthetic", [], "--output", "--out "),
        ("jaxsora.sample", [], "--prompt-path", "--prompt-file"),
        ("jaxsora.sample", [], "--output", "--save-dir")]

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    from tests.docs_argv import capture_parser

    out = []
    for target, before, canonical, alias, value, rest, field in json.load(sys.stdin):
        got = []
        for flag in (canonical, alias):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                parser = capture_parser("module", target).parser
            ns, _ = parser.parse_known_args([*before, flag, value, *rest])
            got.append(getattr(ns, field))
        err = io.StringIO()
        code = None
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_known_args(before)
        except SystemExit as e:
            code = e.code
        out.append(dict(values=got, code=code, err=err.getvalue()))
    json.dump(out, sys.stdout)
""")


def test_an_alias_sets_what_its_canonical_flag_sets():
    r = subprocess.run([PYTHON, "-c", SCRIPT], input=json.dumps(CASES), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for case, got in zip(CASES, json.loads(r.stdout), strict=True):
        target, _, canonical, alias, value, _, _ = case
        want = [value] if canonical == "--runs" else (int(value) if value.isdigit() else value)
        assert got["values"] == [want, want], (case, got)
        if canonical in ("--output", "--ckpt-path", "--runs") and target not in OPTIONAL:
            assert got["code"] == 2, (case, got)
            lines = got["err"].strip().splitlines()
            assert len(lines) == 1 and f"required: {canonical}" in lines[0], (case, got)


def test_help_lists_only_the_canonical_spelling():
    for target, sub, canonical, alias in HELP:
        r = subprocess.run([PYTHON, "-m", target, *sub, "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (target, r.stderr[-2000:])
        assert canonical in r.stdout, (target, r.stdout)
        assert alias not in r.stdout, (target, alias, r.stdout)
