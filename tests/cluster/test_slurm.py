"""--slurm JOBID: hosts from squeue + scontrol, commands through `srun --jobid J --overlap`, the
trainers' pids from the run's heartbeats (fake squeue/scontrol/srun on PATH)."""
import json
import os
import subprocess

import pytest

from jaxsora.cluster.__main__ import main
from jaxsora.cluster.hosts import slurm_hosts
from jaxsora.errors import UserError
from jaxsora.train.run.supervise import _proc_start
from tests.cluster.conftest import FAKE_SRUN, write_exe

SQUEUE = """#!/bin/sh
# fake squeue -j JOB -h -o '%T %N'
case "$2" in
  123) echo "RUNNING gpu[01-02]";;
  124) echo "PENDING ";;
  125) ;;
  *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;
esac
"""
SCONTROL = """#!/bin/sh
# fake scontrol show hostnames NODELIST
[ "$1 $2 $3" = "show hostnames gpu[01-02]" ] && printf 'gpu01\\ngpu02\\n'
"""


@pytest.fixture
def slurm(cluster, tmp_path, monkeypatch):
    bin_dir = tmp_path / "slurm-bin"
    write_exe(bin_dir / "squeue", SQUEUE)
    write_exe(bin_dir / "scontrol", SCONTROL)
    write_exe(bin_dir / "srun", FAKE_SRUN)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(tmp_path / "srun.log"))
    for node in ("gpu01", "gpu02"):  # each "node" says its own name
        cluster.tool(node, "hostname", f"#!/bin/sh\necho {node}\n")
    return tmp_path / "srun.log"


def test_hosts_of_a_job(slurm):
    assert slurm_hosts("123") == ["gpu01", "gpu02"]
    with pytest.raises(UserError, match="PENDING, not RUNNING"):
        slurm_hosts("124")
    with pytest.raises(UserError, match="not in the queue"):
        slurm_hosts("125")
    with pytest.raises(UserError, match="Invalid job id specified"):
        slurm_hosts("999")
    with pytest.raises(UserError, match="expects a job id"):
        slurm_hosts("12; rm -rf /")


def _heartbeat(run, process, host, pid, step):
    os.makedirs(os.path.join(run, "heartbeat"), exist_ok=True)
    with open(os.path.join(run, "heartbeat", f"{process}.json"), "w") as f:
        json.dump(dict(step=step, time=__import__("time").time(), pid=pid, host=host, process=process,
                       pid_start=_proc_start(pid)), f)


def test_status_and_stop_through_srun(cluster, slurm, capsys):
    trainer = subprocess.Popen(["sleep", "300"])  # "the trainer on gpu02", known by its heartbeat
    try:
        _heartbeat(cluster.run, 0, "gpu01.cluster", 999999, 40)  # a pid that is gone
        _heartbeat(cluster.run, 1, "gpu02", trainer.pid, 40)
        base = ["--slurm", "123", "--workdir", cluster.workdir, "--run", "outputs/exp"]
        assert main([*base, "status"]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line for line in out.splitlines()[2:4]}
        assert "999999 gone" in rows["gpu01"] and f"{trainer.pid} alive" in rows["gpu02"], out
        calls = slurm.read_text().splitlines()
        assert sorted(calls) == ["--jobid 123 --overlap --nodes=1 --ntasks=1 --nodelist gpu01 sh"] * 2 + \
            ["--jobid 123 --overlap --nodes=1 --ntasks=1 --nodelist gpu02 sh"] * 2  # heartbeats, then status

        assert main([*base, "stop", "--grace", "1"]) == 0
        out = capsys.readouterr().out
        assert "was not running" in out and "exited after SIGTERM" in out, out
        assert trainer.wait(timeout=5) == -15
    finally:
        trainer.kill()
        trainer.wait()


def test_slurm_needs_the_run_for_pids(cluster, slurm):
    with pytest.raises(UserError, match="give --run"):
        main(["--slurm", "123", "stop"])
    with pytest.raises(UserError, match="launch/slurm.sbatch"):
        main(["--slurm", "123", "launch", "--", "true"])
