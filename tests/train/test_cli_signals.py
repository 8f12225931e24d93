"""The real command, `python -m jaxsora.train`, under the signals of a cluster: SIGUSR2 writes every
thread's stack to <run>/stacks/0.txt and training goes on; the heartbeat file follows the steps;
SIGTERM saves and exits with code 75 (EX_TEMPFAIL: stopped, run again with --load), which
launch/slurm.sbatch requeues on — a finished run exits 0."""
import json
import os
import signal
import subprocess
import time

import pytest

from data_tools.synthetic import generate
from jaxsora.runs import describe, format_table
from jaxsora.train.run.supervise import STACK_DUMP_SIGNAL
from tests.train.common import REPO
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON, command_pid

ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": cpu_flags(1)}  # one device: the signals, not the mesh, are tested


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate(str(out), num_videos=8, num_images=8, sizes=[(32, 32)], frames=[12], fps=8, seed=0, progress=False)
    return str(out / "meta.csv")


def _cmd(table, run, steps):
    return [PYTHON, "-m", "jaxsora.train", "--config", os.path.join(REPO, "configs", "demo.py"),
            "--data-path", table, "--run-dir", str(run), f"--config.train.max_steps={steps}",
            "--config.train.log_every=1", "--config.train.ckpt_every=1000",
            "--config.data.batch_size_override=1", "--config.model.depth=1"]  # the signals, not the model


def test_stack_dump_heartbeat_and_sigterm_exit_code(table, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(table, run, 100000), env=ENV, cwd=str(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step ") and "step      2" in line:
            break
    else:
        pytest.fail("".join(seen)[-3000:])
    beat = json.loads((run / "heartbeat" / "0.json").read_text())
    assert beat["pid"] == command_pid(proc) and beat["step"] >= 1
    proc.send_signal(STACK_DUMP_SIGNAL)  # a dump, not a stop
    stacks = run / "stacks" / "0.txt"
    # faulthandler writes the dump thread by thread: wait for the loop's frame itself, not the
    # first header, or a read in between sees half a dump
    for _ in range(300):
        if "_run" in stacks.read_text():
            break
        time.sleep(0.1)
    assert "_run" in stacks.read_text(), stacks.read_text()[-3000:]  # the loop's frame
    assert proc.poll() is None  # still training
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out[-3000:]
    assert "stopped by a signal at step" in out and f"--load {run}" in out
    steps = sorted(int(d) for d in os.listdir(run / "checkpoints") if d.isdigit())
    assert steps[-1] >= 2  # saved where it stopped
    beat = json.loads((run / "heartbeat" / "0.json").read_text())
    assert beat["phase"] == "stopped" and beat["step"] == steps[-1]  # how it ended, for runs and cluster status
    assert describe(str(run))["status"] == "stopped: --load it"


def test_a_finished_run_exits_zero(table, tmp_path):
    r = subprocess.run(_cmd(table, tmp_path / "run", 2), env=ENV, cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    beat = json.loads((tmp_path / "run" / "heartbeat" / "0.json").read_text())
    assert beat["step"] == 2 and beat["phase"] == "done"
    info = describe(str(tmp_path / "run"))
    assert info["status"] == "done" and info["config"] == os.path.join(REPO, "configs", "demo.py")
    started = [json.loads(ln) for ln in (tmp_path / "run" / "invocations.jsonl").read_text().splitlines()]
    assert len(started) == 1 and started[0]["argv"][1:3] == ["--config", info["config"]]
    assert "lambda/stage2.py" in format_table([dict(info, config="configs/lambda/stage2.py")])
