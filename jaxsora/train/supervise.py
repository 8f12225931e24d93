"""Supervision of a running job: a watchdog for stalls and clean stops on SIGTERM/SIGINT."""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time

import numpy as np


class Watchdog:
    """Dumps every thread's stack (faulthandler) when a step takes far longer than usual — the
    reference's silent loader freezes. Never kills the run."""

    def __init__(self, factor: float, min_seconds: float):
        self.factor, self.min_seconds = factor, min_seconds
        self.times: list[float] = []
        self._deadline = None
        self._stop = threading.Event()
        self.dumps = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxsora-watchdog")
        self._thread.start()

    def begin(self):
        typical = float(np.median(self.times[-50:])) if len(self.times) >= 3 else None
        limit = max(self.min_seconds, self.factor * typical) if typical else None
        self._deadline = (time.monotonic() + limit) if limit else None
        self._start = time.monotonic()

    def end(self):
        self.times.append(time.monotonic() - self._start)
        self._deadline = None

    def _run(self):
        while not self._stop.wait(1.0):
            d = self._deadline
            if d is not None and time.monotonic() > d:
                self.dumps += 1
                print(f"[watchdog] step running for {time.monotonic() - self._start:.0f}s "
                      f"(median {np.median(self.times[-50:]):.2f}s); stacks of every thread:", file=sys.stderr)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self._deadline = None

    def stop(self):
        self._stop.set()


class StopRequested:
    """SIGTERM/SIGINT → finish the current step, checkpoint, exit cleanly."""

    def __init__(self):
        self.flag = False
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame):
        if self.flag:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.flag = True
        print(f"\n[jaxsora] got signal {signum}: saving a checkpoint after this step, then exiting",
              file=sys.stderr)

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)
