"""`dump`: every trainer's Python stacks, without stopping it.

The trainer registers `jaxsora.train.run.supervise.register_stack_dump(<run>, process_index)`, which
makes SIGUSR2 append all threads' stacks to `<run>/stacks/<process>.txt` (faulthandler: written
from the signal handler, so it works while a thread is stuck in a collective or holds the GIL in
C code). `dump` sends SIGUSR2 by the recorded pid — only when /proc/PID/status shows the signal
is caught (its default action would kill the trainer) — and collects what was appended. Without
the handler it falls back to `py-spy dump --pid` where py-spy is installed. The full dumps are kept
in `<logdir>/dumps/<time>/<host>.txt`, so a second dump minutes later shows what moved.
"""
from __future__ import annotations

import os
import re
import time

from jaxsora.cluster import records, remote
from jaxsora.cluster.hosts import log_name
from jaxsora.cluster.table import format_table
from jaxsora.errors import UserError

SIGUSR2_LINUX = 12  # the bit (number - 1) of SigCgt that says the signal is caught


def stack_file(run: str, process: int) -> str:
    return os.path.join(run, "stacks", f"{process}.txt")


def script(target: records.Target, run: str, wait: float) -> str:
    ticks = max(1, int(wait / 0.2))
    return f"""{remote.SH_LIB}
pid={int(target.pid)}; st={remote.q(target.start)}; f={remote.q(stack_file(run, target.process))}
case $(jx_state $pid "$st") in
  gone|zombie) echo "@@result gone"; exit 0;;
  reused) echo "@@result reused"; exit 0;;
esac
mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' /proc/$pid/status 2>/dev/null)
caught=0
if [ -n "$mask" ]; then last=${{mask#"${{mask%????}}"}}; caught=$(( (0x$last >> {SIGUSR2_LINUX - 1}) & 1 )); fi
if [ "$caught" = 1 ] && [ -f "$f" ]; then
  size=$(wc -c < "$f")
  kill -USR2 $pid 2>/dev/null || {{ echo "@@result cannot-signal"; exit 0; }}
  n=0; prev=$size
  while [ $n -lt {ticks} ]; do
    sleep 0.2; n=$((n+1)); cur=$(wc -c < "$f")
    [ "$cur" -gt "$size" ] && [ "$cur" = "$prev" ] && break
    prev=$cur
  done
  echo "@@stack"; tail -c +$((size+1)) "$f"
  echo "@@result ok"
elif command -v py-spy >/dev/null 2>&1; then
  echo "@@stack"; py-spy dump --pid $pid 2>&1
  echo "@@result py-spy"
elif [ "$caught" = 1 ]; then echo "@@result no-file"
else echo "@@result no-handler"
fi
"""


def top_frame(stack: str) -> str | None:
    """The innermost frame of the signalled (or else the main) thread of a faulthandler/py-spy dump."""
    blocks, current = [], None
    for line in stack.splitlines():
        if re.match(r"^(Current thread|Thread) ", line):
            current = [line]
            blocks.append(current)
        elif current is not None and line.strip():
            current.append(line.strip())
    if not blocks:
        return None
    pick = next((b for b in blocks if b[0].startswith("Current thread") or "MainThread" in b[0]), blocks[-1])
    return pick[1] if len(pick) > 1 else None


MESSAGES = {
    "gone": "the trainer is not running",
    "reused": "the trainer is gone (its pid now belongs to another process)",
    "cannot-signal": "cannot signal it (another user's process?)",
    "no-file": "SIGUSR2 is caught, but there is no {file} (another --run?)",
    "no-handler": "not signalled: the trainer does not catch SIGUSR2 (it did not call register_stack_dump; the "
                  "signal would kill it) and py-spy is not installed there",
}


def dump(ctx, *, wait: float = 5.0, lines: int = 40) -> int:
    if not ctx.run:
        raise UserError("dump needs the run folder: --run <run folder> (or `launch --run`), where the "
                        "trainer writes stacks/<process>.txt")
    targets = records.targets(ctx, ctx.hosts)
    known = {h: t for h, t in targets.items() if t.pid and t.process is not None}
    if not known:
        raise UserError(f"no trainer pid: no {records.PIDS} in {ctx.logdir} and no heartbeat under {ctx.run}")
    results = remote.run_all(ctx.runner, ctx.hosts, lambda i, h: script(known[h], ctx.run, wait) if h in known
                             else None, wait + ctx.timeout + 10)
    folder = os.path.join(ctx.logdir, "dumps", time.strftime("%Y%m%d-%H%M%S"))
    rows, ok = [], True
    for r in results:
        t = targets[r.host]
        if r.host not in known:
            rows.append((r.host, None, "no recorded pid", None))
            ok = False
            continue
        word = r.field("result")
        stack = "\n".join(r.fields().get("stack", []))
        if r.failure() or word not in ("ok", "py-spy"):
            what = r.failure() or MESSAGES.get(word, f"unexpected answer: {(r.out + r.err).strip()[-200:]}")
            rows.append((r.host, t.pid, what.format(file=stack_file(ctx.run, t.process)), None))
            ok = False
            continue
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, log_name(r.host) + ".txt"), "w") as f:
            f.write(stack + "\n")
        print(f"===== {r.host} (process {t.process}, pid {t.pid}){' via py-spy' if word == 'py-spy' else ''}")
        tail = stack.splitlines()[-lines:]
        print("\n".join(tail) if tail else "(empty)")
        rows.append((r.host, t.pid, "stacks" if stack.strip() else "signalled, nothing written", top_frame(stack)))
    print()
    print(format_table(("host", "pid", "result", "innermost frame"), rows))
    if os.path.isdir(folder):
        print(f"full dumps in {folder}")
    return 0 if ok else 1
