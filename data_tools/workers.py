"""Worker processes with a time limit per task, for the data tools that read every file (`meta`, `check`).

`Workers(target, n)` starts `n` processes that each run `target` (a `"module:function"` name) on one
task at a time. `run(tasks)` hands out `(key, args, seconds)` tasks and yields `(key, result)` in the
order they finish. A task's seconds count from when a worker that has imported its target receives
it; a task that has not returned by then is cut off: its worker is killed with SIGKILL and replaced,
and the task's result is a `Stalled`. A worker that dies during a task (a
segfault in the decoder) gives a `Crashed`. Nothing else stops the run.

Why processes and SIGKILL: a read that blocks on a hung network filesystem, or a decoder that never
returns, holds its thread in C code; no Python timeout or thread can end it, only the kernel can,
by killing the process. A worker blocked in the kernel (an NFS read in state D) may not even die
then: it is abandoned, never waited for, and its task still counts as stalled. Workers die with the
process that started them (Linux `PR_SET_PDEATHSIG`), so an interrupted run leaves none behind.

Workers are fresh interpreters (`python -c`, not fork: the parent may have imported multithreaded
libraries), talking over a pipe each with `multiprocessing.connection`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection, wait

_SERVE = "import sys; from data_tools.workers import serve; serve(*sys.argv[1:])"
# the folder that holds the `data_tools` package: the workers import it from there
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Stalled:
    seconds: float

    def __str__(self):
        return f"stalled: no result within {self.seconds:g} s (worker killed)"


@dataclasses.dataclass(frozen=True)
class Crashed:
    exit_code: int | None

    def __str__(self):
        code = self.exit_code
        how = f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        return f"crashed: the worker process died ({how})"


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity: a SLURM job's or a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Worker:
    def __init__(self, target: str):
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)}
        self.proc = subprocess.Popen(  # noqa: S603 (our own interpreter and module)
            [sys.executable, "-c", _SERVE, target, str(child_r), str(child_w), str(os.getpid())],
            pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        os.close(child_r)
        os.close(child_w)
        self.recv = Connection(parent_r, writable=False)
        self.send = Connection(parent_w, readable=False)
        self.task = None  # (key, deadline, seconds) while busy

    def kill(self) -> None:
        """SIGKILL, and do not wait: a process stuck in the kernel may never be reaped."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for c in (self.recv, self.send):
            c.close()
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.proc.returncode = -signal.SIGKILL  # abandoned; Popen would warn when it is collected


class Workers:
    """`n` worker processes running `target` ("module:function"); see the module docstring."""

    STARTUP_SECONDS = 300.0  # a worker that has not imported its target by then (an NFS home hanging) fails the run

    def __init__(self, target: str, n: int):
        if n < 1:
            raise ValueError(f"need at least one worker, got {n}")
        self.target = target
        self._starting = [self._start() for _ in range(n)]
        self._idle: list[_Worker] = []
        self._busy: list[_Worker] = []

    def _start(self) -> _Worker:
        w = _Worker(self.target)
        w.task = (None, time.monotonic() + self.STARTUP_SECONDS, self.STARTUP_SECONDS)
        return w

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        for w in self._idle:  # an idle worker ends when its pipe closes
            w.send.close()
            w.recv.close()
        for w in self._busy + self._starting:
            w.kill()
        for w in self._idle:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()
        self._idle, self._busy, self._starting = [], [], []

    def run(self, tasks: Iterable[tuple]) -> Iterator[tuple]:
        """`(key, args, seconds)` tasks → `(key, result)` as they finish (a `Stalled` or `Crashed` result
        for a task that did not return). Tasks are drawn from the iterable only as workers free up; a
        task's seconds start when a worker that is ready (its target imported) receives it."""
        tasks = iter(tasks)
        more = True
        while True:
            while more and self._idle:
                task = next(tasks, None)
                if task is None:
                    more = False
                    break
                key, args, seconds = task
                w = self._idle.pop()
                w.send.send(args)
                w.task = (key, time.monotonic() + seconds, seconds)
                self._busy.append(w)
            if not self._busy and not (more and self._starting):
                return
            yield from self._collect()

    def _collect(self) -> Iterator[tuple]:
        waiting = self._busy + self._starting
        timeout = max(0.0, min(w.task[1] for w in waiting) - time.monotonic())
        ready = set(wait([w.recv for w in waiting], timeout=timeout))
        now = time.monotonic()
        for w in list(self._starting):
            if w.recv in ready:
                try:
                    w.recv.recv()  # its first message: the target is imported
                except (EOFError, OSError):
                    raise RuntimeError(f"a worker process could not start {self.target} (exit code "
                                       f"{w.proc.wait()}; its error is above)") from None
                self._starting.remove(w)
                self._idle.append(w)
            elif now >= w.task[1]:
                raise RuntimeError(f"a worker process did not start {self.target} within {self.STARTUP_SECONDS:g} s")
        for w in list(self._busy):
            key, deadline, seconds = w.task
            if w.recv in ready or (now >= deadline and w.recv.poll()):
                try:
                    result = w.recv.recv()
                except (EOFError, OSError):  # the worker died during the task
                    code = w.proc.poll()
                    if code is None:
                        try:
                            code = w.proc.wait(timeout=1)
                        except subprocess.TimeoutExpired:
                            code = None
                    self._replace(w)
                    yield key, Crashed(code)
                    continue
                self._busy.remove(w)
                self._idle.append(w)
                yield key, result
            elif now >= deadline:
                self._replace(w)
                yield key, Stalled(seconds)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._busy.remove(w)
        self._starting.append(self._start())


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the one that started it ends (prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before prctl took effect
        os._exit(1)


def serve(target: str, read_fd: str, write_fd: str, parent: str) -> None:
    """A worker's loop: receive args, call the target, send the result, until the pipe closes."""
    _die_with_parent(int(parent))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import importlib

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    recv, send = Connection(int(read_fd), writable=False), Connection(int(write_fd), readable=False)
    send.send(None)  # ready: tasks' time limits start from here
    while True:
        try:
            args = recv.recv()
        except (EOFError, OSError):
            return
        send.send(fn(*args))
