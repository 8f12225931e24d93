"""Supervision of a running job: stalls, stop requests (signals, preemption on any host) and the
one-owner lock of a run folder.

- `Watchdog`: times each phase of the loop — waiting for the loader's next batch ("data") and
  dispatching/finishing a step ("step") — and when one runs far past its usual time, prints which
  phase is stuck and every thread's stack (faulthandler), then asks the loader's worker processes
  for theirs (SIGUSR1, only to children that installed a handler for it). Never kills the run; in a
  multi-process run whose peer is suspect it first waits for the peer watch's verdict
  (`jaxsora.parallel.peers.settle`), which ends the run in one line when that peer is lost.
- `StopRequested`: SIGTERM/SIGINT → finish the current step, checkpoint, exit cleanly. With many
  processes, SIGTERM is left to JAX's preemption service: a notice on any host makes every host
  reach the same sync step (`multihost_utils.reached_preemption_sync_point`), where all of them
  save and exit together.
- `RunLock`: `<run>/run.lock` holds host, pid and start time of the run that owns the folder; a
  second run refuses to start there, naming the first; a lock left by a dead process on this host
  is taken over with a warning.
- `write_heartbeat`: `<run>/heartbeat/<process>.json` (step, time, pid, host), written atomically
  each log step; `register_stack_dump`: SIGUSR2 appends every thread's stack to
  `<run>/stacks/<process>.txt`. Both are read by `python -m jaxsora.cluster status` / `dump`.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time

import numpy as np

from jaxsora.errors import UserError

# Durations kept per phase for the median.
_HISTORY = 50
# Samples of a phase before its median is trusted; before that only `min_seconds` applies.
_WARMUP_SAMPLES = 3


def _children_with_usr1_handler() -> list[int]:
    """Child processes of this one that catch SIGUSR1 (Linux /proc; [] elsewhere). SIGUSR1's default
    action terminates, so only processes whose SigCgt mask has it are signalled."""
    me, out = os.getpid(), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    bit = 1 << (signal.SIGUSR1 - 1)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        except (OSError, ValueError):
            continue
        if int(fields.get("PPid", "0")) == me and int(fields.get("SigCgt", "0"), 16) & bit:
            out.append(pid)
    return out


class Watchdog:
    """Reports a stuck loader or step (the reference's silent PyAV freezes and NCCL hangs).

    A phase is stuck when it runs longer than max(min_seconds, factor × its median); before a phase
    has `_WARMUP_SAMPLES` durations, after min_seconds. Phases: "data" (waiting for the next
    batch), "step" (dispatching it and waiting for the step `MAX_IN_FLIGHT` back). `None` (between
    phases, e.g. saving or compiling a new shape) is never timed.
    """

    def __init__(self, factor: float, min_seconds: float, *, poll: float = 1.0, stream=None):
        self.factor, self.min_seconds, self.poll = factor, min_seconds, poll
        self.stream = stream
        self.times: dict[str, list[float]] = {}
        self._phase: str | None = None
        self._start = 0.0
        self._deadline: float | None = None
        self._stop = threading.Event()
        self.dumps: list[str] = []  # the phases reported
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxsora-watchdog")
        self._thread.start()

    def limit(self, phase: str) -> float:
        hist = self.times.get(phase, [])
        if len(hist) < _WARMUP_SAMPLES:
            return self.min_seconds
        return max(self.min_seconds, self.factor * float(np.median(hist[-_HISTORY:])))

    def phase(self, name: str | None) -> None:
        """End the current phase (recording its duration) and start `name` (None: untimed)."""
        now = time.monotonic()
        if self._phase is not None:
            self.times.setdefault(self._phase, []).append(now - self._start)
            del self.times[self._phase][:-_HISTORY]
        self._deadline = None
        self._phase, self._start = name, now
        if name is not None:
            self._deadline = now + self.limit(name)

    def _run(self):
        while not self._stop.wait(self.poll):
            deadline, phase = self._deadline, self._phase
            if deadline is None or phase is None or time.monotonic() <= deadline:
                continue
            self._deadline = None  # once per stall
            self._report(phase)

    def _report(self, phase: str) -> None:
        from jaxsora.parallel import peers

        # A collective that waits for a dead peer is the peer watch's to report (one line, exit 76): when a
        # peer is suspect, its verdict comes first (and ends the process).
        peers.settle()
        out = self.stream or sys.stderr
        hist = self.times.get(phase, [])
        usual = f"median {np.median(hist[-_HISTORY:]):.2f}s" if hist else "no earlier sample"
        what = ("waiting for the loader's next batch" if phase == "data" else
                "in the train step (device work or a collective)" if phase == "step" else phase)
        self.dumps.append(phase)
        print(f"[watchdog] stalled {what} for {time.monotonic() - self._start:.0f}s ({usual}); "
              f"stacks of every thread follow", file=out, flush=True)
        try:
            faulthandler.dump_traceback(file=out, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor
            import traceback

            for tid, frame in sys._current_frames().items():
                print(f"Thread {tid}:", file=out)
                traceback.print_stack(frame, file=out)
        if phase == "data":
            workers = _children_with_usr1_handler()
            for pid in workers:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
            if workers:
                print(f"[watchdog] asked loader workers {workers} for their stacks (on their stderr)", file=out,
                      flush=True)

    def stop(self):
        self._stop.set()


class StopRequested:
    """SIGTERM/SIGINT → finish the current step, checkpoint, exit cleanly.

    multi_process: SIGTERM stays with JAX's preemption service (installed by
    `jax.distributed.initialize`), which propagates a notice on any host to all; call `should_stop`
    every step with the same step number on every host."""

    def __init__(self, multi_process: bool = False):
        self.flag = False
        self.preempted = False
        self.multi_process = multi_process
        self._old = {}
        sigs = (signal.SIGINT,) if multi_process else (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.flag:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.flag = True
        print(f"\n[jaxsora] got signal {signum}: saving a checkpoint after this step, then exiting",
              file=sys.stderr, flush=True)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step` (the local flag, or every host's preemption sync point)."""
        if self.multi_process and not self.flag:
            from jax.experimental import multihost_utils

            try:
                reached = multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
                reached = False
            if reached:
                self.flag = self.preempted = True
                print(f"[jaxsora] preemption notice on a host: every host saves step {step} and exits",
                      file=sys.stderr, flush=True)
        return self.flag

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


class RunLockedError(UserError):
    pass


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs on this host. A zombie does not: a trainer killed with its parent (a lost host's
    trainer, `jaxsora.train.run.agent`) stays one until init reaps it, and holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux), or gone meanwhile
        return True


class RunLock:
    """One owner per run folder: `<run>/run.lock` = {"host", "pid", "start", "argv"}.

    Taken with O_CREAT|O_EXCL, so two runs starting together cannot both win. A lock whose process
    is dead on this host is stale and taken over (with a warning); a live one, or one from another
    host (which cannot be checked from here), is a refusal naming it."""

    NAME = "run.lock"

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, self.NAME)
        self.held = False

    def _describe(self, info: dict) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("start", 0)))
        return f"pid {info.get('pid')} on host {info.get('host')}, started {started}"

    def acquire(self) -> RunLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = dict(host=socket.gethostname(), pid=os.getpid(), start=time.time(), argv=sys.argv)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    with open(self.path) as f:
                        info = json.load(f)
                except (OSError, ValueError):
                    info = {}
                if not info and os.path.exists(self.path) and time.time() - os.path.getmtime(self.path) < 10:
                    time.sleep(0.5)  # another run is writing it right now
                    continue
                if info and (info.get("host") != me["host"] or _pid_alive(int(info.get("pid", -1)))):
                    raise RunLockedError(
                        f"{os.path.dirname(self.path)} is in use by another run ({self._describe(info)}); "
                        f"give this run another folder (--run-dir, or no --run-dir for a new numbered one), or "
                        f"stop that one (if it is gone, delete {self.path})") from None
                who = self._describe(info) if info else "unreadable"
                print(f"[jaxsora] taking over the stale lock of a dead run ({who})", file=sys.stderr, flush=True)
                stale = f"{self.path}.stale.{os.getpid()}"
                try:
                    os.replace(self.path, stale)
                    os.remove(stale)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunLockedError(f"could not take the lock {self.path}; is another run starting in this folder?")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            with open(self.path) as f:
                mine = json.load(f).get("pid") == os.getpid()
        except (OSError, ValueError):
            mine = False
        if mine:
            os.remove(self.path)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# --- Heartbeat and on-demand stack dumps (read by `python -m jaxsora.cluster status` / `dump`) ---

HEARTBEAT_DIR = "heartbeat"
STACKS_DIR = "stacks"
# The signal that makes a trainer write every thread's stack (`register_stack_dump`). SIGUSR1 is
# taken (loader workers answer the watchdog with it); SIGUSR2's default action terminates, so
# `jaxsora.cluster dump` only sends it to a process whose SigCgt mask shows a handler for it.
STACK_DUMP_SIGNAL = signal.SIGUSR2
_heartbeat_warned = False
_stack_file = None  # kept open: faulthandler writes to its descriptor when the signal arrives


def _proc_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22; None off Linux):
    with the pid, it tells a process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_heartbeat(run_dir: str, process_index: int, step: int | None, **extra) -> str | None:
    """Write `<run_dir>/heartbeat/<process_index>.json` = {"step", "time", "pid", "host", "process",
    "pid_start", **extra} atomically (a temporary file, then `os.replace`), so a reader never sees
    half a file. Cheap (one small file); call it every log step (step None: not known yet, e.g. at
    start-up). A failure to write (a full or flaky filesystem) is said once on stderr and never
    stops training. `python -m jaxsora.cluster status` shows step and age; under SLURM its pid and
    host are how `cluster stop/dump` find the trainers. Returns the path, or None."""
    global _heartbeat_warned
    folder = os.path.join(run_dir, HEARTBEAT_DIR)
    path = os.path.join(folder, f"{int(process_index)}.json")
    info = dict(step=None if step is None else int(step), time=time.time(), pid=os.getpid(),
                host=socket.gethostname(), process=int(process_index), pid_start=_proc_start(os.getpid()), **extra)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except OSError as e:
        if not _heartbeat_warned:
            _heartbeat_warned = True
            print(f"[jaxsora] cannot write the heartbeat {path}: {e} (training goes on; said once)",
                  file=sys.stderr, flush=True)
        return None
    return path


def register_stack_dump(path_or_dir: str, process_index: int = 0) -> str:
    """On `STACK_DUMP_SIGNAL` (SIGUSR2), append every Python thread's stack to a file, without
    stopping the process (`faulthandler.register(..., all_threads=True)`).

    `path_or_dir`: a run folder → `<run>/stacks/<process_index>.txt`; a path ending in `.txt` →
    that file. Call once at start-up, as soon as the run folder is known and before anything
    can hang (compilation, the loader, the first collectives). `python -m jaxsora.cluster dump`
    (or `kill -USR2 PID`) then asks for the stacks. Calling it again moves the dump to the new
    file. Returns the file's path."""
    global _stack_file
    if path_or_dir.endswith(".txt"):
        path = path_or_dir
    else:
        path = os.path.join(path_or_dir, STACKS_DIR, f"{int(process_index)}.txt")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path, "a", buffering=1)  # noqa: SIM115 (kept open: faulthandler writes to it on the signal)
    f.write(f"# jaxsora stacks of process {process_index}, pid {os.getpid()} on {socket.gethostname()}; "
            f"every `kill -{STACK_DUMP_SIGNAL.name[3:]} {os.getpid()}` appends all threads' stacks\n")
    faulthandler.register(STACK_DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    old, _stack_file = _stack_file, f
    if old is not None:
        old.close()
    return path
