"""`python -m jaxsora.cluster [--hostfile F | --slurm JOB] <launch|status|stop|dump|preflight>` —
see `jaxsora/cluster/__init__.py`. Mistakes in what was given are one line and exit code 2."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxsora.cli import ArgumentParser
from jaxsora.cli import HelpFormatter as _Help
from jaxsora.cluster import records, remote
from jaxsora.cluster.hosts import read_hostfile, slurm_hosts
from jaxsora.errors import UserError, run_cli

PROG = "jaxsora.cluster"
DEFAULT_LOGDIR = os.path.join("logs", "cluster")




def _common(parser: argparse.ArgumentParser, default) -> None:
    """Options accepted before and after the command (`default`: SUPPRESS after it, so a value given
    before is kept)."""
    d = (lambda v: default if default is argparse.SUPPRESS else v)
    parser.add_argument("--hostfile", default=d(None), help="one host per line; the first is process 0 and "
                        "the coordinator")
    parser.add_argument("--slurm", metavar="JOBID", default=d(None), help="the nodes of this running SLURM job "
                        "(status/stop/dump/preflight), reached with srun --overlap")
    parser.add_argument("--ssh", default=d(remote.DEFAULT_SSH), help=f"ssh command (default: {remote.DEFAULT_SSH})")
    parser.add_argument("--workdir", default=d(None), help="folder to cd to on every host (default: this one)")
    parser.add_argument("--logdir", default=d(None), help=f"per-host logs and pids.json (default: "
                        f"<workdir>/{DEFAULT_LOGDIR})")
    parser.add_argument("--run", default=d(None), help="the run folder (<outputs>/<NNN>-<experiment> or the "
                        "trainer's --run-dir): heartbeats, stacks (default: the one given to launch)")
    parser.add_argument("--timeout", type=float, default=d(30.0), help="seconds to wait for a host (default 30)")
    parser.add_argument("--debug", action="store_true", default=d(False), help="tracebacks for user errors too")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m jaxsora.cluster", description=sys.modules["jaxsora.cluster"].__doc__,
                        formatter_class=_Help)
    _common(ap, None)
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def add(name, help):
        p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        _common(p, argparse.SUPPRESS)
        return p

    p = add("launch", "run `-- CMD ...` on every host (detached; logs and pids.json in --logdir)")
    p.add_argument("--port", type=int, default=12355, help="coordinator port (default 12355)")
    p.add_argument("--coordinator", help="coordinator address as the other hosts reach it (default: the first "
                   "host)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="an extra variable (repeatable)")
    p.add_argument("--force", action="store_true", help="launch even beside GPU processes or a live launch")
    p = add("status", "GPUs (nvidia-smi), trainer, step and heartbeat age of every host")
    p.add_argument("--json", action="store_true", help="one JSON object per host")
    p.add_argument("--stale", type=float, default=900.0, help="warn about heartbeats older than this many seconds")
    p = add("stop", "SIGTERM the recorded trainers, SIGKILL after --grace")
    p.add_argument("--grace", type=float, default=180.0, help="seconds between TERM and KILL (default 180: "
                   "time to save a checkpoint)")
    p = add("dump", "every trainer's Python stacks (SIGUSR2 → <run>/stacks/<process>.txt)")
    p.add_argument("--wait", type=float, default=5.0, help="seconds to wait for the stacks (default 5)")
    p.add_argument("--lines", type=int, default=40, help="lines of each host's dump to print (default 40)")
    p = add("preflight", "clock skew, free disk, versions, coordinator port, shared outputs")
    p.add_argument("--port", type=int, default=12355, help="coordinator port to check (default 12355)")
    p.add_argument("--coordinator", help="coordinator address (default: the first host)")
    p.add_argument("--outputs", default="outputs", help="the outputs folder, relative to --workdir (default: outputs)")
    p.add_argument("--python", default="python", help="python that runs jaxsora on the hosts (default: python)")
    p.add_argument("--max-skew", type=float, default=0.5, help="seconds a host's clock may be off (default 0.5)")
    p.add_argument("--min-free-gb", type=float, default=50.0, help="free space needed under outputs (default 50)")
    return ap


def context(args) -> remote.Context:
    if args.hostfile and args.slurm:
        raise UserError("give either --hostfile or --slurm, not both")
    if args.slurm and args.cmd == "launch":
        raise UserError("launch works from a hostfile over ssh; in a SLURM job use launch/slurm.sbatch (srun starts "
                        "the processes), then status/dump/stop --slurm JOBID")
    if args.hostfile:
        hosts, runner = read_hostfile(args.hostfile), remote.Ssh(args.ssh)
    elif args.slurm:
        hosts, runner = slurm_hosts(args.slurm), remote.Srun(args.slurm)
    else:
        raise UserError("which hosts? give --hostfile FILE (one host per line) or --slurm JOBID")
    workdir = os.path.abspath(args.workdir or os.getcwd())
    logdir = os.path.join(workdir, args.logdir or DEFAULT_LOGDIR)
    run = os.path.join(workdir, args.run) if args.run else None
    if run is None and not args.slurm and args.cmd != "launch":
        run = (records.read_pids(logdir) or {}).get("run")
    return remote.Context(hosts=hosts, runner=runner, logdir=logdir, workdir=workdir, run=run, slurm=args.slurm,
                          timeout=args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if args.cmd == "launch" and not command:
        raise UserError("launch: no command after `--` (e.g. launch -- python -m jaxsora.train --config ...)")
    if command and args.cmd != "launch":
        raise UserError(f"{args.cmd} takes no command after `--`")
    ctx = context(args)
    if args.cmd == "launch":
        from jaxsora.cluster.launch import launch

        return launch(ctx, command, port=args.port, coordinator=args.coordinator, env=args.env, force=args.force)
    if args.cmd == "status":
        from jaxsora.cluster.status import status

        return status(ctx, as_json=args.json, stale=args.stale)
    if args.cmd == "stop":
        from jaxsora.cluster.stop import stop

        return stop(ctx, grace=args.grace)
    if args.cmd == "dump":
        from jaxsora.cluster.dump import dump

        return dump(ctx, wait=args.wait, lines=args.lines)
    from jaxsora.cluster.launch import coordinator_address
    from jaxsora.cluster.preflight import preflight

    return preflight(ctx, coordinator=coordinator_address(ctx.hosts, args.coordinator, args.port),
                     outputs=args.outputs, python=args.python, max_skew=args.max_skew, min_free_gb=args.min_free_gb)


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
