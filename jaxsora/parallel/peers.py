"""A lost process ends the others cleanly: each process of a multi-process run shows a sign of life in
jax.distributed's key-value store every few seconds; when a peer's stops changing for
`JAXSORA_PEER_TIMEOUT` seconds (default 30), or the coordination service itself stops answering (process
0, which hosts it, is gone), every surviving process prints one line naming the lost process and exits
with `EXIT_PEER_LOST` — before jax's own heartbeat timeout (100 s) would abort it with SIGABRT and a
stack dump, and whatever collective it waits in (Gloo, NCCL) is never left waiting.

Not covered: losing process 0 itself. Its coordination service's connections close at once, and
jax's client (jaxlib 0.10) then terminates the other processes immediately from C++ (SIGABRT, exit
code 134, no hang); jaxlib's `missed_heartbeat_callback`, the hook that would let us speak first,
fails to convert its status argument (std::bad_cast) in this version.

The signs of life are counters, not clocks (hosts' clocks differ). A peer that is alive but slow (a long
compile, a stalled step) still counts: the counting is a thread of its own. The trainer sets what is said
and written on the way out (`on_lost`): the step, the newest intact checkpoint, the heartbeat file.
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
    """`handler(lost process ids, why)` runs once on the watching thread when a peer is lost; it should
    end the process (the default prints one line and exits with EXIT_PEER_LOST)."""
    global _handler
    with _lock:
        _handler = handler


def default_handler(lost: list, why: str) -> None:
    who = ", ".join(str(i) for i in lost) if lost else "?"
    print(f"[jaxsora] lost process {who} ({why}): stopping this process (exit code {EXIT_PEER_LOST})",
          file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


class PeerWatch(threading.Thread):
    """The watching thread: sets its own counter, reads the others', declares a peer lost when its counter
    stands still for `timeout` seconds (or the store cannot be reached for that long)."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float, interval: float | None = None):
        super().__init__(name="jaxsora-peer-watch", daemon=True)
        self.client, self.me, self.n = client, int(process_id), int(num_processes)
        self.timeout = float(timeout)
        self.interval = interval or min(5.0, self.timeout / 6)
        self.fired = threading.Event()
        self.stopping = threading.Event()

    def stop(self, wait: float = 10.0) -> None:
        """End the watch (at exit: before jax shuts its client down and the interpreter finalizes) and say
        so in the store. A daemon thread that comes back from jaxlib after finalization began is ended by a
        forced unwind the bindings catch and do not rethrow (`terminate called ...`, SIGABRT) on a run that
        succeeded. Its last word, `EXITED`, keeps the peers from taking its quiet counter for a loss while
        they finish (this process may wait for them in jax's shutdown barrier far longer than `timeout`)."""
        self.stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(wait)
        if not self.fired.is_set():
            with contextlib.suppress(Exception):  # the service (process 0) may be gone: nothing to tell
                self.client.key_value_set(f"{_PREFIX}{self.me}", EXITED, allow_overwrite=True)

    def _fire(self, lost: list, why: str) -> None:
        if self.fired.is_set():
            return
        self.fired.set()
        with _lock:
            handler = _handler or default_handler
        try:
            handler(lost, why)
        finally:
            default_handler(lost, why)  # a handler that returned: end the process anyway

    def _counters(self) -> dict[int, str | None]:
        """{peer: its counter (None: not counted yet)}, in one request however many processes there are."""
        got = {}
        for key, value in self.client.key_value_dir_get(_PREFIX):
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                got[int(tail)] = value
        return {i: got.get(i) for i in range(self.n) if i != self.me}

    def run(self) -> None:
        count = 0
        seen: dict[int, tuple[str | None, float]] = {}
        unreachable_since = None
        while not (self.fired.is_set() or self.stopping.is_set()):
            now = time.monotonic()
            try:
                count += 1
                self.client.key_value_set(f"{_PREFIX}{self.me}", str(count), allow_overwrite=True)
                values = self._counters()
                unreachable_since = None
            except Exception as e:  # noqa: BLE001 — the coordination service (process 0) is gone or failing
                if self.me != 0:
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since >= self.timeout:
                        detail = " ".join(str(e).split())[:160]
                        self._fire([0], f"the coordination service it hosts stopped answering for "
                                        f"{self.timeout:.0f} s: {detail}")
                self.stopping.wait(self.interval)
                continue
            stale = []
            for i, v in values.items():
                last, since = seen.get(i, (None, now))
                if v != last:
                    seen[i] = (v, now)
                elif v not in (None, EXITED) and now - since >= self.timeout:  # counted before, stands still now
                    stale.append(i)
            if stale:
                self._fire(stale, f"no sign of life for {self.timeout:.0f} s")
            self.stopping.wait(self.interval)


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
    # Registered after jax's own exit hook (at its import), so it runs first: the watch ends before jax
    # shuts down its client and before the interpreter finalizes.
    atexit.register(_watch.stop)
    return _watch


def is_collective_failure(e: BaseException) -> bool:
    """An error raised by a collective whose peer went away (Gloo on CPU, NCCL on GPUs)."""
    text = str(e)
    return bool(re.search(r"Gloo \w+ failed|Connection closed by peer|NCCL (error|operation|failure)|"
                          r"unhandled system error|remote process exited", text))


def await_verdict(e: BaseException) -> None:
    """Called with an error from a collective: give the watch time to name the lost process (it then
    ends this process); returns if it did not (the error is then the process's own)."""
    if _watch is None or not is_collective_failure(e):
        return
    _watch.fired.wait(_watch.timeout + 2 * _watch.interval)
