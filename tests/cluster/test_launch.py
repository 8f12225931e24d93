"""launch: the same command on every "host" (fake ssh), detached, with jaxsora's distributed
variables; per-host logs, exit files and pids.json."""
import os

import pytest

from jaxsora.cluster import launch as launch_lib
from jaxsora.errors import UserError
from jaxsora.parallel.distributed import resolve
from tests.cluster.conftest import PY, alive, wait_for

SHOW_ENV = ("import os; e = os.environ; print('PROC', e['JAX_PROCESS_ID'], e['JAX_NUM_PROCESSES'], "
            "e['JAX_COORDINATOR_ADDRESS'], e.get('EXTRA'), e.get('NCCL_DEBUG'), os.getcwd())")


def test_the_variables_are_the_ones_distributed_reads():
    env = launch_lib.process_env("node-a:12355", 2, 1)
    assert resolve(env=env) == dict(coordinator_address="node-a:12355", num_processes=2, process_id=1)
    assert launch_lib.coordinator_address(["me@node-a", "node-b"], None, 1234) == "node-a:1234"
    assert launch_lib.coordinator_address(["node-a"], "10.0.0.1", 1234) == "10.0.0.1:1234"
    assert launch_lib.coordinator_address(["node-a"], "10.0.0.1:99", 1234) == "10.0.0.1:99"


def test_launch_two_hosts(cluster, capsys):
    hosts = cluster.hosts("node-a", "node-b")
    rc = cluster.cli(hosts, "launch", "--port", "12399", "--env", "EXTRA=x y", "--run", "outputs/exp", "--",
                     "NCCL_DEBUG=WARN", PY, "-c", SHOW_ENV)
    out = capsys.readouterr().out
    assert rc == 0, out
    record = cluster.pids()
    assert [(e["host"], e["process"]) for e in record["hosts"]] == [("node-a", 0), ("node-b", 1)]
    assert all(isinstance(e["pid"], int) and e["start"] for e in record["hosts"])
    assert record["coordinator"] == "node-a:12399" and record["run"] == cluster.run
    assert record["command"][0] == PY and record["env"] == {"EXTRA": "x y", "NCCL_DEBUG": "WARN"}
    for i, host in enumerate(["node-a", "node-b"]):
        exit_file = os.path.join(cluster.logdir, f"{host}.exit")
        wait_for(lambda: os.path.exists(exit_file) and open(exit_file).read().strip(), what=f"{host} to finish")
        assert open(exit_file).read().strip() == "0"
        log = cluster.log(host)
        assert f"PROC {i} 2 node-a:12399 x y WARN {cluster.workdir}" in log, log
        assert "exit code 0" in log and f"process {i} of 2 on {host}" in log
    assert "pids in" in out and "node-b" in out


def test_a_host_that_fails_stops_the_others(cluster, capsys, monkeypatch):
    hosts = cluster.hosts("node-a", "node-b")
    monkeypatch.setenv("FAKE_SSH_DOWN", "node-b")
    with pytest.raises(UserError, match="cannot reach node-b"):  # the check before launching
        cluster.cli(hosts, "launch", "--", "sleep", "300")
    rc = cluster.cli(hosts, "launch", "--force", "--", "sleep", "300")
    out = capsys.readouterr().out
    assert rc == 1 and "launch failed on node-b: unreachable: ssh: connect to host node-b" in out, out
    [entry] = cluster.pids()["hosts"]
    assert entry["host"] == "node-a"
    wait_for(lambda: not alive(entry["pid"]), what="the started process to be stopped")
    assert "exited after SIGTERM" in out


def test_launch_refuses_busy_gpus(cluster):
    hosts = cluster.hosts("node-a")
    cluster.nvidia("node-a", "0, NVIDIA H100 80GB HBM3, 70000, 81559, 690, 1980, 1980, 0, 60, 100", "4242, 70000")
    with pytest.raises(UserError, match=r"GPU processes already run on node-a \(pids 4242\)"):
        cluster.cli(hosts, "launch", "--", "true")
