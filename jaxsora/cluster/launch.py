"""`launch -- CMD...`: the same command on every host, detached, with the variables that
`jaxsora.parallel.distributed.resolve` reads for a multi-process run.

On each host: `cd <workdir>`, export JAX_COORDINATOR_ADDRESS (first host:port), JAX_NUM_PROCESSES
and JAX_PROCESS_ID (the host's line in the hostfile, from 0), start CMD in its own session
(`setsid`, stdin /dev/null, stdout+stderr appended to `<logdir>/<host>.log`), record its pid, and
leave a watcher that appends the exit code to the log and to `<logdir>/<host>.exit`. The launcher
returns at once and writes `<logdir>/pids.json`. If a host fails to start, the others are stopped
(they would wait for it in jax.distributed.initialize).
"""
from __future__ import annotations

import os
import re
import shlex
import time

from jaxsora.cluster import records, remote, status
from jaxsora.cluster.hosts import address_of, log_name
from jaxsora.cluster.table import format_table
from jaxsora.errors import BadInput, UserError

# The names jaxsora.parallel.distributed.resolve() reads (after its flags, before any detected cluster).
COORDINATOR, NUM_PROCESSES, PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
DEFAULT_PORT = 12355  # launch/slurm.sbatch's JAX_COORDINATOR_PORT default too
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def split_env(command: list[str], env: list[str]) -> tuple[dict, list[str]]:
    """`--env K=V` and leading `K=V` words of the command (`NCCL_DEBUG=WARN python ...`) → (env, command)."""
    out = {}
    for item in env:
        if not _ASSIGN.match(item):
            raise BadInput(f"--env expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    while command and _ASSIGN.match(command[0]):
        k, v = command.pop(0).split("=", 1)
        out[k] = v
    if not command:
        raise UserError("launch: no command after `--` (e.g. launch -- python -m jaxsora.train --config ...)")
    return out, command


def coordinator_address(hosts: list[str], coordinator: str | None, port: int) -> str:
    host = coordinator or address_of(hosts[0])
    return host if re.search(r":\d+$", host) and host.count(":") == 1 else f"{host}:{port}"


def process_env(coordinator: str, n: int, i: int) -> dict:
    return {COORDINATOR: coordinator, NUM_PROCESSES: str(n), PROCESS_ID: str(i)}


def script(host: str, i: int, n: int, ctx, command: list[str], env: dict) -> str:
    q = remote.q
    log = os.path.join(ctx.logdir, log_name(host) + ".log")
    exports = " ".join(f"{k}={q(v)}" for k, v in env.items())
    cmd = shlex.join(command)
    return f"""{remote.SH_LIB}
cd {q(ctx.workdir)} || {{ echo "@@error cannot cd to" {q(ctx.workdir)}; exit 0; }}
mkdir -p {q(ctx.logdir)} || {{ echo "@@error cannot create" {q(ctx.logdir)}; exit 0; }}
log={q(log)}; ex={q(log[:-4] + ".exit")}; pidf={q(ctx.logdir)}/.launch.$$.pid
rm -f "$ex" "$pidf"
echo "[jaxsora.cluster] $(date '+%Y-%m-%d %H:%M:%S') process {i} of {n} on {host}:" {q(cmd)} >> "$log"
S=; command -v setsid >/dev/null 2>&1 && S=setsid
(
  trap '' HUP
  export {exports}
  $S {cmd} >> "$log" 2>&1 < /dev/null &
  echo "$! $(jx_start $!)" > "$pidf"  # before `wait`: until it is reaped, /proc/PID/stat is there
  wait $!
  rc=$?
  echo "[jaxsora.cluster] $(date '+%Y-%m-%d %H:%M:%S') exit code $rc" >> "$log"
  echo $rc > "$ex"
) > /dev/null 2>&1 < /dev/null &
i=0; while [ ! -s "$pidf" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
pid=$(cat "$pidf" 2>/dev/null); rm -f "$pidf"
[ -n "$pid" ] || {{ echo "@@error the command did not start"; exit 0; }}
echo "@@pid $pid"
"""


def precheck(ctx) -> None:
    """Refuse to start beside a live run of this logdir or GPU processes (an old job still running)."""
    rows = status.gather(ctx, records.targets(ctx, ctx.hosts))
    down = [f"{r['host']} ({r['error']})" for r in rows if r.get("error")]
    if down:
        raise UserError(f"cannot reach {', '.join(down)}")
    alive = [f"{r['host']} pid {r['pid']}" for r in rows if r.get("trainer") == "alive"]
    if alive:
        raise UserError(f"the run launched into {ctx.logdir} still runs ({', '.join(alive)}): `stop` it first, "
                        f"or give another --logdir")
    busy = [f"{r['host']} (pids {', '.join(map(str, r['gpu_pids']))})" for r in rows if r.get("gpu_pids")]
    if busy:
        raise UserError(f"GPU processes already run on {'; '.join(busy)}: an old job? `status` shows them; "
                        f"end them, or --force to launch anyway")


def launch(ctx, command: list[str], *, port: int = DEFAULT_PORT, coordinator: str | None = None,
           env: list[str] = (), force: bool = False, stop_grace: float = 10.0) -> int:
    from jaxsora.cluster import stop as stop_lib

    extra, command = split_env(list(command), list(env))
    coord = coordinator_address(ctx.hosts, coordinator, port)
    try:
        os.makedirs(ctx.logdir, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create --logdir {ctx.logdir}: {e}") from None
    if not force:
        precheck(ctx)
    n = len(ctx.hosts)
    results = remote.run_all(ctx.runner, ctx.hosts, lambda i, h: script(
        h, i, n, ctx, command, {**extra, **process_env(coord, n, i)}), ctx.timeout)
    entries, failed = [], []
    for i, r in enumerate(results):
        pid = r.field("pid").split()
        why = r.failure() or r.field("error") or (None if pid else f"no pid: {(r.out + r.err).strip()[-200:]}")
        if why:
            failed.append(f"{r.host}: {why}")
            continue
        entries.append(dict(host=r.host, process=i, pid=int(pid[0]), start=pid[1] if len(pid) > 1 else "",
                            log=os.path.join(ctx.logdir, log_name(r.host) + ".log")))
    record = dict(time=time.time(), workdir=ctx.workdir, logdir=ctx.logdir, run=ctx.run, coordinator=coord,
                  command=command, env=extra, hosts=entries)
    path = records.write_pids(ctx.logdir, record)
    print(format_table(("process", "host", "pid", "log"), [(e["process"], e["host"], e["pid"], e["log"])
                                                             for e in entries]))
    if failed:
        for f in failed:
            print(f"launch failed on {f}")
        if entries:
            print(f"stopping the {len(entries)} started process(es): they would wait for the missing ones")
            stop_lib.stop(ctx, grace=stop_grace)
        return 1
    print(f"{n} processes, coordinator {coord}; pids in {path}")
    return 0
