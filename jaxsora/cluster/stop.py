"""`stop`: end the trainers by their recorded pids — never by a process-name pattern.

SIGTERM first (the trainer finishes its step, saves a checkpoint and exits; with many processes
JAX's preemption service makes every host save the same step), then, after `--grace` seconds,
SIGKILL — to the trainer's process group when it leads one (`launch` starts it with `setsid`, so
its loader workers go too). A pid is only signalled while it still belongs to the recorded process
(its start time in /proc matches), so a pid reused by another process is left alone.
"""
from __future__ import annotations

from jaxsora.cluster import records, remote
from jaxsora.cluster.table import format_table
from jaxsora.errors import UserError

POLL = 0.2


def script(target: records.Target, grace: float) -> str:
    ticks = max(1, int(grace / POLL))
    return f"""{remote.SH_LIB}
pid={int(target.pid)}; st={remote.q(target.start)}
case $(jx_state $pid "$st") in
  gone|zombie) echo "@@result gone"; exit 0;;
  reused) echo "@@result reused"; exit 0;;
esac
kill -TERM $pid 2>/dev/null || {{ echo "@@result cannot-signal"; exit 0; }}
n=0; while [ "$(jx_state $pid "$st")" = alive ] && [ $n -lt {ticks} ]; do sleep {POLL}; n=$((n+1)); done
[ "$(jx_state $pid "$st")" = alive ] || {{ echo "@@result term $n"; exit 0; }}
if [ "$(jx_pgrp $pid)" = "$pid" ]; then kill -KILL -$pid 2>/dev/null || kill -KILL $pid; else kill -KILL $pid; fi
n=0; while [ "$(jx_state $pid "$st")" = alive ] && [ $n -lt 25 ]; do sleep {POLL}; n=$((n+1)); done
[ "$(jx_state $pid "$st")" = alive ] && echo "@@result alive" || echo "@@result killed"
"""


def describe(result: remote.Result, grace: float) -> tuple[str, bool]:
    """(what happened, whether the trainer is gone now)."""
    why = result.failure()
    if why:
        return why, False
    word, _, n = result.field("result").partition(" ")
    return {
        "gone": ("was not running", True),
        "reused": ("not signalled: the pid now belongs to another process (the trainer is gone)", True),
        "cannot-signal": ("cannot signal it (another user's process?)", False),
        "term": (f"exited after SIGTERM ({float(n or 0) * POLL:.1f}s)", True),
        "killed": (f"killed (SIGKILL after {grace:.0f}s)", True),
        "alive": ("still alive after SIGKILL (stuck in the kernel/driver?)", False),
    }.get(word, (f"unexpected answer: {(result.out + result.err).strip()[-200:]}", False))


def stop(ctx, *, grace: float = 180.0) -> int:
    targets = records.targets(ctx, ctx.hosts)
    known = {h: t for h, t in targets.items() if t.pid}
    if not known:
        where = f"no heartbeat under {ctx.run}" if (ctx.slurm and ctx.run) else (
            "give --run <run folder> (pids from its heartbeats)" if ctx.slurm else
            f"no {records.PIDS} in {ctx.logdir} (give the --logdir of the launch)")
        raise UserError(f"nothing to stop: no recorded trainer pid ({where})")
    results = remote.run_all(ctx.runner, ctx.hosts, lambda i, h: script(known[h], grace) if h in known else None,
                             grace + ctx.timeout + 10)
    rows, ok = [], True
    for r in results:
        t = targets[r.host]
        if not t.pid:
            rows.append((r.host, None, "no recorded pid"))
            continue
        what, gone = describe(r, grace)
        ok &= gone
        rows.append((r.host, t.pid, what))
    print(format_table(("host", "pid", "result"), rows))
    return 0 if ok else 1
