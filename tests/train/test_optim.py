"""The optimizer recipe: schedules equal their formulas (Open-Sora's and the Lambda fork's), AdamW with decoupled decay
equals a hand-written one, clipping, EMA, frozen parameters."""
import importlib
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base, stage2
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3
from jaxsora.train.step.optim import AdamW, ema_update, lr_schedule
from jaxsora.train.step.state import split_model

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_linear_warmup_formula():
    f = lr_schedule(dict(lr=1e-4, lr_schedule="linear_warmup", warmup_steps=1000))
    for k in (0, 1, 499, 998, 999, 1000, 5000):
        ref = 1e-4 * (k + 1) / 1001 if k < 1000 else 1e-4  # LinearWarmupLR at optimizer step k
        assert float(f(k)) == pytest.approx(ref, rel=1e-6)
    assert float(lr_schedule(stage2.get_config().optim)(0)) == pytest.approx(1e-4)  # stage 2: no scheduler


@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_one_cycle_formula(anneal):
    cfg = dict(lr=1.6e-4, lr_schedule="1cycle", min_lr=1.6e-5, max_lr=6.4e-4, warmup_steps=400, cooldown_steps=400,
               anneal_strategy=anneal)
    f = lr_schedule(cfg)
    lo, hi, fin, w, d = 1.6e-5, 6.4e-4, 1.6e-4, 400, 400
    for k in (0, 1, 100, 200, 399, 400, 401, 600, 799, 800, 2000):
        if anneal == "cos":
            ref = (hi + (lo - hi) / 2 * (math.cos(math.pi * k / w) + 1) if k < w
                   else fin + (hi - fin) / 2 * (math.cos(math.pi * (k - w) / d) + 1) if k < w + d else fin)
        else:
            ref = lo + (hi - lo) * k / w if k < w else hi + (fin - hi) * (k - w) / d if k < w + d else fin
        assert float(f(k)) == pytest.approx(ref, rel=1e-5), k
    assert float(f(0)) == pytest.approx(lo)  # construction steps once at k = 0 → min


@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_warmup_stable_decay_formula(anneal):
    cfg = dict(lr=2e-3, lr_schedule="warmup_stable_decay", warmup_steps=100, decay_start=1500, cooldown_steps=500,
               min_lr=2e-5, anneal_strategy=anneal)
    f = lr_schedule(cfg)
    hi, lo = 2e-3, 2e-5
    for k in (0, 50, 99, 100, 800, 1499, 1500, 1501, 1750, 1999, 2000, 2500):
        if k < 100:
            ref = hi * (k + 1) / 101  # as linear_warmup
        elif k < 1500:
            ref = hi
        elif k < 2000:
            frac = (k - 1500) / 500
            ref = hi + (lo - hi) * frac if anneal == "linear" else lo + (hi - lo) / 2 * (math.cos(math.pi * frac) + 1)
        else:
            ref = lo
        assert float(f(k)) == pytest.approx(ref, rel=1e-5), k
    # a decay_start inside the warm-up: the decay starts when the warm-up ends; no cooldown: min_lr from decay_start
    early = lr_schedule({**cfg, "decay_start": 50})
    assert float(early(99)) == pytest.approx(hi * 100 / 101) and float(early(100)) == pytest.approx(hi)
    assert float(early(600)) == pytest.approx(lo, rel=1e-5)
    sudden = lr_schedule({**cfg, "cooldown_steps": 0})
    assert float(sudden(1499)) == pytest.approx(hi) and float(sudden(1500)) == pytest.approx(lo, rel=1e-5)


def test_demo_decay_ends_with_the_run():
    """configs/demo.py decays the lr over the run's last quarter, also when --config.train.max_steps changes the
    run's length (optim.decay_start and cooldown_steps are references to it), also a run of a few steps (the
    tests' and the README walk's), and the flag's value reaches the printed config."""
    import subprocess
    import sys

    from configs import demo

    c = demo.get_config()
    assert (c.train.max_steps, c.optim.decay_start, c.optim.cooldown_steps) == (2000, 1500, 500)
    c.train.max_steps = 3000
    f = lr_schedule(c.optim)
    assert float(f(2249)) == pytest.approx(2e-3) and float(f(2999)) == pytest.approx(2e-5, rel=0.2)
    assert {k: c.to_dict()["optim"][k] for k in ("decay_start", "cooldown_steps")} == {
        "decay_start": 2250, "cooldown_steps": 750}  # what a run stores
    c.train.max_steps = 2
    assert float(lr_schedule(c.optim)(1)) == pytest.approx(2e-3 * 2 / 101)  # still warming up
    r = subprocess.run([sys.executable, "-m", "jaxsora.train", "--config", "configs/demo.py", "--dry-run",
                        "--config.train.max_steps=3000", "--data-path", "no-such-table.csv"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "optim.decay_start = 2250" in r.stdout, r.stdout + r.stderr


def test_lambda_stage_configs():
    for i, (lr, sched) in enumerate([(1.6e-4, "linear_warmup"), (1.6e-4, "linear_warmup"), (2e-4, "linear_warmup"),
                                     (1.6e-4, "1cycle"), (1.6e-4, "1cycle"), (0.8e-4, "1cycle"),
                                     (0.8e-4, "1cycle")], start=1):
        c = importlib.import_module(f"configs.lambda.stage{i}").get_config()
        assert (c.optim.lr, c.optim.lr_schedule, c.optim.weight_decay) == (lr, sched, 0.01), i
        if i >= 4:
            assert dict(c.mask_ratios) == {"random": 0.0}
    assert base.get_config().optim.eps == 1e-15 and base.get_config().optim.ema_decay == 0.99


def test_adamw_equals_hand_written():
    cfg = dict(lr=1e-3, lr_schedule="constant", weight_decay=0.01, eps=1e-15, grad_clip=0.0)
    tx = AdamW.from_config(cfg).tx()
    rng = np.random.default_rng(0)
    p = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(3)]
    state, cur = tx.init(jnp.asarray(p)), jnp.asarray(p)
    m = v = np.zeros(5)
    ref = p.astype(np.float64)
    for k, g in enumerate(grads, start=1):
        upd, state = tx.update(jnp.asarray(g), state, cur)
        cur = cur + upd
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g.astype(np.float64) ** 2
        mh, vh = m / (1 - 0.9**k), v / (1 - 0.999**k)
        ref = ref - 1e-3 * (mh / (np.sqrt(vh) + 1e-15) + 0.01 * ref)  # decoupled decay (torch AdamW / HybridAdam)
    np.testing.assert_allclose(np.asarray(cur), ref, rtol=1e-5, atol=1e-7)


def test_global_norm_clipping():
    tx = AdamW.from_config(dict(lr=1.0, lr_schedule="constant", grad_clip=1.0, weight_decay=0.0)).tx()
    g = {"a": jnp.full((4,), 3.0), "b": jnp.full((4,), 4.0)}  # global norm 10
    params = jax.tree.map(jnp.zeros_like, g)
    # the first Adam step is ±lr·sign(g) whatever the scale: check the clip through the moments
    st = tx.init(params)
    _, st = tx.update(g, st, params)
    mu = st[1][0].mu
    np.testing.assert_allclose(np.asarray(mu["a"]), 0.1 * 3.0 / 10.0, rtol=1e-6)


def test_ema_and_frozen_parameters():
    e = {"w": jnp.ones(3)}
    p = {"w": jnp.zeros(3)}
    np.testing.assert_allclose(np.asarray(ema_update(e, p, 0.99)["w"]), 0.99)
    model = STDiT3(get_model_config("tiny", freeze_y_embedder=True), rngs=nnx.Rngs(0))
    _, trainable, frozen = split_model(model)
    paths = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(trainable)}
    frozen_paths = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(frozen)}
    assert not any("y_proj" in k for k in paths)  # freeze_y_embedder
    assert {"y_embedder.y_proj.fc1.kernel", "rope.freqs", "y_embedder.y_embedding"} <= frozen_paths


def _reference_update(opt, grads, opt_state, params, ema, accept, max_norm_growth):
    """What AdamW.update must equal: optax's chain, apply_updates and ema_update, then the selection."""
    grad_norm = optax.tree.norm(grads)
    updates, new_state = opt.tx().update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    new_norm, old_norm = optax.tree.norm(new), optax.tree.norm(params)
    growth = new_norm / old_norm if max_norm_growth > 0 else jnp.float32(1)
    ok = accept & jnp.isfinite(grad_norm)
    if max_norm_growth > 0:
        ok = ok & jnp.isfinite(new_norm) & (growth <= max_norm_growth)

    def keep(a, b):
        return jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)
    return (keep(new, params), keep(new_state, opt_state), keep(ema_update(ema, new, 0.9), ema),
            jnp.where(ok, new_norm, old_norm), growth, ok)


@pytest.mark.parametrize("cfg", [
    dict(lr=1e-3, lr_schedule="linear_warmup", warmup_steps=3, weight_decay=0.01, grad_clip=1.0),
    dict(lr=2e-3, lr_schedule="constant", weight_decay=0.0, grad_clip=0.0, betas=(0.8, 0.99), eps=1e-8),
])
@pytest.mark.parametrize("guard", [0.0, 2.0])
def test_fused_update_equals_optax(cfg, guard):
    """AdamW.update (the train step's) against the optax chain it is written from, step after step: clipped
    or not, with decay and a warmup schedule or not, accepted steps, a non-finite loss and (with the growth
    check) a step that would grow the parameters' norm past the limit — both rejected, the state kept."""
    opt = AdamW.from_config(cfg)
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((37, 11)), jnp.float32), "b": {"c": jnp.zeros((5,))}}
    state, ema = opt.tx().init(params), jax.tree.map(jnp.copy, params)
    fused = jax.jit(lambda g, s, p, e, a: opt.update(g, optax.tree.norm(g), s, p, e, ema_decay=0.9, accept=a,
                                                       max_norm_growth=guard))
    reference = jax.jit(lambda g, s, p, e, a: _reference_update(opt, g, s, p, e, a, guard))
    small = 0.5 if cfg["grad_clip"] else 0.05  # below and above the clip
    verdicts = []
    for k, (scale, accept) in enumerate([(small, True), (3.0, True), (small, False), (small, True), (1.0, True)]):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) * scale, params)
        if k == 4 and guard:  # a tiny parameter norm: one Adam step (±lr a coordinate) more than doubles it
            params = jax.tree.map(lambda p: p * 1e-5, params)
        got = fused(grads, state, params, ema, jnp.asarray(accept))
        want = reference(grads, state, params, ema, jnp.asarray(accept))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-9)
        params, state, ema = got[:3]
        verdicts.append(bool(got[5]))
    assert verdicts == [True, True, False, True, not guard]
    assert int(state[-1].count if not cfg["grad_clip"] else state[1][-1].count) == 3 + (not guard)


def test_fused_update_writes_each_array_once():
    """The structure `AdamW.update` is written for (lesson: a path invisible in the numbers needs a look at the
    program). In the compiled XLA:CPU update, with the state donated as the train step donates it, an array of a
    parameter's shape is written 5 times with the growth check — the candidate, then the parameter, both moments
    and the EMA — and 4 without; no copy of a moment (optax's chain and the selections: 8 — the clipped
    gradients, both new moments and the candidate written besides)."""
    opt = AdamW.from_config(dict(lr=1e-3, lr_schedule="constant", weight_decay=0.01, grad_clip=1.0))
    rng = np.random.default_rng(0)

    def tree():  # 384×384: large enough that XLA:CPU reduces the norms without writing the squares
        return {"a": jnp.asarray(rng.standard_normal((384, 384)), jnp.float32), "b": jnp.ones((29, 13))}

    params = tree()
    state = opt.tx().init(params)

    def written(guard):
        fn = jax.jit(lambda p, s, e, g, ok: opt.update(g, optax.tree.norm(g), s, p, e, ema_decay=0.9, accept=ok,
                                                       max_norm_growth=guard), donate_argnums=(0, 1, 2))
        hlo = fn.lower(params, state, tree(), tree(), jnp.bool_(True)).compile().as_text()
        entry = hlo[hlo.index("\nENTRY"):]
        return re.findall(r"= f32\[384,384\]\{[0-9,]*\} (?!parameter|bitcast|get-tuple-element)(\S+)", entry)
    with_check, without = written(2.0), written(0.0)
    assert (len(with_check), len(without)) == (5, 4), (with_check, without)
    assert not any(op.startswith("copy(") for op in with_check + without)
