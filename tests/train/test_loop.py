"""The training loop: exact resume (also after SIGKILL), resume modes, mesh changes, equal losses on
1 vs 8 devices and 1 vs 2 processes, SIGTERM, non-finite steps, config errors."""
import dataclasses
import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from jaxsora.train.run import setup as setup_lib
from jaxsora.train.run.loop import NonFiniteError, RunOptions, train
from tests.ports import free_port
from tests.train.common import CUT_LENGTHS, REPO, small_config
from tests.train.fake_loader import DataStateMismatch, FakeLoader
from tests.zygote import PYTHON, kill

RUNNER = os.path.join(os.path.dirname(__file__), "run_fake.py")


GLOBAL_BATCH = 4  # every run below uses it, so most compiles hit the persistent cache


def _run(cfg, opts=None, **loader_kw):
    def factory(c, dp, text_inputs):
        kw = dict(per_device_batch=GLOBAL_BATCH // dp)
        kw.update(loader_kw)
        return FakeLoader(data_parallel_size=dp, text_inputs=text_inputs, **kw)

    opts = opts or RunOptions()
    if opts.run_dir is None:  # these tests name their run folders <outputs>/<experiment> (no numbering)
        opts = dataclasses.replace(opts, run_dir=os.path.join(cfg.train.outputs, cfg.train.experiment))
    return train(cfg, opts, loader_factory=factory)


def _params(ckpt_dir, step=None):
    """Flat {path: array} of a checkpoint's params and EMA (read without a target)."""
    import orbax.checkpoint as ocp

    root = os.path.join(ckpt_dir, "checkpoints") if os.path.isdir(os.path.join(ckpt_dir, "checkpoints")) else ckpt_dir
    step = step if step is not None else max(int(d) for d in os.listdir(root) if d.isdigit())
    state = {}
    with ocp.StandardCheckpointer() as c:
        for item in ("params", "ema", "opt_state"):  # {field: subtree} each; step is in opt_state
            state.update(c.restore(os.path.join(root, str(step), item)))
    flat = {}
    for name in ("params", "ema", "step"):
        for path, v in jax.tree_util.tree_flatten_with_path(state[name])[0]:
            flat[(name,) + tuple(str(p) for p in path)] = np.asarray(v)
    return step, flat


def _json(ckpt_dir, step, item):
    with open(os.path.join(ckpt_dir, "checkpoints", str(step), item, "metadata")) as f:
        return json.load(f)


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """6 uninterrupted steps on one device; checkpoints every 3."""
    out = tmp_path_factory.mktemp("outputs")
    res = _run(small_config(out, max_steps=6, ckpt_every=3, mesh=(1, 1, 1), experiment="ref", text_lengths=CUT_LENGTHS))
    assert res["steps"] == 6 and np.isfinite(res["last_loss"])
    return out, res


def test_checkpoint_layout_and_contents(reference_run):
    out, _ = reference_run
    ckdir = os.path.join(out, "ref", "checkpoints")
    assert sorted(int(d) for d in os.listdir(ckdir) if d.isdigit()) == [0, 3, 6]  # start, every 3, end
    for item in ("params", "frozen", "ema", "opt_state", "config", "data", "meta"):
        assert os.path.isdir(os.path.join(ckdir, "6", item))
    data = _json(os.path.join(out, "ref"), 6, "data")
    assert data["epoch"] == 1 and data["index"] == 1  # 5 steps per epoch
    config = _json(os.path.join(out, "ref"), 6, "config")
    assert config["model"]["depth"] == 1 and config["optim"]["lr"] == 1e-3


def test_resume_after_sigkill_is_bit_exact(reference_run, tmp_path):
    out_ref, _ = reference_run
    env = {**os.environ, "PYTHONPATH": REPO}
    # The same XLA setup as this process (8 CPU devices, a 1-device mesh): bit-exact across processes.
    proc = subprocess.Popen([PYTHON, RUNNER, str(tmp_path), "1000", "--ckpt-every", "3", "--mesh", "1,1,1",
                             "--devices", "8", "--batch", str(GLOBAL_BATCH)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ck = tmp_path / "run" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (ck / "6" / "params").is_dir() and proc.poll() is None:
        time.sleep(0.2)
    kill(proc)
    proc.wait()
    steps = sorted(int(d) for d in os.listdir(ck) if d.isdigit())
    assert 3 in steps, proc.stdout.read()[-3000:]
    # resume from step 3 (drop anything later, as if the kill had come right after step 3's save)
    import shutil

    for s in steps:
        if s > 3:
            shutil.rmtree(ck / str(s))
    res = _run(small_config(tmp_path, max_steps=6, ckpt_every=3, mesh=(1, 1, 1), text_lengths=CUT_LENGTHS),
               RunOptions(load=str(tmp_path / "run")))
    assert res["steps"] == 6
    _assert_same(_params(str(out_ref / "ref"))[1], _params(str(tmp_path / "run"))[1])


def test_ckpt_path_loads_weights_only(reference_run, tmp_path):
    out_ref, _ = reference_run
    res = _run(small_config(tmp_path, max_steps=0, mesh=(1, 1, 1)),
               RunOptions(ckpt_path=str(out_ref / "ref" / "checkpoints")))
    assert res["steps"] == 0
    _, ref = _params(str(out_ref / "ref"))
    _, new = _params(str(tmp_path / "run"), step=0)
    for k, v in ref.items():
        if k[0] == "params":
            np.testing.assert_array_equal(v, new[k])
            np.testing.assert_array_equal(new[("ema",) + k[1:]], v)  # EMA restarts from the loaded weights
    assert int(new[("step",)]) == 0


def test_ckpt_path_from_pytorch_file(reference_run, tmp_path):
    from jaxsora.convert import native, save_torch_state_dict, to_torch_state_dict

    out_ref, _ = reference_run
    cfg, flat = native.load_weights(str(out_ref / "ref" / "checkpoints"))
    pth = tmp_path / "w.safetensors"
    save_torch_state_dict(to_torch_state_dict(flat, config=cfg), str(pth))
    _run(small_config(tmp_path, max_steps=0, mesh=(1, 1, 1)), RunOptions(ckpt_path=str(pth)))
    _, ref = _params(str(out_ref / "ref"))
    _, new = _params(str(tmp_path / "run"), step=0)
    for k, v in ref.items():
        if k[0] == "params":
            np.testing.assert_array_equal(v, new[k])


def test_load_start_from_scratch_restarts_data_only(reference_run, tmp_path):
    out_ref, _ = reference_run
    res = _run(small_config(tmp_path, max_steps=8, mesh=(1, 1, 1)),
               RunOptions(load=str(out_ref / "ref"), start_from_scratch=True))
    assert res["steps"] == 8  # the optimizer step count goes on from 6
    data = _json(str(tmp_path / "run"), 8, "data")
    assert (data["epoch"], data["index"]) == (0, 2)  # the data order restarted


def test_changed_data_refused_on_load(reference_run, tmp_path):
    out_ref, _ = reference_run
    with pytest.raises(DataStateMismatch):
        _run(small_config(tmp_path, max_steps=8, mesh=(1, 1, 1)), RunOptions(load=str(out_ref / "ref")),
             table_id="fake-v2")


def _logged_loss(run_dir, step):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return next(json.loads(ln)["loss"] for ln in f if json.loads(ln)["step"] == step)


def test_loss_on_8_devices_equals_1_device(reference_run, tmp_path):
    """data 2 × fsdp 2 × sequence 2 (Ulysses) on 8 devices vs the 1-device reference run."""
    out_ref, _ = reference_run
    _run(small_config(tmp_path, max_steps=2, mesh=(2, 2, 2), experiment="eight", text_lengths=CUT_LENGTHS))
    # Same global batch and keys; only float reduction order differs across devices. The step-2
    # loss is computed with the parameters after step 1, so it checks the sharded update too.
    # (Parameters themselves are not compared tightly: with Adam's eps = 1e-15, a near-zero gradient
    # turns reduction-order noise into a ±lr step.)
    for step in (1, 2):
        assert _logged_loss(tmp_path / "eight", step) == pytest.approx(_logged_loss(out_ref / "ref", step), rel=1e-5)


def test_captions_cut_to_their_valid_tokens_change_no_loss(reference_run, tmp_path, capsys, monkeypatch):
    """The reference run cuts its captions to 14 of 16 tokens (CUT_LENGTHS, tests/train/common.py):
    the same run at the full 16 gives the same losses, and the cut shape is what the reference ran."""
    out_ref, _ = reference_run
    _run(small_config(tmp_path, max_steps=2, mesh=(1, 1, 1), experiment="full"))  # the default: no text_lengths
    assert "captions of" not in capsys.readouterr().out  # nothing cut: every batch at the planned shape
    for step in (1, 2):
        assert _logged_loss(tmp_path / "full", step) == pytest.approx(_logged_loss(out_ref / "ref", step), rel=1e-6)
    # without the steps this process built (`setup_run` reuses them): the cut shape is compiled when met
    monkeypatch.setattr(setup_lib, "_STEPS", type(setup_lib._STEPS)())
    _run(small_config(tmp_path, max_steps=1, mesh=(1, 1, 1), experiment="cut", text_lengths=CUT_LENGTHS))
    assert "captions of 14 tokens" in capsys.readouterr().out  # the shape the reference run ran


def test_restore_on_another_mesh(reference_run, tmp_path):
    """Saved on one device, restored onto 8 (params FSDP-sharded, tokens sequence-sharded). The
    data-parallel size changes (1 → 4), so the data position cannot carry over: --start-from-scratch."""
    out_ref, _ = reference_run
    res = _run(small_config(tmp_path, max_steps=7, ckpt_every=100, mesh=(2, 2, 2)),
               RunOptions(load=str(out_ref / "ref"), start_from_scratch=True))
    assert res["steps"] == 7 and np.isfinite(res["last_loss"])
    with pytest.raises(DataStateMismatch):  # without it: refused, the data-parallel size changed
        _run(small_config(tmp_path, max_steps=7, mesh=(2, 2, 2), experiment="refused"),
             RunOptions(load=str(out_ref / "ref")))



@pytest.mark.slow
def test_two_processes_equal_one_process(reference_run, tmp_path):
    out_ref, _ = reference_run
    env = {**os.environ, "PYTHONPATH": REPO}
    port = free_port()
    procs = [subprocess.Popen([PYTHON, RUNNER, str(tmp_path / "multi"), "2", "--devices", "1",
                               "--batch", str(GLOBAL_BATCH)],
                              env={**env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                   "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    res = lambda s: json.loads(s.split("RESULT ", 1)[1].splitlines()[0])  # noqa: E731
    assert res(outs[0])["last_loss"] == pytest.approx(_logged_loss(out_ref / "ref", 2), rel=1e-5)
    # Process 0's rows hold 10 valid caption tokens, process 1's 13: both cut to 14 (one program), agreed
    # through the coordination service (alone, process 0 would have cut to 11).
    assert "captions of 14 tokens" in outs[0] and "captions of 11 tokens" not in outs[0]


def test_sigterm_saves_and_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([PYTHON, RUNNER, str(tmp_path), "100000", "--ckpt-every", "1000", "--mesh", "1,1,1",
                             "--devices", "8", "--batch", str(GLOBAL_BATCH)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step ") and "step      3" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["stopped_by_signal"] and result["steps"] >= 3
    steps = [int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit()]
    assert max(steps) == result["steps"]  # a final checkpoint at the step it stopped


def test_nonfinite_steps_are_skipped_then_stop(tmp_path):
    with pytest.raises(NonFiniteError, match="Last good checkpoint: .*checkpoints/2"):
        _run(small_config(tmp_path, max_steps=50, ckpt_every=2, mesh=(1, 1, 1), max_nonfinite_steps=3),
             nan_from_step=2)
    _, flat = _params(str(tmp_path / "run"))
    assert int(flat[("step",)]) == 2  # the NaN steps were not applied


def test_metrics_are_fetched_once_per_log_interval(tmp_path, monkeypatch):
    """No host sync per step: device → host transfers happen per log interval and per save."""
    calls = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (calls.append(1), real(x))[1])
    cfg = small_config(tmp_path, max_steps=12, ckpt_every=1000, mesh=(1, 1, 1))
    cfg.train.log_every = 4
    res = _run(cfg)
    assert res["steps"] == 12
    # the initial step, the start and end saves, 3 log intervals (the final fetch has nothing left)
    assert len(calls) <= 6, len(calls)
    lines = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert [ln["step"] for ln in lines] == [4, 8, 12]


def test_profile_flag_writes_a_trace(tmp_path):
    _run(small_config(tmp_path, max_steps=4, ckpt_every=100, mesh=(1, 1, 1)), RunOptions(profile="1:3"))
    traces = [f for _, _, fs in os.walk(tmp_path / "run" / "profile") for f in fs if f.endswith(".xplane.pb")]
    assert traces
