"""The trainer's per-host parent (multi-process runs): a small process that owns the trainer, as torchrun's
agent does, so that however the trainer ends, its end is said in one line with the exit code the SLURM
script acts on.

Why a parent: when process 0, which hosts jax's coordination service, dies, jaxlib's client terminates
every other process from C++ at once (`F... client.h:80] Terminating process because the JAX distributed
service detected fatal errors`, a stack trace, SIGABRT: exit 134) — no Python code of the trainer runs
(jaxlib 0.10's `missed_heartbeat_callback` fails with std::bad_cast before calling Python; measured, see
`jaxsora.parallel.peers`). The same abort ends a process whose jax shutdown barrier waits for a dead peer.
Only another process can speak after it.

How: `start()` forks before jax.distributed connects (jax imported, no backend, no threads). The child is
the trainer; the parent:
- gives the child its own process group and forwards SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2
  to it (so each reaches it once: a terminal's Ctrl-C, `jaxsora.cluster stop`, the test launcher); the
  child is killed with the parent (PR_SET_PDEATHSIG): a lost host takes both;
- reads the child's stderr through a pipe and copies it to its own `HOLD` seconds late; once jaxlib's
  termination text (or what its other threads print when the service is gone) appears, it holds
  everything back;
- when the child ends: with an exit code, copies the rest and exits with the same code (0, 75 stopped,
  76 a lost peer the trainer reported itself, ...); terminated after jaxlib's termination text (a lost
  peer): prints the trainer's one line — the lost process named from jaxlib's status (process 0 when the
  coordination service is gone, the tasks it reports unhealthy, else "a peer"), the step and the newest
  intact checkpoint (the trainer keeps them on a page shared with the parent: `note_run`, `note_step`) —
  writes the heartbeat's phase "lost-peer", keeps the text it held back in `<run>/lost-peer/<process>.txt`,
  and exits with EXIT_PEER_LOST; terminated otherwise (a crash, the OOM killer): copies everything and exits
  with 128 + the signal, a shell's convention (137: SIGKILL).

`JAXSORA_AGENT=0` runs the trainer without a parent (then losing process 0 ends the others with jaxlib's
abort, as before). Only `jaxsora.train` asks for a parent (`jaxsora.parallel.distributed.initialize`'s
`before_connect`).
"""
from __future__ import annotations

import collections
import contextlib
import mmap
import os
import re
import select
import signal
import struct
import sys
import time

from jaxsora.errors import EXIT_NONFINITE, EXIT_PEER_LOST, EXIT_STOPPED, EXIT_USER_ERROR

ENV = "JAXSORA_AGENT"
HOLD = 1.0  # seconds the child's stderr is held back: jaxlib prints its termination text within ms of the abort
RATTLE_WAIT = 30.0  # after jaxlib's termination text, how long the child may take to end before the text is let out
LOST_DIR = "lost-peer"  # <run>/lost-peer/<process>.txt: what the parent held back
_FORWARD = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
# The exit codes a trainer gives on its own: never a lost peer's abort.
_OWN_CODES = (0, EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_STOPPED, EXIT_PEER_LOST)
# What jaxlib's coordination client prints when it terminates the process (client.h, coordination_service_agent.cc).
RATTLE = re.compile(rb"JAX distributed service detected fatal errors|Polled an error from coordination service")
# What precedes it when the service is gone (other threads of jaxlib's client): from then on nothing is let out
# until the child ends, or lives on for RATTLE_WAIT seconds.
FREEZE = re.compile(RATTLE.pattern + rb"|from coordination service: UNAVAILABLE|Failed to send RPC to coordination")
# The shared page: step (-1: none yet), process id, process count, run folder's length, the run folder (utf-8).
_HEAD = struct.Struct("<qqqI")
_PAGE = 4096
_board: mmap.mmap | None = None


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off") and hasattr(os, "fork")


def active() -> bool:
    """Whether this process is a trainer with a parent."""
    return _board is not None


def note_run(run_dir: str) -> None:
    """The trainer's run folder, for the parent's line (a no-op without a parent)."""
    if _board is None:
        return
    raw = os.path.abspath(run_dir).encode()[:_PAGE - _HEAD.size]
    _board[_HEAD.size:_HEAD.size + len(raw)] = raw
    step, me, n, _ = _HEAD.unpack_from(_board, 0)
    _HEAD.pack_into(_board, 0, step, me, n, len(raw))


def note_step(step: int | None) -> None:
    """The newest step dispatched (a no-op without a parent; one 8-byte write)."""
    if _board is not None:
        struct.pack_into("<q", _board, 0, -1 if step is None else int(step))


def read_board(board) -> tuple[int | None, int, int, str | None]:
    """(step, process id, process count, run folder) from a shared page."""
    step, me, n, length = _HEAD.unpack_from(board, 0)
    run = bytes(board[_HEAD.size:_HEAD.size + length]).decode(errors="replace") if length else None
    return (None if step < 0 else step), me, n, run


def start(process_id: int, num_processes: int) -> None:
    """Become the parent of this host's trainer: fork; the parent supervises the child and exits with its
    (translated) exit code, never returning; the child returns and goes on as the trainer. Once per process."""
    global _board
    if _board is not None or not enabled():
        return
    board = mmap.mmap(-1, _PAGE)  # MAP_SHARED | MAP_ANONYMOUS: the same page in the child
    _HEAD.pack_into(board, 0, -1, int(process_id), int(num_processes), 0)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        _become_trainer(parent, w)
        _board = board
        return
    os.close(w)
    os._exit(supervise(child, r, board))


def _become_trainer(parent: int, w: int) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(128 + signal.SIGKILL)
    os.dup2(w, 2)
    os.close(w)


def _forwarder(child: int):
    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)
    return forward


def _read_all(fd: int) -> tuple[bytes, bool]:
    """(what the pipe holds now, whether it reached its end)."""
    out = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(out), False
        if not data:
            return b"".join(out), True
        out.append(data)


_line_open = False  # what was copied last ends inside a line (a progress bar's)


def _write(data: bytes) -> None:
    global _line_open
    if data:
        _line_open = not data.endswith(b"\n")
    view = memoryview(data)
    while view:
        try:
            n = os.write(2, view)
        except InterruptedError:
            continue
        except OSError:
            return  # our stderr is gone: nothing to tell
        view = view[n:]


def supervise(child: int, r: int, board, *, hold: float = HOLD, rattle_wait: float = RATTLE_WAIT) -> int:
    """The parent's loop: copy the child's stderr (fd `r`) `hold` seconds late, wait for the child, return
    the exit code to leave with."""
    forward = _forwarder(child)
    for name in _FORWARD:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            signal.signal(getattr(signal, name), forward)
    os.set_blocking(r, False)
    held: collections.deque = collections.deque()  # (arrival time, bytes)
    frozen = None  # when jaxlib's termination text arrived
    status, eof = None, False
    while status is None:
        if eof:
            time.sleep(0.1)
        else:
            select.select([r], [], [], 0.1)  # a signal's handler runs, then select goes on (PEP 475)
        now = time.monotonic()
        data, eof = _read_all(r)
        if data:
            tail = held[-1][1][-256:] if held else b""
            held.append((now, data))
            if frozen is None and FREEZE.search(tail + data):
                frozen = now
        if frozen is not None and now - frozen > rattle_wait:
            frozen = None  # the child lives on: not its end after all
        if frozen is None:
            while held and now - held[0][0] >= hold:
                _write(held.popleft()[1])
        pid, st = os.waitpid(child, os.WNOHANG)
        if pid:
            status = st
    deadline = time.monotonic() + 0.5  # what the child wrote last (its children may keep the pipe open)
    while not eof and time.monotonic() < deadline:
        data, eof = _read_all(r)
        if data:
            held.append((time.monotonic(), data))
        elif not eof and not select.select([r], [], [], 0.05)[0]:
            break
    text = b"".join(d for _, d in held)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    if code not in _OWN_CODES and RATTLE.search(text):
        return report_lost(text, board, code)
    _write(text)
    return code


def diagnose(text: str, me: int) -> tuple[list, str]:
    """(lost process ids, why) from jaxlib's termination text."""
    status = text.split("absl::Status:", 1)[1] if "absl::Status:" in text else text
    first = " ".join(status.strip().splitlines()[0].split()) if status.strip() else ""
    unhealthy = re.search(r"unhealthy[^\n]*\n((?:\s*/job:[^\n]*\n?)+)", status)
    if unhealthy:
        ids = sorted({int(t) for t in re.findall(r"task:(\d+)", unhealthy.group(1))} - {me})
        return ids, "jax's coordination service saw it stop sending heartbeats"
    timeouts = sorted({int(t) for t in re.findall(r"[Tt]ask (\d+) heartbeat timeout", status)} - {me})
    if timeouts:
        return timeouts, "jax's coordination service saw its heartbeats stop"
    if re.search(r"Failed to send RPC to coordination service|leader task|Socket closed|Connection reset", status):
        return ([0] if me != 0 else []), "the coordination service it hosts is gone"
    return [], f"jax's coordination service reported: {first[:160]}"


def report_lost(raw: bytes, board, code: int) -> int:
    """The child was terminated by jaxlib for a lost peer: one line, the heartbeat, the held text kept."""
    from jaxsora.parallel import peers

    step, me, n, run = read_board(board)
    text = raw.decode(errors="replace")
    lost, why = diagnose(text, me)
    newest = peers.newest_intact(run)
    if run:
        with contextlib.suppress(OSError):
            folder = os.path.join(run, LOST_DIR)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{me}.txt"), "a") as f:
                f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: process {me}'s trainer ended (exit status "
                        f"{code}) after jaxlib's coordination client reported a fatal error; its last output:\n")
                f.write(text)
        from jaxsora.train.run.supervise import write_heartbeat

        write_heartbeat(run, me, step, phase="lost-peer", lost=lost, newest_checkpoint=newest)
    line = peers.lost_line(lost, n, me, why, step, run, newest)
    if run:
        line += f" (jaxlib's messages: {os.path.join(run, LOST_DIR, f'{me}.txt')})"
    _write((("\n" if _line_open else "") + line + "\n").encode())
    return EXIT_PEER_LOST
