"""stop: TERM, then KILL after the grace period, by the recorded pids only — an unrelated process
with the same name survives, and a pid that now belongs to another process is not signalled."""
import os
import subprocess

import pytest

from jaxsora.cluster import records
from jaxsora.errors import UserError
from tests.cluster.conftest import PY, alive, printed, wait_for

# process 0: a plain `sleep` (ends on TERM); process 1: ignores TERM (needs the KILL)
CHILD = ('if [ "$JAX_PROCESS_ID" = 1 ]; then exec ' + PY + ' -c "import signal, time; '
         'signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\'ready\', flush=True); time.sleep(300)"; '
         'else exec sleep 300; fi')


def test_stop_by_recorded_pid(cluster, capsys):
    hosts = cluster.hosts("node-a", "node-b")
    bystander = subprocess.Popen(["sleep", "300"])  # same name as the trainer of node-a
    try:
        assert cluster.cli(hosts, "launch", "--", "sh", "-c", CHILD) == 0
        pids = {e["host"]: e["pid"] for e in cluster.pids()["hosts"]}
        wait_for(lambda: printed(cluster.log("node-b"), "ready"), what="node-b's child to ignore SIGTERM")
        assert all(alive(p) for p in pids.values())
        with pytest.raises(UserError, match="still runs"):  # a second launch into the same logdir
            cluster.cli(hosts, "launch", "--", "true")
        capsys.readouterr()

        assert cluster.cli(hosts, "stop", "--grace", "1") == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line for line in out.splitlines()[2:]}
        assert "exited after SIGTERM" in rows["node-a"], out
        assert "killed (SIGKILL after 1s)" in rows["node-b"], out
        wait_for(lambda: not any(alive(p) for p in pids.values()), 5, "the trainers to be gone")
        assert bystander.poll() is None  # the other `sleep` lives on
        # each launch's watcher appends its trainer's exit code once it has reaped it: after the trainer is gone,
        # not necessarily by the time this test sees it gone (read at once, node-b's line was missing once)
        wait_for(lambda: "exit code 143" in cluster.log("node-a") and "exit code 137" in cluster.log("node-b"), 10,
                 "the watchers to log the exit codes (143 and 137)")

        assert cluster.cli(hosts, "stop", "--grace", "1") == 0  # again: nothing left
        assert capsys.readouterr().out.count("was not running") == 2
    finally:
        bystander.kill()
        bystander.wait()


def test_a_reused_pid_is_left_alone(cluster, capsys):
    hosts = cluster.hosts("node-a")
    other = subprocess.Popen(["sleep", "300"])
    try:
        os.makedirs(cluster.logdir)
        # the recorded trainer had this pid, but started at another time: the pid was reused
        records.write_pids(cluster.logdir, dict(hosts=[dict(host="node-a", process=0, pid=other.pid, start="1")]))
        assert cluster.cli(hosts, "stop", "--grace", "1") == 0
        assert "not signalled: the pid now belongs to another process" in capsys.readouterr().out
        assert other.poll() is None
    finally:
        os.remove(os.path.join(cluster.logdir, "pids.json"))
        other.kill()
        other.wait()


def test_nothing_recorded(cluster):
    hosts = cluster.hosts("node-a")
    with pytest.raises(UserError, match="nothing to stop: no recorded trainer pid"):
        cluster.cli(hosts, "stop")
