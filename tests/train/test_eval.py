"""The validation loss (`jaxsora.train.eval.loss`) and the throughput metrics of the log line: the eval is
deterministic (twice, after a resume, on another mesh), independent of the train step and RNG,
equal to a direct computation with `rflow.training_loss_explicit`, logged per bucket (eval.jsonl,
wandb, console); MFU, data-wait share and per-bucket step times in metrics.jsonl."""
import dataclasses
import json
import os
import pathlib
import sys
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_tools.synthetic import generate
from jaxsora.data.video import to_model_range
from jaxsora.diffusion import rflow
from jaxsora.train.eval import loss as eval_lib
from jaxsora.train.plan.mfu import device_peak_flops, forward_flops
from jaxsora.train.run.loop import RunOptions, train
from jaxsora.train.run.setup import fresh_state, setup_run
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 4  # as test_loop.py: the train step compiles hit the persistent cache
EVAL_BUCKETS = {"demo32": {1: (1.0, 2), 8: (1.0, 2)}}
NUM_T = 3


@pytest.fixture(scope="module")
def eval_table(tmp_path_factory):
    """6 clips (12 or 20 frames) and 3 images of three sizes: 3 rows in demo32_1, 6 in demo32_8."""
    out = tmp_path_factory.mktemp("evaldata")
    generate(str(out), num_videos=6, num_images=3, sizes=[(32, 32), (24, 40), (40, 24)], frames=[12, 20], fps=8,
             seed=0, progress=False)
    return str(out / "meta.csv")


def _config(outputs, table, *, mesh=(1, 1, 1), **train_kw):
    c = small_config(outputs, mesh=mesh, **train_kw)
    c.eval.update(dict(table=table, every=3, num_timesteps=NUM_T, decode_threads=1))
    c.eval.bucket_config = EVAL_BUCKETS
    return c


def _run(cfg, opts=None):
    def factory(c, dp, text_inputs):
        return FakeLoader(data_parallel_size=dp, text_inputs=text_inputs, per_device_batch=GLOBAL_BATCH // dp)

    opts = opts or RunOptions()
    if opts.run_dir is None:  # these tests name their run folders <outputs>/<experiment> (no numbering)
        opts = dataclasses.replace(opts, run_dir=os.path.join(cfg.train.outputs, cfg.train.experiment))
    return train(cfg, opts, loader_factory=factory)


def _lines(path):
    with open(path) as f:
        return [json.loads(ln) for ln in f]


class _FakeWandbRun:
    id = "fake-run"

    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        pass


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, eval_table):
    """6 steps, eval every 3, checkpoints every 3, wandb replaced by a recorder."""
    out = tmp_path_factory.mktemp("outputs")
    run = _FakeWandbRun()
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: run
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = fake
    try:
        cfg = _config(out, eval_table, max_steps=6, ckpt_every=3)
        cfg.wandb.update(dict(enabled=True, mode="offline"))
        res = _run(cfg)
    finally:
        if saved is not None:
            sys.modules["wandb"] = saved
        else:
            del sys.modules["wandb"]
    return out / "run", res, run


def test_eval_logged_per_bucket(eval_run, capsys):
    run_dir, res, wandb_run = eval_run
    lines = _lines(run_dir / "eval.jsonl")
    assert [ln["step"] for ln in lines] == [3, 6]  # every 3; the end (6) is not evaluated twice
    for ln in lines:
        assert ln["eval/samples/demo32_1"] == 3 and ln["eval/samples/demo32_8"] == 6
        per_bucket = [ln["eval/loss/demo32_1"], ln["eval/loss/demo32_8"]]
        assert all(np.isfinite(per_bucket))
        assert ln["eval/loss"] == pytest.approx(np.mean(per_bucket), rel=1e-12)
        assert len(ln["eval/loss_by_t/demo32_8"]) == NUM_T
        assert ln["eval/loss/demo32_8"] == pytest.approx(np.mean(ln["eval/loss_by_t/demo32_8"]), rel=1e-12)
        assert ln["eval/weights"] == "params" and ln["eval/skipped"] == 0
    assert res["eval"]["eval/loss"] == lines[-1]["eval/loss"]
    # wandb got the same numbers at the eval steps (lists stay in eval.jsonl)
    evals = [(s, d) for s, d in wandb_run.logged if "eval/loss" in d]
    assert [s for s, _ in evals] == [3, 6]
    assert evals[1][1]["eval/loss/demo32_8"] == lines[1]["eval/loss/demo32_8"]
    assert not any(k.startswith("eval/loss_by_t") for _, d in evals for k in d)
    # the train lines go on in metrics.jsonl, without eval keys
    assert [ln["step"] for ln in _lines(run_dir / "metrics.jsonl")] == list(range(1, 7))


def test_eval_after_resume_is_identical(eval_run, tmp_path, eval_table):
    run_dir, _, _ = eval_run
    res = _run(_config(tmp_path, eval_table, max_steps=6, ckpt_every=3), RunOptions(load=str(run_dir), step=3))
    assert res["steps"] == 6
    ref = next(ln for ln in _lines(run_dir / "eval.jsonl") if ln["step"] == 6)
    got = _lines(tmp_path / "run" / "eval.jsonl")
    assert [ln["step"] for ln in got] == [6]
    for k, v in ref.items():
        if k.startswith("eval/loss") or k.startswith("eval/samples"):
            assert got[0][k] == v, k  # bitwise: the same weights, noise and batches


def test_throughput_fields(eval_run, tmp_path, eval_table):
    """CPU without train.peak_flops: no MFU; the rest is there. With a peak: MFU = tflops / peak."""
    run_dir, _, wandb_run = eval_run
    for ln in _lines(run_dir / "metrics.jsonl"):
        assert "mfu" not in ln
        assert 0.0 <= ln["data_share"] <= 1.0
        assert ln["tflops_per_device"] > 0
        assert ln["time/fake_4x16x16"] > 0
    assert "time/fake_4x16x16" in wandb_run.logged[0][1]
    cfg = small_config(tmp_path, max_steps=2, ckpt_every=100, mesh=(1, 1, 1), peak_flops=1e12)
    _run(cfg)
    lines = _lines(tmp_path / "run" / "metrics.jsonl")
    for ln in lines:
        assert ln["mfu"] == pytest.approx(ln["tflops_per_device"] * 1e12 / 1e12, rel=1e-9)
        assert ln["time/fake_4x16x16"] > 0 and "data_share" in ln


def test_peak_table_and_flops():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert device_peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert device_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert device_peak_flops("cpu", "float32") is None
    assert device_peak_flops("NVIDIA GeForce RTX 4090", "bfloat16") is None
    from jaxsora.models.presets import get_model_config

    xl = get_model_config("STDiT3-XL/2")
    # XL/2 at 240p × 51 frames (15×30×53 latents → 6075 tokens), 300 caption tokens: 56 blocks of
    # 28·N·C² ≈ 2.3e11 plus attention, ≈ 1.35e13 forward FLOPs per sample (bench/step.py uses this count)
    assert forward_flops(xl, (15, 30, 53), 300) == 13534439731200.0
    assert 1.3e13 < forward_flops(xl, (15, 30, 53), 300) < 1.4e13


# --------------------------------------------------------------------------------------------
# the evaluator itself, outside the loop
# --------------------------------------------------------------------------------------------
def _evaluator(tmp_path, table, mesh=(1, 1, 1)):
    cfg = _config(tmp_path, table, mesh=mesh)
    setup = setup_run(cfg)
    ev = eval_lib.build_evaluator(cfg, setup, str(tmp_path))
    return setup, ev


@pytest.fixture(scope="module")
def direct(tmp_path_factory, eval_table):
    tmp = tmp_path_factory.mktemp("direct")
    setup, ev = _evaluator(tmp, eval_table)
    with jax.set_mesh(setup.mesh):
        state = fresh_state(setup)
        result = ev.evaluate(state)
    return setup, ev, state, result


def test_eval_independent_of_train_step_and_rng(direct):
    setup, ev, state, result = direct
    other = state.replace(step=state.step + 1234, rng=jax.random.key_data(jax.random.key(99)))
    with jax.set_mesh(setup.mesh):
        again = ev.evaluate(state)
        moved = ev.evaluate(other)
    losses = {k: v for k, v in result.items() if k.startswith("eval/loss")}
    assert losses == {k: v for k, v in again.items() if k.startswith("eval/loss")}  # twice: bitwise
    assert losses == {k: v for k, v in moved.items() if k.startswith("eval/loss")}
    assert moved["step"] == 1234
    # the EMA path: a fresh state's EMA is a copy of the params
    ema = eval_lib.Evaluator(setup, ev.data, num_timesteps=NUM_T, use_ema=True)
    with jax.set_mesh(setup.mesh):
        got = ema.evaluate(state)
    assert got["eval/weights"] == "ema" and got["eval/loss"] == result["eval/loss"]


def test_eval_equals_direct_computation(direct):
    """Σ over t of rflow.training_loss_explicit at the fixed t with the documented noise keys."""
    setup, ev, state, result = direct
    enc = setup.encoders
    model = nnx.merge(setup.plan.graphdef, state.params, state.frozen)
    loss_fn = jax.jit(lambda x0, cond, noise, t: rflow.training_loss_explicit(model, x0, cond, noise, t))
    ts = np.linspace(0, 1000, NUM_T + 2, dtype=np.float32)[1:-1]
    sums: dict = {}
    for b, host in ev.data:
        video = to_model_range(jnp.asarray(host["video"]))
        x0 = enc.encode_video(enc.weights, video, None).astype(jnp.float32)  # identity VAE: no key
        y = enc.encode_text(enc.weights, jnp.asarray(host["ids"]), jnp.asarray(host["text_mask"]))[:, None]
        cond = dict(y=y, mask=jnp.asarray(host["text_mask"]), fps=jnp.asarray(host["fps"]),
                    height=jnp.asarray(host["height"]), width=jnp.asarray(host["width"]))
        code = zlib.crc32(b.name.encode()) & 0x7FFFFFFF
        per_t = []
        for i, t in enumerate(ts):
            keys = [jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
                jax.random.fold_in(jax.random.key(42), 1), code), int(r)), i) for r in host["row"]]
            noise = jnp.stack([jax.random.normal(k, x0.shape[1:], jnp.float32) for k in keys])
            loss = loss_fn(x0, cond, noise, jnp.full((x0.shape[0],), t))
            per_t.append(float(jnp.sum(loss * host["weight"])))
        s, c = sums.get(b.name, (np.zeros(NUM_T), 0.0))
        sums[b.name] = (s + np.array(per_t), c + float(host["weight"].sum()))
    assert sorted(sums) == ["demo32_1", "demo32_8"]
    for name, (s, c) in sums.items():
        assert result[f"eval/loss/{name}"] == pytest.approx(float(np.mean(s / c)), rel=1e-5)
    assert rflow.eval_timesteps(NUM_T) == pytest.approx(ts)


def test_eval_same_on_another_mesh(direct, tmp_path, eval_table):
    """Data parallel 2 (global batch 4, other padding): the same rows and noise, the same loss."""
    _, _, _, result = direct
    setup, ev = _evaluator(tmp_path, eval_table, mesh=(2, 1, 1))
    assert [len(b.rows) for b in ev.data.plan] == [4, 4, 4]  # 3 images + 6 clips in batches of 4, padded
    with jax.set_mesh(setup.mesh):
        got = ev.evaluate(fresh_state(setup))
    for name in ("demo32_1", "demo32_8"):
        assert got[f"eval/samples/{name}"] == result[f"eval/samples/{name}"]
        assert got[f"eval/loss/{name}"] == pytest.approx(result[f"eval/loss/{name}"], rel=1e-5)


def test_eval_plan_padding_cap_and_overlap():
    # rows: a 20-frame 64×64 clip fits demo32_8 and demo64_8; an image fits demo32_1 only; a 6-frame
    # clip fits no 8-frame bucket.
    sizes = (np.array([20, 1, 6, 12, 12]), np.array([64, 32, 32, 32, 32]), np.array([64, 32, 32, 32, 32]))
    extra = {"demo32": [("1.00", (32, 32))], "demo64": [("1.00", (64, 64))]}
    cfg = {"demo32": {1: (1.0, 1), 8: (1.0, 2)}, "demo64": {8: (1.0, 1)}}
    plan = eval_lib.eval_plan(sizes, cfg, dp=1, extra_resolutions=extra)
    got = [(b.name, b.rows.tolist(), b.real, b.size) for b in plan]
    assert got == [("demo32_1", [1], 1, (1, 32, 32)), ("demo32_8", [0, 3], 2, (8, 32, 32)),
                   ("demo32_8", [4, 4], 1, (8, 32, 32)), ("demo64_8", [0], 1, (8, 64, 64))]
    capped = eval_lib.eval_plan(sizes, cfg, dp=1, extra_resolutions=extra, max_batches_per_bucket=1)
    assert [(b.name, b.index) for b in capped] == [("demo32_1", 0), ("demo32_8", 0), ("demo64_8", 0)]
    summary = eval_lib.summarize({"a": (np.array([2.0, 4.0]), 2.0), "b": (np.zeros(2), 0.0)}, step=5, seconds=1.0)
    assert summary["eval/loss/a"] == 1.5 and summary["eval/loss"] == 1.5 and "eval/loss/b" not in summary


def test_dry_run_shows_the_eval_plan(tmp_path, eval_table, capsys):
    res = _run(_config(tmp_path, eval_table), RunOptions(dry_run=True))
    assert sorted((name, gb) for name, _, gb, _ in res["eval"]) == [("demo32_1", 2), ("demo32_8", 2)]
    out = capsys.readouterr().out
    assert "eval plan (5 batches × 3 timesteps): demo32_1 3 rows in 2 batches, demo32_8 6 rows in 3 batches" in out


def test_eval_config_errors(tmp_path, eval_table):
    from jaxsora.config import ConfigError

    cfg = _config(tmp_path, str(tmp_path / "missing.csv"))
    with pytest.raises(ConfigError, match="eval.table"):
        _run(cfg)
    cfg = _config(tmp_path, eval_table)
    cfg.eval.bucket_config = {"nope": {1: (1.0, 2)}}
    with pytest.raises(ConfigError, match="eval.bucket_config"):
        _run(cfg)
