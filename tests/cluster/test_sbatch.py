"""launch/slurm.sbatch acts on its tasks' exit codes: a lost process (the survivors' 76, the lost
task's 137 or no code at all) or a stop (75) requeues the job, which starts again with --load from the newest
intact checkpoint; a task's error of its own (1, 2, 3) is not requeued. The script runs for real under bash;
srun, scontrol and the trainer are stand-ins on PATH (srun runs each task's command here, one after another)."""
import os
import subprocess

import pytest

from tests.cluster.conftest import write_exe
from tests.train.common import REPO

SCRIPT = os.path.join(REPO, "launch", "slurm.sbatch")
SRUN = """#!/bin/bash
# fake srun: drop the options, run the command once per task (SLURM_PROCID), skip the tasks in FAKE_SKIP
# (their node "went down": no exit code); return the highest exit code, as srun does
while [[ "$1" == -* ]]; do shift; done
rc=0
for ((t = 0; t < SLURM_NTASKS; t++)); do
  [[ " $FAKE_SKIP " == *" $t "* ]] && continue
  SLURM_PROCID=$t "$@"; c=$?
  (( c > rc )) && rc=$c
done
exit $rc
"""
SCONTROL = """#!/bin/sh
echo "scontrol $*" >> "$FAKE_LOG"
"""
TRAINER = """#!/bin/bash
# the trainer: its arguments logged, its exit code the SLURM_PROCID-th of FAKE_CODES
echo "task $SLURM_PROCID: $*" >> "$FAKE_LOG"
codes=($FAKE_CODES)
exit "${codes[$SLURM_PROCID]}"
"""


# srun as SLURM signals a step (`--signal=TERM@300`, scancel): each task started in a process group of its own,
# SIGTERM sent to that group after a moment, the task waited for
SRUN_SIGTERM = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
rc=0
for ((t = 0; t < SLURM_NTASKS; t++)); do
  SLURM_PROCID=$t setsid "$@" &
  pid=$!
  sleep 0.5
  kill -TERM -- "-$pid"
  wait "$pid"; c=$?
  (( c > rc )) && rc=$c
done
exit $rc
"""
# a trainer that saves a checkpoint on SIGTERM (for a while) and exits 75
SAVING_TRAINER = """#!/bin/bash
trap 'sleep 0.5; echo "task $SLURM_PROCID saved" >> "$FAKE_LOG"; exit 75' TERM
echo "task $SLURM_PROCID: $*" >> "$FAKE_LOG"
sleep 10 & wait
"""


@pytest.fixture
def slurm_job(tmp_path):
    bin_dir = tmp_path / "bin"
    write_exe(bin_dir / "srun", SRUN)
    write_exe(bin_dir / "scontrol", SCONTROL)
    trainer = write_exe(bin_dir / "trainer", TRAINER)
    log = tmp_path / "calls.log"

    def run(codes, skip="", checkpoints=(), restarts=0):
        run_dir = tmp_path / "outputs" / "exp"
        for name, intact in checkpoints:
            (run_dir / "checkpoints" / name).mkdir(parents=True, exist_ok=True)
            if intact:
                (run_dir / "checkpoints" / name / "integrity.json").write_text("{}")
        log.write_text("")
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": trainer, "FAKE_LOG": str(log),
               "FAKE_CODES": " ".join(map(str, codes)), "FAKE_SKIP": skip, "SLURM_JOB_ID": "77",
               "SLURM_NTASKS": str(len(codes)), "SLURM_JOB_NODELIST": "gpu[01-02]",
               "SLURM_RESTART_COUNT": str(restarts), "OUTPUTS": str(tmp_path / "outputs"), "EXPERIMENT": "exp"}
        r = subprocess.run(["bash", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        return r, log.read_text()

    return run


@pytest.mark.parametrize("codes,skip,requeued", [
    ((76, 137), "", True),      # process 1 killed (the OOM killer): the survivor stopped for it
    ((76, 0), "1", True),       # process 1's node went down with it: no exit code
    ((75, 75), "", True),       # stopped by SIGTERM with a checkpoint
    ((76, 1), "", False),       # process 1 crashed with an error of its own: the survivor named it
    ((76, 2), "", False),       # a user error
    ((0, 0), "", False),        # done
])
def test_requeued_on_a_lost_process_or_a_stop(slurm_job, codes, skip, requeued):
    r, calls = slurm_job(codes, skip)
    assert r.returncode == max(c for i, c in enumerate(codes) if str(i) not in skip.split()), r.stdout + r.stderr
    assert ("scontrol requeue 77" in calls) == requeued, r.stdout + calls
    expected = " ".join(f"{i}:{'lost' if str(i) in skip.split() else c}" for i, c in enumerate(codes))
    assert f"exit codes of the tasks (task:code): {expected}" in r.stdout, r.stdout
    if codes[1] in (1, 2):
        assert f"not requeued: task 1 exited {codes[1]}" in r.stdout


def test_the_requeued_job_resumes_from_an_intact_checkpoint_only(slurm_job, tmp_path):
    run_dir = tmp_path / "outputs" / "exp"
    # a save cut short by the loss (orbax's temporary folder, integrity record written, never renamed)
    _, calls = slurm_job((0, 0), checkpoints=[("6.orbax-checkpoint-tmp-1700000000", True)])
    assert "--load" not in calls and f"--run-dir {run_dir}" in calls, calls
    _, calls = slurm_job((0, 0), checkpoints=[("4", True)], restarts=1)
    assert calls.count(f"--load {run_dir}") == 2, calls  # both tasks


def test_sigterm_to_a_task_waits_for_its_checkpoint_and_requeues(slurm_job, tmp_path):
    """SLURM's SIGTERM reaches the task's whole process group: the task's shell waits for the trainer to save and
    exit 75, records that code, and the job is requeued (a shell that died at once would leave no code)."""
    bin_dir = tmp_path / "bin"
    write_exe(bin_dir / "srun", SRUN_SIGTERM)
    write_exe(bin_dir / "trainer", SAVING_TRAINER)
    r, calls = slurm_job((0, 0))
    assert calls.count("saved") == 2 and "scontrol requeue 77" in calls, r.stdout + r.stderr + calls
    assert "exit codes of the tasks (task:code): 0:75 1:75" in r.stdout, r.stdout


def test_not_requeued_past_the_limit(slurm_job):
    r, calls = slurm_job((76, 137), restarts=20)
    assert "scontrol" not in calls and "requeued 20 times already" in r.stdout
