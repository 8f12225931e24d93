"""What clusters and users do to a run: bad invocations are one line and exit code 2
and touch nothing; one run per folder; a frozen loader is reported; a blown-up update is rejected;
SIGTERM on one of two processes stops both at the same step."""
import concurrent.futures as cf
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxsora.train.run.loop import NonFiniteError, RunOptions, train
from jaxsora.train.run.supervise import RunLock, RunLockedError, Watchdog
from tests.ports import free_port
from tests.train.common import REPO, small_config
from tests.train.fake_loader import FakeLoader
from tests.zygote import PYTHON, command_pid, kill

RUNNER = os.path.join(os.path.dirname(__file__), "run_fake.py")
DEMO = os.path.join(REPO, "configs", "demo.py")
ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


def _tree_digest(root) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A synthetic table, broken inputs, and a run folder with a checkpoint that must survive."""
    ws = tmp_path_factory.mktemp("bad")
    subprocess.run([PYTHON, "-m", "data_tools.synthetic", "--out", str(ws / "data"), "--preset", "demo",
                    "--num-videos", "4", "--num-images", "2"], env=ENV, check=True, capture_output=True, cwd=REPO)
    (ws / "empty.csv").write_text("path,text,num_frames,height,width\n")
    (ws / "nocols.csv").write_text("path,caption\nx.mp4,hi\n")
    (ws / "broken.py").write_text("def get_config(:\n")
    (ws / "weights.txt").write_text("not weights\n")
    run = ws / "out" / "demo"
    (run / "checkpoints" / "7" / "state").mkdir(parents=True)
    (run / "checkpoints" / "7" / "state" / "blob").write_bytes(os.urandom(256))
    (run / "metrics.jsonl").write_text('{"step": 7, "loss": 0.5}\n')
    return ws


def _cases(ws):
    table = str(ws / "data" / "meta.csv")
    base = ["--config", DEMO, "--data-path", table, "--outputs", str(ws / "out")]
    return [
        (base + ["--config.optim.lrr=1"], "optim.lrr"),
        (base + ["--config.train.max_steps=abc"], "max_steps"),
        (base + ["--config.model.depth=two"], "model.depth"),
        (base + ["--config.model.num_heads=3"], "not divisible by num_heads 3"),
        (["--config", str(ws / "broken.py")], "does not load"),
        (["--config", str(ws / "missing.py")], "missing.py"),
        (["--data-path", table], "--config is required"),
        (base + ["--frobnicate"], "frobnicate"),
        (base + ["--config.mesh.data=16"], "16 devices"),
        (["--config", DEMO, "--data-path", str(ws / "empty.csv"), "--outputs", str(ws / "out")], "no rows"),
        (["--config", DEMO, "--data-path", str(ws / "nocols.csv"), "--outputs", str(ws / "out")], "lacks column"),
        (["--config", DEMO, "--data-path", str(ws / "none.csv")], "none.csv"),
        (base + ["--config.train.keep_ckpts=-1"], "train.keep_ckpts"),
        (base + ["--config.train.ckpt_every=0"], "train.ckpt_every"),
        (base + ["--config.train.log_every=0"], "train.log_every"),
        (base + ["--config.optim.lr=-1"], "optim.lr"),
        (base + ["--config.optim.warmup_steps=-5"], "optim.warmup_steps"),
        (base + ["--config.train.max_steps=-1"], "train.max_steps"),
        (base + ["--config.data.num_workers=-1"], "data.num_workers"),
        (base + ["--load", str(ws / "nowhere")], "--load"),
        (base + ["--load", str(ws / "data")], "checkpoint"),
        (base + ["--ckpt-path", str(ws / "weights.txt")], "unknown weights format"),
        (base + ["--ckpt-path", str(ws / "data")], "no jaxsora checkpoint"),
        (base + ["--step", "3"], "--step"),
        (base + ["--config.wandb.enabled=True", "--config.wandb.mode=bogus"], "wandb.mode"),
        (base + ["--profile", "abc"], "--profile"),
        (base + ["--config.mask_ratios.random=0.9", "--config.mask_ratios.image_head=0.9"], "mask_ratios"),
        (base + ["--start-from-scratch"], "--load"),
        # a run folder on a bucket would be written as a local folder named "gs:" (mount it instead)
        (base + ["--outputs", "gs://bucket/runs"], "not a URL"),
        (base + ["--run-dir", "s3://bucket/runs/001"], "not a URL"),
        (base + ["--config.train.outputs=gs://bucket/runs"], "not a URL"),
    ]


def _invoke(args, cwd):
    return subprocess.run([PYTHON, "-m", "jaxsora.train"] + args, env=ENV, capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def _assert_one_line(r, needle, what):
    err = r.stderr.strip()
    assert r.returncode == 2, (what, r.returncode, err[-3000:])
    assert "Traceback" not in err, (what, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, (what, lines[-20:])
    assert needle in lines[0], (what, lines[0])


@pytest.mark.slow
def test_bad_invocations_are_one_line_and_touch_nothing(workspace):
    run = workspace / "out" / "demo"
    before = _tree_digest(run)
    cases = _cases(workspace)
    with cf.ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda c: _invoke(c[0], str(workspace)), cases))
    for (args, needle), r in zip(cases, results):
        _assert_one_line(r, needle, args[-2:])
    after = _tree_digest(run)
    assert {k: v for k, v in after.items() if not k.startswith("table_index")} == before
    assert not (workspace / "gs:").exists() and not (workspace / "s3:").exists()


def test_debug_flag_shows_the_traceback(workspace):
    r = _invoke(["--config", DEMO, "--data-path", str(workspace / "none.csv"), "--debug"], str(workspace))
    assert r.returncode != 0 and "Traceback" in r.stderr and "none.csv" in r.stderr


def _fake_run(tmp, max_steps, extra=(), **kw):
    return subprocess.Popen([PYTHON, RUNNER, str(tmp), str(max_steps), "--mesh", "1,1,1", "--batch", "2",
                             *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _wait_for(proc, pattern, lines):
    for line in proc.stdout:
        lines.append(line)
        if pattern in line:
            return True
    return False


def test_two_runs_in_one_folder(tmp_path):
    """The second run refuses, naming the first; the first's checkpoints and metrics are its own;
    after the first is killed (-9), its stale lock is taken over by a resume."""
    first = _fake_run(tmp_path, 100000, ["--ckpt-every", "2"])
    lines = []
    try:
        assert _wait_for(first, "step      2", lines), "".join(lines)[-3000:]
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "checkpoints" / "2" / "integrity.json").exists():  # a finished save
            assert time.monotonic() < deadline
            time.sleep(0.2)
        info = json.load(open(tmp_path / "run" / "run.lock"))
        first_pid = command_pid(first)
        assert info["pid"] == first_pid and info["host"] == socket.gethostname()
        cfg = small_config(tmp_path, max_steps=3, mesh=(1, 1, 1))
        with pytest.raises(RunLockedError, match=f"pid {first_pid}"):
            train(cfg, RunOptions(run_dir=str(tmp_path / "run")),
                  loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, text_inputs=t))
    finally:
        kill(first)
        first.wait()
    steps = [json.loads(ln)["step"] for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # one run's lines only
    assert (tmp_path / "run" / "run.lock").exists()  # kill -9 leaves it behind
    cfg = small_config(tmp_path, max_steps=1, mesh=(1, 1, 1), ckpt_every=1000)
    res = train(cfg, RunOptions(load=str(tmp_path / "run")),
                loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, per_device_batch=2, text_inputs=t))
    assert res["steps"] >= 1 and not (tmp_path / "run" / "run.lock").exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen([PYTHON, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps(dict(host=socket.gethostname(), pid=dead.pid, start=0)))
    with RunLock(str(tmp_path)) as lock:
        assert json.load(open(lock.path))["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()
    assert "stale lock" in capsys.readouterr().err
    assert not (tmp_path / "run.lock").exists()


def test_watchdog_names_the_phase(tmp_path):
    """Unit: a stalled data wait is reported as the loader's, before any sample (min_seconds)."""
    log = open(tmp_path / "log.txt", "w+")
    dog = Watchdog(factor=10.0, min_seconds=1.0, poll=0.1, stream=log)
    dog.phase("data")
    time.sleep(1.6)
    dog.phase(None)
    dog.stop()
    log.flush()
    text = open(tmp_path / "log.txt").read()
    assert dog.dumps == ["data"] and "waiting for the loader's next batch" in text and "test_watchdog" in text


def test_frozen_loader_is_reported_by_the_watchdog(tmp_path):
    proc = _fake_run(tmp_path, 100000, ["--hang-at", "3", "--watchdog-min", "3"])
    lines = []
    try:
        found = _wait_for(proc, "stacks of every thread", lines)
        assert found, "".join(lines)[-3000:]
        rest = []
        deadline = time.monotonic() + 30
        for line in proc.stdout:  # the dump names the loader's frame
            rest.append(line)
            if "fake_loader.py" in line or time.monotonic() > deadline:
                break
    finally:
        proc.kill()
        proc.wait()
    text = "".join(lines + rest)
    assert "waiting for the loader's next batch" in text and "fake_loader.py" in text, text[-3000:]


def test_blown_up_update_is_rejected(tmp_path):
    """A finite loss whose update would blow the parameters up (lr 1e8) is not applied; the run stops
    naming the step-0 checkpoint, which holds the initial weights."""
    cfg = small_config(tmp_path, max_steps=20, ckpt_every=2, mesh=(1, 1, 1), max_nonfinite_steps=3)
    cfg.optim.update(dict(lr=1e8, warmup_steps=0, lr_schedule="constant"))
    with pytest.raises(NonFiniteError, match=r"Last good checkpoint: .*checkpoints/0\b"):
        train(cfg, RunOptions(run_dir=str(tmp_path / "run")),
              loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, text_inputs=t))
    lines = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert lines and all(ln["nonfinite_total"] >= 1 for ln in lines)
    assert np.isfinite(lines[-1]["loss"]) and lines[-1]["weight_norm"] < 1e3



@pytest.mark.slow
def test_sigterm_on_one_of_two_processes_stops_both_at_one_step(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([PYTHON, RUNNER, str(tmp_path), "100000", "--devices", "1", "--batch", "2",
                               "--ckpt-every", "1000"],
                              env={**ENV, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                   "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    lines = []
    try:
        assert _wait_for(procs[0], "step      3", lines), "".join(lines)[-3000:]
        procs[1].send_signal(signal.SIGTERM)  # only the second host is preempted
        outs = ["".join(lines) + procs[0].communicate(timeout=300)[0], procs[1].communicate(timeout=300)[0]]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    results = [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in outs]
    assert results[0]["steps"] == results[1]["steps"] and all(r["stopped_by_signal"] for r in results)
    saved = [int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit()]
    assert max(saved) == results[0]["steps"]


def test_loader_workers_answer_the_watchdog(workspace):
    """Grain workers register faulthandler for SIGUSR1, which is how the watchdog finds (SigCgt)
    and asks them for their stacks; a child without that handler is never signalled."""
    from jaxsora.data.loader import VideoLoader
    from jaxsora.train.run.supervise import _children_with_usr1_handler

    plain_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        loader = VideoLoader(str(workspace / "data" / "meta.csv"), {"demo32": {1: (1.0, 2), 8: (1.0, 2)}}, seed=0,
                             data_parallel_size=1, num_workers=1, progress=False,
                             extra_resolutions={"demo32": [("1.00", (32, 32))]})
        it = iter(loader)
        next(it)
        workers = _children_with_usr1_handler()
        assert workers and plain_child.pid not in workers
        it.close()
    finally:
        plain_child.kill()


def test_a_caption_at_the_token_limit_is_said_once(capsys):
    from jaxsora.models.t5 import ByteTokenizer
    from jaxsora.train.build import TextInputs

    inputs = TextInputs(tokenizer=ByteTokenizer(model_max_length=8))
    out = inputs(["short", "a caption far longer than eight tokens", "another long caption here"], [3, 4, 5])
    assert out["ids"].shape == (3, 8) and out["text_mask"][1].sum() == 8
    inputs(["yet another long caption"], [6])
    err = capsys.readouterr().err
    assert err.count("truncated") == 1 and "row 4" in err


@pytest.mark.slow
def test_nonfinite_stop_is_the_same_on_every_process(tmp_path):
    """Only process 1's rows go bad; the loss is a global mean, its metrics replicated: both processes
    reject the same steps and stop at the same step, naming the same checkpoint."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, RUNNER, str(tmp_path), "50", "--devices", "1", "--batch", "2",
                               "--ckpt-every", "2", "--nan-from", "3", "--nan-process", "1"],
                              env={**ENV, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                   "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    results = [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in outs]
    assert "nonfinite_stop" in results[0] and results[0] == results[1]
    assert "stopping at step 3" in results[0]["nonfinite_stop"] and "checkpoints/2" in results[0]["nonfinite_stop"]


def test_other_commands_report_user_errors_in_one_line(workspace):
    ws = str(workspace)
    cases = [
        (["jaxsora.sample", "--ckpt", f"{ws}/nowhere", "--prompt", "x"], "not found"),
        (["jaxsora.sample", "--ckpt", f"{ws}/data", "--prompt-file", f"{ws}/none.txt"], "none.txt"),
        (["jaxsora.convert", "to-torch", f"{ws}/nowhere", f"{ws}/x.safetensors"], "not found"),
        (["jaxsora.convert", "from-torch", f"{ws}/weights.txt", f"{ws}/o"], "unknown weights format"),
        (["jaxsora.ckpt", "verify", f"{ws}/data"], "no checkpoint"),
        (["jaxsora.tools.search_bs", "--config", DEMO, "--config.data.lrr=1"], "data.lrr"),
        (["data_tools.precompute", "--table", f"{ws}/none.csv", "--text-encoder", "{}", "--out", f"{ws}/c"],
         "none.csv"),
        (["data_tools.meta", "--input", f"{ws}/none.csv", "--output", f"{ws}/m.csv"], "none.csv"),
        (["data_tools.shard", "--input", f"{ws}/none.csv", "--num-shards", "2"], "none.csv"),
    ]

    def invoke(args):
        return subprocess.run([PYTHON, "-m", *args], env=ENV, capture_output=True, text=True, timeout=300,
                              cwd=REPO)

    with cf.ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda c: invoke(c[0]), cases))
    for (args, needle), r in zip(cases, results):
        _assert_one_line(r, needle, args[:2])


def test_epochs_set_the_length_of_the_run(tmp_path, capsys):
    """train.epochs = 2 over a 5-batch epoch: 10 steps (max_steps only a cap); the console line shows
    step k/N, epoch e/E and an ETA."""
    cfg = small_config(tmp_path, max_steps=1000, ckpt_every=1000, mesh=(1, 1, 1))
    cfg.train.epochs = 2
    res = train(cfg, RunOptions(), loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, text_inputs=t))
    assert res["steps"] == 10
    out = capsys.readouterr().out
    assert "step      9/10 |" in out and "epoch 1/2" in out and "ETA " in out
    capped = small_config(tmp_path / "capped", max_steps=7, ckpt_every=1000, mesh=(1, 1, 1))
    capped.train.epochs = 2
    res = train(capped, RunOptions(), loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp,
                                                                                  text_inputs=t))
    assert res["steps"] == 7
