"""Coordinator ports for the multi-process tests.

`make test` runs two pytest-xdist workers side by side, each starting two-process runs whose coordinator
port was picked by binding port 0 and closing it. Such a port is an ephemeral one: the kernel may hand it
to the other worker's next bind-to-0 while ours is still starting, and gRPC (jax's coordination service)
binds with SO_REUSEPORT, so two coordinators on one port do not even fail to start — their processes meet
the wrong peers. Here each worker draws from its own slice of ports below the kernel's ephemeral range
(which never hands them out by itself), and a port this process handed out is not handed out again.
"""
import os
import random
import socket

_FIRST, _LAST = 20000, 32000  # below Linux's default ephemeral range (32768-60999)
_given: set[int] = set()


def _worker_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (_LAST - _FIRST) // count
    return range(_FIRST + index * size, _FIRST + (index + 1) * size)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, unique to this test worker."""
    ports = _worker_slice()
    rng = random.Random(os.getpid() ^ len(_given))
    for _ in range(200):
        port = rng.choice(ports)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")
