"""`python -m jaxsora.ckpt list|verify DIR`: check training checkpoints without a model config.

DIR (or `--ckpt-path DIR`) is a run's outputs folder, its `checkpoints/` folder or one step folder
`checkpoints/N`.
Every array of each checkpoint is read on the host (numpy, no accelerator) and its fingerprint is
compared with the step's `integrity.json` (see `jaxsora.checkpoint`).

    list    a table: step, size on disk, contents (full = weights and optimizer state; weights
            only = no opt_state/ item, e.g. a copy made with `rsync --exclude opt_state`, or a
            converter output; "state/ layout" = the older single-item layout), intact /
            corrupt (why) / partial (why) / unverified (old)
    verify  one line per checkpoint and a summary

A copy without the optimizer state is intact when the items it has are (their arrays are checked;
`--load` refuses it, sampling, conversion and `--ckpt-path` read it).

Exit status: 0 every checkpoint intact (or unverified: older than integrity records), 1 some are
corrupt or partial (`list` exits 0 after printing the table), 2 a usage mistake (no such folder,
no checkpoint), with one line on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxsora.cli import ArgumentParser, hidden_aliases
from jaxsora.cli import HelpFormatter as _Help

# The checks run on the host: never take an accelerator (a training job may hold it).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

EXIT_OK, EXIT_CORRUPT = 0, 1  # usage errors: 2 (jaxsora.errors.EXIT_USER_ERROR)




def _reports(path: str, step):
    from jaxsora import checkpoint as ck

    root, named = ck.resolve_checkpoint(path, step)  # raises for a folder without checkpoints
    steps = [named] if named is not None else ck.checkpoint_steps(root)
    unfinished = [] if named is not None else ck.unfinished_saves(root)
    return root, [ck.verify_step(root, s) for s in steps], unfinished


def cmd_list(args) -> int:
    root, reports, unfinished = _reports(args.dir, args.step)  # a wrong path: answered before jax is imported
    from jaxsora.checkpoint.orbax_errors import fmt_bytes

    print(f"checkpoints in {root}")
    width = max([len("contents")] + [len(r.contents) for r in reports])
    print(f"{'step':>8}  {'size':>10}  {'contents':<{width}}  status")
    for r in reports:
        print(f"{r.step:>8}  {fmt_bytes(r.bytes):>10}  {r.contents:<{width}}  {r.status}"
              + (f" ({r.reason})" if r.reason else ""))
    for name in unfinished:
        print(f"{name.split('.', 1)[0]:>8}  {'-':>10}  {'-':<{width}}  unfinished save ({name}; never read, replaced "
              "by the next save)")
    return EXIT_OK


def cmd_verify(args) -> int:
    root, reports, unfinished = _reports(args.dir, args.step)
    for r in reports:
        print(f"step {r.step}: {r.status}" + (f" ({r.reason})" if r.reason else "")
              + (f" [{r.contents}]" if r.contents != "full" else ""))
    for name in unfinished:
        print(f"{name}: unfinished save (never read)")
    counts = {}
    for r in reports:
        counts[r.status] = counts.get(r.status, 0) + 1
    print(f"{len(reports)} checkpoint(s) in {root}: "
          + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return EXIT_CORRUPT if any(r.status in ("corrupt", "partial") for r in reports) else EXIT_OK


def main(argv=None) -> int:
    """The command's body; a CheckpointError propagates (see `run`)."""
    from jaxsora.errors import BadInput

    ap = ArgumentParser(prog="python -m jaxsora.ckpt", description=__doc__, formatter_class=_Help,
                        epilog="exit status: 0 all intact, 1 some corrupt or partial (verify), 2 usage error")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (("list", cmd_list, "table of the checkpoints: step, size, contents, status"),
                           ("verify", cmd_verify, "check every checkpoint; exit 1 if any is corrupt")):
        p = sub.add_parser(name, help=text, description=text, formatter_class=_Help)
        p.add_argument("dir", nargs="?", metavar="DIR",
                       help="run outputs folder, its checkpoints/ folder, or a step folder checkpoints/N")
        hidden_aliases(p, p.add_argument("--ckpt-path", dest="ckpt_opt", metavar="DIR", help="the same as DIR"),
                       "--ckpt")
        p.add_argument("--step", type=int, default=None, help="only this step (default: every step)")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks instead of one-line errors")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    if args.dir and args.ckpt_opt and os.path.normpath(args.dir) != os.path.normpath(args.ckpt_opt):
        raise BadInput(f"two checkpoints given ({args.dir} and --ckpt-path {args.ckpt_opt})")
    args.dir = args.dir or args.ckpt_opt
    if not args.dir:
        raise BadInput(f"give a checkpoint folder: python -m jaxsora.ckpt {args.cmd} DIR")
    return args.fn(args)


def run(argv=None) -> int:
    """`main` with a CheckpointError (a UserError) as one line on stderr and exit code 2."""
    from jaxsora.errors import run_cli

    return run_cli("jaxsora.ckpt", lambda: main(argv), argv)


if __name__ == "__main__":
    sys.exit(run())
