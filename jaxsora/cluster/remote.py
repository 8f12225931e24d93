"""Running a shell script on hosts: over ssh (a hostfile) or `srun --overlap` (a SLURM job).

Every remote script runs under `sh -c` (whatever the login shell), prints `@@key value` lines
that the caller parses, and never needs a terminal. Hosts are reached in parallel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

DEFAULT_SSH = "ssh -o BatchMode=yes"
# At most this many hosts are reached at once.
PARALLEL = 64


@dataclasses.dataclass
class Result:
    host: str
    rc: int  # 255: ssh could not reach the host; -1: timed out
    out: str
    err: str
    seconds: float

    def fields(self) -> dict[str, list[str]]:
        """`@@key value` lines → {key: [value, ...]}; the lines after `@@key` (alone on its line)
        up to the next `@@` line → {key: [line, ...]}."""
        found: dict[str, list[str]] = {}
        block = None
        for line in self.out.splitlines():
            if line.startswith("@@"):
                key, _, value = line[2:].partition(" ")
                if value:
                    found.setdefault(key, []).append(value)
                    block = None
                else:
                    block = found.setdefault(key, [])
            elif block is not None:
                block.append(line)
        return found

    def field(self, key: str, default: str = "") -> str:
        values = self.fields().get(key)
        return values[0] if values else default

    def failure(self) -> str | None:
        """Why the host did not answer, or None."""
        if self.rc == -1:
            return f"no answer in {self.seconds:.0f}s"
        if self.rc == 255 or (self.rc != 0 and "@@" not in self.out):
            last = (self.err.strip().splitlines() or [f"exit code {self.rc}"])[-1]
            return f"unreachable: {last}"
        return None


class Ssh:
    """`<ssh command> HOST "sh -c '<script>'"`."""

    def __init__(self, command: str = DEFAULT_SSH):
        self.base = shlex.split(command)
        if not self.base:
            from jaxsora.errors import BadInput

            raise BadInput("--ssh is empty")

    def argv(self, host: str, script: str) -> list[str]:
        return [*self.base, host, "sh -c " + shlex.quote(script)]


class Srun:
    """A step of a running SLURM job on one of its nodes, beside the job's own steps."""

    def __init__(self, job: str):
        self.job = job

    def argv(self, host: str, script: str) -> list[str]:
        return ["srun", "--jobid", self.job, "--overlap", "--nodes=1", "--ntasks=1", "--nodelist", host,
                "sh", "-c", script]


def run(runner, host: str, script: str, timeout: float, stdin: str | None = None) -> Result:
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(runner.argv(host, script), stdin=subprocess.PIPE if stdin is not None else
                             subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    except OSError as e:
        return Result(host, 255, "", f"cannot run {runner.argv(host, '')[0]}: {e}", 0.0)
    try:
        out, err = p.communicate(stdin, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        rc = -1
    return Result(host, rc, out, err, time.monotonic() - t0)


def _kill_group(p: subprocess.Popen) -> None:
    """The ssh/srun client this module started, and whatever it started locally (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def run_all(runner, hosts: Sequence[str], script_for: Callable[[int, str], str | None],
            timeout: float) -> list[Result]:
    """`script_for(index, host)` on every host at once (None: skip that host); results in host order."""
    jobs = [(i, h, script_for(i, h)) for i, h in enumerate(hosts)]
    with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL, len(jobs)))) as pool:
        futures = [pool.submit(run, runner, h, s, timeout) if s is not None else None for i, h, s in jobs]
        return [f.result() if f is not None else Result(h, 0, "", "", 0.0) for f, (_, h, _) in zip(futures, jobs)]


q = shlex.quote

# POSIX sh functions shared by the remote scripts.
# jx_state PID START → alive | gone | reused (the pid now belongs to another process) | zombie
# jx_pgrp PID → the process group of PID. Linux /proc; elsewhere `kill -0` (no reuse check).
SH_LIB = r"""
jx_stat() { jx_l=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; jx_l=${jx_l##*") "}; echo "$jx_l"; }
jx_start() { set -- $(jx_stat "$1") && echo "${20}"; }
jx_pgrp() { set -- $(jx_stat "$1") && echo "$3"; }
jx_state() {
  if [ ! -d /proc/self ]; then kill -0 "$1" 2>/dev/null && echo alive || echo gone; return; fi
  jx_s=$2
  set -- $(jx_stat "$1") || { echo gone; return; }
  [ $# -gt 0 ] || { echo gone; return; }
  [ "$1" = Z ] && { echo zombie; return; }
  [ -z "$jx_s" ] || [ "${20}" = "$jx_s" ] || { echo reused; return; }
  echo alive
}
"""


@dataclasses.dataclass
class Context:
    """What every command is given: the hosts, how to reach them and where the launch's records are."""
    hosts: list[str]
    runner: object
    logdir: str
    workdir: str
    run: str | None = None  # the run folder (<outputs>/<NNN>-<experiment>, or --run-dir): heartbeats and stacks
    slurm: str | None = None  # the SLURM job id, when the hosts are its nodes
    timeout: float = 30.0


def parse_date(text: str) -> float | None:
    """`date +%s.%N` output → seconds (a `date` without %N prints `1700000000.N`)."""
    try:
        return float(text.strip().removesuffix(".N"))
    except ValueError:
        return None
