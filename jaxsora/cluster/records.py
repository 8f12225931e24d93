"""What a launch leaves behind (`<logdir>/pids.json`) and which process is the trainer on each host.

pids.json = {"time", "workdir", "logdir", "run", "coordinator", "command",
             "hosts": [{"host", "process", "pid", "start", "log"}, ...]}
`start` is the process's start time (/proc/PID/stat, clock ticks since boot): `stop` and `dump`
signal a pid only while it still belongs to that process.
"""
from __future__ import annotations

import dataclasses
import json
import os

from jaxsora.cluster import remote
from jaxsora.errors import BadInput

PIDS = "pids.json"


@dataclasses.dataclass
class Target:
    host: str
    process: int | None = None
    pid: int | None = None
    start: str = ""
    source: str = ""  # where the pid came from (pids.json, heartbeat)


def write_pids(logdir: str, record: dict) -> str:
    path = os.path.join(logdir, PIDS)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
    return path


def read_pids(logdir: str) -> dict | None:
    path = os.path.join(logdir, PIDS)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read {path}: {e}") from None


def parse_heartbeats(lines: list[str]) -> dict[int, dict]:
    """Heartbeat JSON lines (`jaxsora.train.run.supervise.write_heartbeat`) → {process: newest}."""
    beats: dict[int, dict] = {}
    for line in lines:
        try:
            hb = json.loads(line)
            p = int(hb["process"])
        except (ValueError, KeyError, TypeError):
            continue
        if p not in beats or hb.get("time", 0) > beats[p].get("time", 0):
            beats[p] = hb
    return beats


def heartbeat_sh(run: str | None) -> str:
    """Prints `@@heartbeats` and the run's heartbeat files, one JSON per line."""
    if not run:
        return ""
    return (f'echo "@@heartbeats"; for f in {remote.q(run)}/heartbeat/*.json; do [ -f "$f" ] && '
            f'{{ cat "$f"; echo; }}; done\n')


def short(name: str) -> str:
    return name.split(".", 1)[0]


def match_heartbeat(beats: dict[int, dict], target: Target, hostname: str) -> dict | None:
    """The heartbeat of a host's trainer: by process index when known, else by host name."""
    if target.process is not None:
        return beats.get(target.process)
    mine = [hb for hb in beats.values() if hostname and short(str(hb.get("host", ""))) == short(hostname)]
    return min(mine, key=lambda hb: hb.get("step", 0)) if mine else None


def targets(ctx, hosts: list[str]) -> dict[str, Target]:
    """The trainer of every host: from pids.json (hostfile launches), else — a SLURM job, or a run
    started by hand — from the heartbeats of `ctx.run` (pid and host written by the trainer)."""
    found = {h: Target(h) for h in hosts}
    record = None if ctx.slurm else read_pids(ctx.logdir)
    if record:
        for i, entry in enumerate(record.get("hosts", [])):
            if entry.get("host") in found and entry.get("pid"):
                found[entry["host"]] = Target(entry["host"], int(entry.get("process", i)), int(entry["pid"]),
                                              str(entry.get("start") or ""), "pids.json")
        return found
    if not ctx.run:
        return found
    script = 'echo "@@hostname $(hostname)"\n' + heartbeat_sh(ctx.run)
    results = remote.run_all(ctx.runner, hosts, lambda i, h: script, ctx.timeout)
    beats = parse_heartbeats([ln for r in results for ln in r.fields().get("heartbeats", [])])
    for r in results:
        hb = match_heartbeat(beats, Target(r.host), r.field("hostname"))
        if hb and hb.get("pid"):
            found[r.host] = Target(r.host, int(hb["process"]), int(hb["pid"]), str(hb.get("pid_start") or ""),
                                   "heartbeat")
    return found
