"""dump: SIGUSR2 to the recorded pid of a trainer that called register_stack_dump → its stacks,
read back from <run>/stacks/<process>.txt; a process without the handler is not signalled."""
import os
import shutil

import pytest

from jaxsora.errors import UserError
from tests.cluster.conftest import PY, alive, printed, wait_for

CHILD = """
import os, sys, time
from jaxsora.train.run.supervise import register_stack_dump

register_stack_dump(sys.argv[1], int(os.environ["JAX_PROCESS_ID"]))
print("ready", flush=True)


def spin_here():
    while True:
        time.sleep(0.05)


spin_here()
"""


def test_dump_collects_the_stacks(cluster, capsys, tmp_path):
    hosts = cluster.hosts("node-a", "node-b")
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    assert cluster.cli(hosts, "launch", "--run", "outputs/exp", "--", PY, str(child), cluster.run) == 0
    for h in ("node-a", "node-b"):
        wait_for(lambda: printed(cluster.log(h), "ready"), 60, f"{h}'s child to register its stack dump")
    capsys.readouterr()

    assert cluster.cli(hosts, "dump") == 0  # --run comes from pids.json
    out = capsys.readouterr().out
    assert out.count("in spin_here") >= 4, out  # each host's tail and its innermost frame
    assert "===== node-a (process 0" in out and "===== node-b (process 1" in out
    [stamp] = os.listdir(os.path.join(cluster.logdir, "dumps"))
    saved = open(os.path.join(cluster.logdir, "dumps", stamp, "node-b.txt")).read()
    assert "spin_here" in saved and "child.py" in saved
    assert all(alive(e["pid"]) for e in cluster.pids()["hosts"])  # a dump does not stop anything
    assert "spin_here" in open(os.path.join(cluster.run, "stacks", "1.txt")).read()


@pytest.mark.skipif(shutil.which("py-spy") is not None, reason="py-spy installed: dump uses it instead")
def test_no_handler_no_signal(cluster, capsys):
    hosts = cluster.hosts("node-a")
    assert cluster.cli(hosts, "launch", "--run", cluster.run, "--", "sleep", "300") == 0
    capsys.readouterr()
    assert cluster.cli(hosts, "dump") == 1
    assert "not signalled: the trainer does not catch SIGUSR2" in capsys.readouterr().out
    assert alive(cluster.pids()["hosts"][0]["pid"])


def test_dump_needs_the_run(cluster):
    hosts = cluster.hosts("node-a")
    with pytest.raises(UserError, match="dump needs the run folder"):
        cluster.cli(hosts, "dump")
