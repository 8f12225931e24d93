"""The run config's checks, under the name users and tools import (`from jaxsora.config import
validate_config, ConfigError`). They live with the training code that owns what they check:
`jaxsora/train/plan/validate.py` and `ranges.py`; the error class is `jaxsora.errors.ConfigError`.

Also the command `python -m jaxsora.config translate OPEN_SORA_CONFIG.py [--output FILE]`: writes the jaxsora
config file (`get_config()`) equivalent to an Open-Sora 1.2 train config (`jaxsora.opensora_config`)."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxsora.errors import ConfigError
from jaxsora.train.plan.ranges import RANGES, check_ranges
from jaxsora.train.plan.validate import load_bucket_config_file, need_table, validate_config

__all__ = ["ConfigError", "RANGES", "check_ranges", "format_config", "load_bucket_config_file", "need_table",
           "validate_config"]

PROG = "jaxsora.config"


def format_config(config) -> str:
    """One line per key, `group.key = value` (dict values — bucket tables, mask ratios — on their line)."""
    from jaxsora.opensora_config.reader import plain

    lines = []

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and prefix == "":
                walk(v, f"{k}.")
            else:
                lines.append(f"{prefix}{k} = {v!r}")

    walk(plain(config), "")
    return "\n".join(lines)


def build_parser():
    from jaxsora.cli import ArgumentParser

    ap = ArgumentParser(prog=f"python -m {PROG}", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("translate", help="write the jaxsora config file equivalent to an Open-Sora 1.2 train config",
                       description="Write the jaxsora config file (get_config()) equivalent to an Open-Sora 1.2 "
                                   "train config: each value commented with the Open-Sora key it comes from, the "
                                   "keys meaningless here listed at the top. It resolves to exactly the config "
                                   "`python -m jaxsora.train OPEN_SORA_CONFIG.py` runs.")
    t.add_argument("config", help="the Open-Sora config file (mmengine-style, _base_ chains followed)")
    t.add_argument("--output", "-o", default=None, help="the file to write (default: print it)")
    t.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    import os

    from jaxsora.errors import OutputExists
    from jaxsora.opensora_config.translate import translate_file

    args = build_parser().parse_args(argv)
    from jaxsora.errors import BadInput, MissingFile
    from jaxsora.opensora_config import is_opensora_config

    if not os.path.isfile(args.config):
        raise MissingFile(f"no such config file: {args.config}")
    if not is_opensora_config(args.config):
        raise BadInput(f"{args.config} is a jaxsora config already (it defines get_config()), or not a Python file")
    text = translate_file(args.config)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    if os.path.exists(args.output) and not args.force:
        raise OutputExists(f"{args.output} exists (--force overwrites it)")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(text)
    print(f"[{PROG}] wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from jaxsora.errors import run_cli

    sys.exit(run_cli(PROG, main))
