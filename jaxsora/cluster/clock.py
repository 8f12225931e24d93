"""Clock offset of a host against this machine, NTP-style over one ssh session.

The remote side prints `@@ready`, then answers each line it reads with `date +%s.%N`. Each sample
is (t0 local send, remote time, t1 local receive): offset = remote − (t0 + t1)/2, uncertain by
±(t1 − t0)/2. The connection set-up is outside the samples, so the round trip is one network hop
and a fork, not ssh's handshake; the sample with the shortest round trip is kept.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time

from jaxsora.cluster.remote import parse_date

SAMPLES = 5
SCRIPT = f'echo "@@ready"; for k in {" ".join(str(i) for i in range(SAMPLES))}; do read x || exit 0; ' \
         f'date +%s.%N; done\n'


def skew_from_samples(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """[(t0, remote, t1), ...] → (offset of the remote clock in s, half round trip of that sample)."""
    t0, remote, t1 = min(samples, key=lambda s: s[2] - s[0])
    return remote - (t0 + t1) / 2, (t1 - t0) / 2


class _Lines:
    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def read(self, deadline: float) -> str | None:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()


def measure(runner, host: str, timeout: float) -> tuple[float | None, float | None, str | None]:
    """(offset s, uncertainty s, None) or (None, None, why)."""
    deadline = time.monotonic() + timeout
    p = subprocess.Popen(runner.argv(host, SCRIPT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    lines, samples, why = _Lines(p.stdout.fileno()), [], None
    try:
        while True:
            line = lines.read(deadline)
            if line is None:
                why = "no answer"
                break
            if line == "@@ready":
                break
        while why is None and len(samples) < SAMPLES:
            t0 = time.time()
            p.stdin.write(b"\n")
            p.stdin.flush()
            line = lines.read(deadline)
            t1 = time.time()
            value = parse_date(line) if line is not None else None
            if value is None:
                why = f"`date +%s.%N` gave {line!r}"
                break
            samples.append((t0, value, t1))
    except (BrokenPipeError, OSError) as e:
        why = str(e)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
    if samples:
        return (*skew_from_samples(samples), None)
    tail = err.decode(errors="replace").strip().splitlines()
    return None, None, tail[-1] if tail else why
