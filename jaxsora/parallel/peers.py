"""A lost process ends the others cleanly: whichever process of a multi-process run dies, and whenever, every
survivor prints one line naming it (or "a peer" when that cannot be known), the step, and the newest intact
checkpoint to `--load`, and exits with `EXIT_PEER_LOST` (76) — no traceback, no abort.

A peer's death reaches a survivor in one of these ways; each ends in the same line:
- missed signs of life: each process counts in jax.distributed's key-value store every few seconds (the
  watching thread, `PeerWatch`); a peer whose counter stands still for `JAXSORA_PEER_TIMEOUT` seconds
  (default 30, below jax's own heartbeat timeout of 100 s) is lost. A peer that is alive but slow (a long
  compile, a stalled step) still counts: the counting is a thread of its own. The counters are counters,
  not clocks (hosts' clocks differ).
- a collective that fails (Gloo's "Connection reset by peer" on CPU, an NCCL error on GPUs) in the step,
  the eval or a checkpoint's sync: `await_verdict` waits for the watch to name the lost process, or
  names "a peer" once the watch had its time;
- a collective that never returns: the watch fires all the same; the stall watchdog
  (`train.run.supervise.Watchdog`) first waits for its verdict when a peer is suspect (`settle`);
- a peer that stopped for a lost peer of its own: it leaves the word `lost:<ids>` in the store, and the
  others stop at once naming the same process; a peer that stopped with an error of its own (`failing`)
  leaves `failed`, and the others stop naming it (it exits with its own code; `jaxsora.train` skips jax's
  exit-time shutdown then, whose barrier would wait for the others);
- the end of the run: at exit this process says `exited` and waits (`PeerWatch.finish`) until every peer
  said so before jax's own exit-time `distributed.shutdown()` runs, whose barrier would otherwise wait
  for a dead peer and abort (SIGABRT). Every lost-peer exit is `os._exit`: it never reaches that shutdown.
- losing process 0, which hosts jax's coordination service: its connections close at once, and jaxlib's
  client then terminates this process from C++ (`client.h`, SIGABRT) before any Python code can run —
  jaxlib's `missed_heartbeat_callback`, the hook that would let Python speak first, fails to convert its
  status argument (std::bad_cast) in jaxlib 0.10. The trainer's per-host parent process
  (`jaxsora.train.run.agent`) reports that end in the same line and exit code.

The trainer sets what is said and written on the way out (`on_lost`): the step, the newest intact
checkpoint, the heartbeat file. `lost_line` and `newest_intact` need no jax (the agent uses them).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable

from jaxsora.errors import EXIT_PEER_LOST

TIMEOUT_ENV = "JAXSORA_PEER_TIMEOUT"
DEFAULT_TIMEOUT = 30.0  # seconds without a sign of life; below jax's heartbeat_timeout_seconds (100)
_PREFIX = "jaxsora/alive/"
EXITED = "exited"  # a process's last sign of life when it ends normally (never a counter)
FAILED = "failed"  # ... when it ends with an error of its own (its log says which)
LOST = "lost:"  # "lost:1,3": the process stopped because it lost processes 1 and 3 ("lost:": a peer)
# How long a process that ended normally waits for its peers to end before jax's shutdown barrier
# (jax.distributed's own shutdown_timeout_seconds default).
FINISH_TIMEOUT = 300.0
INTEGRITY_FILE = "integrity.json"  # jaxsora.checkpoint's completion marker (no jax import here)

_lock = threading.Lock()
_handler: Callable[[list, str], None] | None = None
_watch: PeerWatch | None = None


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        value = DEFAULT_TIMEOUT
    return max(1.0, value)


def on_lost(handler: Callable[[list, str], None] | None) -> None:
    """`handler(lost process ids, why)` runs once when a peer is lost ([] when which one cannot be known);
    it should end the process (the default prints one line and exits with EXIT_PEER_LOST)."""
    global _handler
    with _lock:
        _handler = handler


def short(e: BaseException | str, limit: int = 160) -> str:
    """An error's text on one line, cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def who(lost: list) -> str:
    return f"process {', '.join(str(i) for i in lost)}" if lost else "a peer"


def newest_intact(run_dir: str | None) -> int | None:
    """The newest step folder of `<run_dir>/checkpoints` that holds its integrity record, or None."""
    root = os.path.join(run_dir, "checkpoints") if run_dir else None
    try:
        names = os.listdir(root) if root else []
    except OSError:
        names = []
    steps = [int(d) for d in names if d.isdigit() and os.path.isfile(os.path.join(root, d, INTEGRITY_FILE))]
    return max(steps) if steps else None


def lost_line(lost: list, num_processes: int, me: int, why: str, step: int | None, run_dir: str | None,
              newest: int | None) -> str:
    """The one line every survivor prints."""
    if run_dir is None:
        resume = "start the run again"
    elif newest is not None:
        resume = f"resume every process with --load {run_dir} (newest intact checkpoint: step {newest})"
    else:
        resume = f"no checkpoint was written yet in {run_dir}: start the run again"
    at = f"at step {step}" if step is not None else "before its first step"
    return (f"[jaxsora] lost {who(lost)} of {num_processes} ({why}) {at}: process {me} stops "
            f"(exit code {EXIT_PEER_LOST}); {resume}")


def default_handler(lost: list, why: str) -> None:
    print(f"[jaxsora] lost {who(lost)} ({why}): stopping this process (exit code {EXIT_PEER_LOST})",
          file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def _parse_lost(word: str) -> list[int]:
    return [int(x) for x in word[len(LOST):].split(",") if x.strip().isdigit()]


class PeerWatch(threading.Thread):
    """The watching thread: sets its own counter, reads the others', declares a peer lost when its counter
    stands still for `timeout` seconds (or the store cannot be reached for that long), or when a peer says
    it stopped for a lost peer."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float, interval: float | None = None):
        super().__init__(name="jaxsora-peer-watch", daemon=True)
        self.client, self.me, self.n = client, int(process_id), int(num_processes)
        self.timeout = float(timeout)
        self.interval = interval or min(5.0, self.timeout / 6)
        self.fired = threading.Event()
        self.stopping = threading.Event()
        self.leaving = threading.Event()  # this process ended normally: say EXITED instead of counting
        self.peers_done = threading.Event()  # every peer said EXITED
        self._wake = threading.Event()
        self.failed = False  # this process is ending with an error of its own
        self.seen: dict[int, tuple[str | None, float]] = {}  # peer → (its word, when it last changed)
        self.unreachable_since: float | None = None

    def stop(self, wait: float = 10.0) -> None:
        """End the watch (at exit: before jax shuts its client down and the interpreter finalizes) and say
        so in the store. A daemon thread that comes back from jaxlib after finalization began is ended by a
        forced unwind the bindings catch and do not rethrow (`terminate called ...`, SIGABRT) on a run that
        succeeded. Its last word, `EXITED`, keeps the peers from taking its quiet counter for a loss while
        they finish (this process may wait for them in jax's shutdown barrier)."""
        self.stopping.set()
        self._wake.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(wait)
        if not (self.fired.is_set() or self.failed):
            with contextlib.suppress(Exception):  # the service (process 0) may be gone: nothing to tell
                self.client.key_value_set(f"{_PREFIX}{self.me}", EXITED, allow_overwrite=True)

    def finish(self, limit: float = FINISH_TIMEOUT) -> None:
        """At the normal end of this process (atexit, before jax's `distributed.shutdown()`): say EXITED and
        keep watching until every peer said so, so that a peer lost meanwhile is reported here (one line,
        exit 76) instead of failing jax's shutdown barrier; at most `limit` seconds for peers that still
        work (their counters move), then stop the watch. A process ending with an error (`failing`) waits
        for nobody."""
        if self.is_alive() and not (self.fired.is_set() or self.failed):
            self.leaving.set()
            self._wake.set()
            deadline = time.monotonic() + limit
            while not (self.peers_done.wait(0.1) or self.fired.is_set()) and time.monotonic() < deadline:
                pass
        self.stop()

    def failing(self) -> None:
        """This process ends with an error of its own: say so (the peers stop, naming it), stop counting."""
        self.failed = True
        self.stopping.set()
        self._wake.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(10.0)  # its round in flight would write a counter over the word
        self._say(FAILED)

    def _say(self, word: str, wait: float = 1.0) -> None:
        """Write this process's word, waiting at most `wait` seconds (the service may be going)."""
        def put():
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_PREFIX}{self.me}", word, allow_overwrite=True)

        t = threading.Thread(target=put, name="jaxsora-peer-say", daemon=True)
        t.start()
        t.join(wait)

    def _fire(self, lost: list, why: str) -> None:
        with _lock:
            if self.fired.is_set():
                return
            self.fired.set()
            handler = _handler or default_handler
        if 0 not in lost or self.me == 0:  # the others stop at once, naming the same process
            self._say(LOST + ",".join(str(i) for i in lost))
        try:
            handler(list(lost), why)
        finally:
            default_handler(lost, why)  # a handler that returned: end the process anyway

    def _counters(self) -> dict[int, str | None]:
        """{peer: its word (None: not counted yet)}, in one request however many processes there are."""
        got = {}
        for key, value in self.client.key_value_dir_get(_PREFIX):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                got[int(tail)] = value
        return {i: got.get(i) for i in range(self.n) if i != self.me}

    def suspects(self) -> list[int]:
        """Peers whose counter has not moved for two intervals (or [0]: the service has not answered for
        that long): a verdict may be coming."""
        now, grace = time.monotonic(), 2 * self.interval + 0.5
        out = [i for i, (v, since) in sorted(self.seen.items())
               if v not in (None, EXITED, FAILED) and not str(v).startswith(LOST) and now - since > grace]
        if self.unreachable_since is not None and now - self.unreachable_since > grace and self.me != 0:
            out.append(0)
        return out

    def _pause(self) -> None:
        """Wait for the next round: an interval, a quarter second while this process is leaving (its peers'
        last words are awaited), or until woken."""
        self._wake.wait(min(self.interval, 0.25) if self.leaving.is_set() else self.interval)
        self._wake.clear()

    def run(self) -> None:
        count = 0
        while not (self.fired.is_set() or self.stopping.is_set()):
            now = time.monotonic()
            try:
                count += 1
                word = EXITED if self.leaving.is_set() else str(count)
                self.client.key_value_set(f"{_PREFIX}{self.me}", word, allow_overwrite=True)
                values = self._counters()
                self.unreachable_since = None
            except Exception as e:  # noqa: BLE001 — the coordination service (process 0) is gone or failing
                if self.me != 0:
                    self.unreachable_since = self.unreachable_since or now
                    if now - self.unreachable_since >= self.timeout:
                        self._fire([0], f"the coordination service it hosts stopped answering for "
                                        f"{self.timeout:.0f} s: {short(e)}")
                self._pause()
                continue
            stale, told, failed = [], {}, []
            for i, v in values.items():
                last, since = self.seen.get(i, (None, now))
                if v != last:
                    self.seen[i] = (v, now)
                if v is not None and v.startswith(LOST):
                    told[i] = _parse_lost(v)
                elif v == FAILED and v == last and now - since >= self.interval:
                    failed.append(i)  # a round's grace: when every process fails alike, each says its own error
                elif v not in (None, EXITED, FAILED) and v == last and now - since >= self.timeout:
                    stale.append(i)  # counted before, stands still now
            if self.failed:
                break
            if stale:
                self._fire(stale, f"no sign of life for {self.timeout:.0f} s")
            elif failed:
                self._fire(failed, "it stopped with an error: see its log")
            elif told:
                first = min(told)
                lost = sorted({i for ids in told.values() for i in ids} - {self.me})
                self._fire(lost, f"process {first} stopped for it")
            if all(v == EXITED for v in values.values()):
                self.peers_done.set()
            self._pause()


def start(num_processes: int, process_id: int) -> PeerWatch | None:
    """Start watching the peers of this initialized multi-process run (once); None for one process."""
    global _watch
    if num_processes <= 1 or _watch is not None:
        return _watch
    from jax._src import distributed as jd  # jax has no public handle on its distributed client

    client = getattr(jd.global_state, "client", None)
    if client is None or not hasattr(client, "key_value_dir_get"):
        return None
    _watch = PeerWatch(client, process_id, num_processes, _timeout())
    _watch.start()
    # Registered after jax's own exit hook (at its import), so it runs first: the watch sees every peer
    # end (or reports the one lost) before jax shuts down its client, and ends before the interpreter
    # finalizes.
    atexit.register(_watch.finish)
    return _watch


# Errors of a collective or of the coordination service whose peer went away: Gloo on CPU ("Gloo
# all-reduce failed: ... Connection reset by peer"), NCCL on GPUs, jax's barriers and key-value store.
_COLLECTIVE = re.compile(
    r"Gloo [\w-]+ failed|Connection (closed|reset) by peer|Broken pipe|NCCL (error|operation|failure)|"
    r"unhandled system error|remote process exited|[Hh]eartbeat timeout|Barrier timed out|"
    r"is not connected|Failed to send RPC to coordination service|UNAVAILABLE: .*(coordination|peer)")


def is_collective_failure(e: BaseException) -> bool:
    """An error raised by a collective (or the coordination service) whose peer went away."""
    return bool(_COLLECTIVE.search(str(e)))


def failing() -> None:
    """This process ends with an error of its own (not a lost peer's): its peers stop too, naming it."""
    if _watch is not None and not _watch.fired.is_set():
        _watch.failing()


def is_failing() -> bool:
    return _watch is not None and _watch.failed


def leave(prog: str, e: BaseException, debug: bool = False) -> NoReturn:  # noqa: F821
    """End a process of a multi-process run that failed with an error of its own (`failing`): its one line
    (a user error, exit 2) or its traceback (exit 1), then `os._exit` — jax's exit-time shutdown would wait in
    its barrier for the peers, which stop on their own (naming this process), and then abort."""
    import traceback

    from jaxsora.errors import EXIT_USER_ERROR, UserError, one_line

    if isinstance(e, UserError) and not debug:
        print(f"{prog}: {one_line(str(e))}", file=sys.stderr)
        code = EXIT_USER_ERROR
    else:
        traceback.print_exception(e, file=sys.stderr)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _verdict_time(w: PeerWatch) -> float:
    return w.timeout + 2 * w.interval + 1.0


def await_verdict(e: BaseException) -> None:
    """Called with the error that ends a multi-process run: when it is a collective's failure, or a peer is
    suspect, wait for the watch to name the lost process (it then ends this process); a collective's failure
    with no verdict in that time ends the process naming "a peer". Returns when the error is this process's
    own."""
    w = _watch
    if w is None or threading.current_thread() is w:
        return
    collective = is_collective_failure(e)
    if not (collective or w.fired.is_set() or w.suspects()):
        return
    if w.fired.wait(_verdict_time(w)):
        time.sleep(_verdict_time(w))  # the handler is ending the process
        return
    if collective:
        w._fire([], f"a collective failed: {short(e)}")


def settle() -> bool:
    """For the stall watchdog: when a peer is suspect, wait for the watch's verdict (which ends the process).
    Returns True if the watch had a suspect and let it go (the stall is then this process's own)."""
    w = _watch
    if w is None or not w.suspects():
        return False
    w.fired.wait(_verdict_time(w))
    if w.fired.is_set():
        time.sleep(_verdict_time(w))  # the handler is ending the process
    return True
