"""preflight: clock offsets (a fake `date` ahead on one host), disk, versions, the coordinator port
and the shared outputs folder; exit code 1 when a check fails."""
import os
import socket
import sys

from jaxsora.cluster.clock import skew_from_samples
from jaxsora.cluster.preflight import _port
from jaxsora.cluster.remote import parse_date
from tests.cluster.conftest import REAL_DATE
from tests.ports import free_port

FAKE_DATE = """#!/bin/sh
# fake date: the real clock + {offset}s for `date +%s.%N`
if [ "$1" = "+%s.%N" ]; then
  exec awk -v o={offset} -v t="$({real} +%s.%N)" 'BEGIN {{ printf "%.9f\\n", t + o }}'
fi
exec {real} "$@"
"""


def test_skew_from_samples():
    # the remote clock is 2 s ahead; the sample with the shortest round trip wins
    samples = [(100.0, 102.9, 101.0), (200.0, 202.05, 200.1), (300.0, 302.5, 300.4)]
    offset, err = skew_from_samples(samples)
    assert abs(offset - 2.0) < 1e-9 and abs(err - 0.05) < 1e-9
    assert parse_date("1700000000.123456789") == 1700000000.123456789 and parse_date("1700000000.N") == 1.7e9


def test_port_verdicts():
    assert _port({"bind": ["free"], "connect": ["refused"]}, True, "h:1") == ("free", True)
    assert _port({"connect": ["refused"]}, False, "h:1") == ("reachable", True)
    assert not _port({"bind": ["Address already in use"], "connect": ["open"]}, True, "h:1")[1]
    assert "cannot resolve h" in _port({"connect": ["dns [Errno -2] Name or service not known"]}, False, "h:1")[0]
    assert "firewall" in _port({"connect": ["timeout"]}, False, "h:1")[0]



def test_preflight(cluster, capsys):
    hosts = cluster.hosts("h1", "h2", "h3", nvidia=False)
    cluster.tool("h3", "date", FAKE_DATE.format(offset=2.0, real=REAL_DATE))
    port = free_port()
    args = ("preflight", "--coordinator", "127.0.0.1", "--port", str(port), "--python", sys.executable,
            "--outputs", "outputs", "--min-free-gb", "0")
    rc = cluster.cli(hosts, *args)
    out = capsys.readouterr().out
    assert rc == 1, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("h1", "h2", "h3")}
    assert rows["h1"].endswith("ok") and rows["h2"].endswith("ok"), out
    offset = float(rows["h3"].split()[1].rstrip("s"))
    assert rows["h3"].endswith("FAIL") and abs(offset - 2.0) < 0.1, out
    assert "jaxsora 0.1.0" in rows["h1"] and "free" in rows["h1"] and "reachable" in rows["h2"]
    assert "FAIL h3: clock: +" in out and "NCCL" in out
    assert out.count("FAIL ") == 1

    with socket.socket() as listener:  # now something listens on the coordinator port
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
        listener.listen()
        assert cluster.cli(cluster.hosts("h1", nvidia=False), *args) == 1
    out = capsys.readouterr().out
    assert "FAIL h1: port: 127.0.0.1:" in out and "in use" in out
    assert os.listdir(os.path.join(cluster.workdir, "outputs")) == []  # the shared-folder marker is gone

