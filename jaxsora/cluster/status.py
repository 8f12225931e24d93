"""`status`: every host's GPUs (nvidia-smi), its trainer (alive? exit code) and the run's progress
(step and heartbeat age from `<run>/heartbeat/<process>.json`); a lost process — which one, on which host,
when, and the checkpoint to resume from — from the survivors' heartbeats (phase "lost-peer")."""
from __future__ import annotations

import json
import os
import time

from jaxsora.cluster import records, remote
from jaxsora.cluster.hosts import log_name
from jaxsora.cluster.table import format_table
from jaxsora.errors import TRAIN_EXIT_MEANINGS

GPU_FIELDS = ("index", "name", "memory.used", "memory.total", "power.draw", "clocks.sm", "clocks.max.sm",
              "ecc.errors.uncorrected.volatile.total", "temperature.gpu", "utilization.gpu")
_KEYS = ("index", "name", "mem_used", "mem_total", "power", "sm_clock", "sm_clock_max", "ecc", "temp", "util")
Q = "--format=csv,noheader,nounits"


def script(target: records.Target, ctx) -> str:
    s = [remote.SH_LIB, 'echo "@@hostname $(hostname)"', 'echo "@@now $(date +%s.%N)"',
         "if command -v nvidia-smi >/dev/null 2>&1; then",
         f'  echo "@@gpus"; nvidia-smi --query-gpu={",".join(GPU_FIELDS)} {Q} 2>&1',
         f'  echo "@@apps"; nvidia-smi --query-compute-apps=pid,used_memory {Q} 2>&1',
         'else echo "@@nvidia_smi missing"; fi']
    if target.pid:
        s.append(f'echo "@@trainer $(jx_state {target.pid} {remote.q(target.start)})"')
        if target.source == "pids.json":
            exit_file = remote.q(os.path.join(ctx.logdir, log_name(target.host) + ".exit"))
            s.append(f'[ -s {exit_file} ] && echo "@@exit $(cat {exit_file})"')
    s.append(records.heartbeat_sh(ctx.run))
    return "\n".join(s) + "\ntrue\n"


def _num(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # [N/A], [Not Supported]
        return None


def parse_gpus(lines: list[str]) -> tuple[list[dict], str | None]:
    """nvidia-smi --query-gpu CSV lines → ([{index, name, mem_used, ...}], error text or None)."""
    gpus, junk = [], []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(_KEYS) or _num(cells[0]) is None:
            if line.strip():
                junk.append(line.strip())
            continue
        gpu = dict(zip(_KEYS, cells))
        for k in _KEYS[2:]:
            gpu[k] = _num(gpu[k])
        gpu["index"] = int(float(cells[0]))
        gpus.append(gpu)
    return gpus, (junk[0] if junk and not gpus else None)


def parse_apps(lines: list[str]) -> list[int]:
    """nvidia-smi --query-compute-apps=pid,used_memory lines → the pids (one per process)."""
    pids = []
    for line in lines:
        first = line.split(",")[0].strip()
        if first.isdigit() and int(first) not in pids:
            pids.append(int(first))
    return pids


def host_row(result: remote.Result, target: records.Target, beats: dict[int, dict]) -> dict:
    row = dict(host=result.host, error=result.failure(), pid=target.pid, process=target.process)
    if row["error"]:
        return row
    f = result.fields()
    row["hostname"] = result.field("hostname")
    if "nvidia_smi" in f:
        row["nvidia_smi"] = "missing"
    else:
        row["gpus"], row["nvidia_smi_error"] = parse_gpus(f.get("gpus", []))
        row["gpu_pids"] = parse_apps(f.get("apps", []))
    row["trainer"] = result.field("trainer") or None
    row["exit_code"] = result.field("exit") or None
    hb = records.match_heartbeat(beats, target, row["hostname"])
    if hb:
        now = remote.parse_date(result.field("now"))
        row["step"] = hb.get("step")
        row["phase"] = hb.get("phase")  # before the first step: starting, compiling, restoring, initializing
        if hb.get("phase") == "lost-peer":  # this trainer stopped because another process was lost
            row.update(lost=hb.get("lost"), lost_at=hb.get("time"), newest_checkpoint=hb.get("newest_checkpoint"))
        row["heartbeat_age"] = (now - float(hb["time"])) if now is not None and "time" in hb else None
        if target.pid is None:
            row["pid"] = hb.get("pid")
    return row


def gather(ctx, targets: dict[str, records.Target]) -> list[dict]:
    results = remote.run_all(ctx.runner, ctx.hosts, lambda i, h: script(targets[h], ctx), ctx.timeout)
    beats = records.parse_heartbeats([ln for r in results for ln in r.fields().get("heartbeats", [])])
    rows = [host_row(r, targets[r.host], beats) for r in results]
    hosts = {t.process: h for h, t in targets.items() if t.process is not None}
    for row in rows:  # the lost processes' hosts: the launch's record, else their last heartbeat
        if row.get("lost") is not None:
            row["lost_hosts"] = {str(i): hosts.get(i) or (beats.get(i) or {}).get("host") for i in row["lost"]}
    return rows


def _fmt(v, spec=".0f", unit=""):
    return "-" if v is None else f"{v:{spec}}{unit}"


def _cells(row: dict) -> list:
    if row.get("error"):
        return [row["host"], row["error"]] + [None] * 9
    trainer = None
    if row.get("trainer"):
        trainer = f"{row['pid']} {row['trainer']}"
        if row["trainer"] != "alive" and row.get("exit_code") is not None:
            trainer = f"{row['pid']} exited {row['exit_code']}"
            meaning = TRAIN_EXIT_MEANINGS.get(int(row["exit_code"])) if str(row["exit_code"]).isdigit() else None
            trainer += f" ({meaning})" if meaning else ""
    step = row.get("step") if row.get("step") is not None else row.get("phase")
    age = _fmt(row.get("heartbeat_age"), ".0f", "s") if step is not None else None
    if row.get("nvidia_smi") == "missing":
        return [row["host"], "no nvidia-smi", None, None, None, None, None, None, trainer, step, age]
    gpus = row.get("gpus") or []
    if not gpus:
        return [row["host"], (row.get("nvidia_smi_error") or "0")[:48], None, None, None, None, None, None, trainer,
                step, age]

    def vals(k):
        return [g[k] for g in gpus if g[k] is not None]

    used, total, power, clock, ecc = vals("mem_used"), vals("mem_total"), vals("power"), vals("sm_clock"), vals("ecc")
    mem = f"{sum(used) / 1024:.0f}/{sum(total) / 1024:.0f}" if used and total else None
    clocks = None if not clock else (f"{min(clock):.0f}" if min(clock) == max(clock)
                                     else f"{min(clock):.0f}-{max(clock):.0f}")
    util = vals("util")
    return [row["host"], len(gpus), len(row.get("gpu_pids", [])), _fmt(sum(util) / len(util) if util else None,
            ".0f", "%"), mem, _fmt(sum(power) / len(power) if power else None), clocks,
            _fmt(sum(ecc) if ecc else None, ".0f"), trainer, step, age]


HEADER = ("host", "gpus", "gpu procs", "util", "mem GiB", "W/gpu", "SM MHz", "ECC", "trainer", "step", "heartbeat")


def warnings(rows: list[dict], stale: float) -> list[str]:
    out = []
    for r in rows:
        if r.get("error"):
            continue
        ecc = sum(g["ecc"] or 0 for g in r.get("gpus") or [])
        if ecc:
            out.append(f"{r['host']}: {ecc:.0f} uncorrected ECC errors since the driver loaded: a bad GPU, "
                       f"leave the host out")
        others = [p for p in r.get("gpu_pids", []) if p != r.get("pid")]
        if others and r.get("trainer") != "alive":
            out.append(f"{r['host']}: GPU processes {others} that are not this launch's trainer: an old job?")
        if r.get("trainer") in ("gone", "zombie") and any(o.get("trainer") == "alive" for o in rows):
            out.append(f"{r['host']}: the trainer exited (code {r.get('exit_code') or '?'}) while others run: "
                       f"they will wait in a collective; stop the run and --load it")
        if r.get("heartbeat_age") is not None and r["heartbeat_age"] > stale and r.get("trainer") != "gone":
            at = f"step {r['step']}" if r.get("step") is not None else r.get("phase") or "no step yet"
            out.append(f"{r['host']}: no heartbeat for {r['heartbeat_age']:.0f}s ({at}): "
                       f"hung? `dump` shows its stacks")
    said = set()
    for r in rows:  # one line per loss, whichever survivors reported it
        if r.get("lost") is None:
            continue
        lost = tuple(r["lost"])
        if lost in said:
            continue
        said.add(lost)
        seen = [x["host"] for x in rows if x.get("lost") is not None and tuple(x["lost"]) == lost]
        who = ", ".join(f"process {i} (host {r.get('lost_hosts', {}).get(str(i)) or '?'})" for i in lost) or "a peer"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["lost_at"])) if r.get("lost_at") else "?"
        at = f"step {r['step']}" if r.get("step") is not None else "before the first step"
        resume = (f"--load resumes from step {r['newest_checkpoint']}" if r.get("newest_checkpoint") is not None
                  else "no checkpoint yet: start the run again")
        out.append(f"lost {who} at {when} ({at}); {', '.join(seen)} stopped (exit code 76); {resume}")
    steps = [r["step"] for r in rows if r.get("step") is not None]
    if steps and max(steps) != min(steps):
        out.append(f"steps differ between hosts ({min(steps)}..{max(steps)}): heartbeats are written each log "
                   f"step, so a host one log interval behind is normal, more is not")
    return out


def status(ctx, *, as_json: bool = False, stale: float = 900.0) -> int:
    targets = records.targets(ctx, ctx.hosts)
    rows = gather(ctx, targets)
    if as_json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(format_table(HEADER, [_cells(r) for r in rows]))
        if not ctx.run:
            print("(no run folder: give --run <run folder> for step and heartbeat)")
        for w in warnings(rows, stale):
            print("warning: " + w)
    return 1 if any(r.get("error") for r in rows) else 0
