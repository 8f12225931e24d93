"""Rectified flow vs the real Open-Sora 1.2 RFLOW (goldens: tests/fixtures/gen/rflow.py) and
invariants. The model is our STDiT3 with the reference tiny model's weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.diffusion import rflow
from jaxsora.models.presets import get_model_config
from tests.conftest import FIXTURES, rel_err

G = np.load(FIXTURES / "rflow_golden.npz")


@pytest.fixture(scope="module")
def model():
    sd = read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors"))
    return from_torch_state_dict(sd, get_model_config("tiny"))


def _full(v, n):
    return np.full(n, v, np.float32)


def test_timestep_transform_matches_reference():
    n = len(G["tt_t"])
    for (h, w, f), ref in zip(G["tt_settings"], G["tt_out"]):
        ours = np.asarray(rflow.timestep_transform(G["tt_t"], _full(h, n), _full(w, n), _full(f, n)))
        assert ours.shape == (n,) and ours.dtype == np.float32
        assert rel_err(ours, ref) <= 1e-5, (h, w, f)
    # the spec's worked examples of the ratio r (t = 500 → 1000·r/(1+r))
    for (h, w, f), r in [((240, 426, 51), 2.42), ((360, 640, 102), 5.14), ((512, 512, 1), 1.0), ((144, 256, 1), 0.375)]:
        t = float(rflow.timestep_transform(jnp.array([500.0]), h, w, f)[0])
        assert t == pytest.approx(1000 * r / (1 + r), rel=2e-3)


def test_sampling_schedules_match_reference():
    for (h, w, f), ref in zip(G["tt_settings"], G["sched_out"]):
        ours = np.asarray(rflow.sampling_timesteps(30, h, w, f))
        assert ours.shape == (30, 1)
        assert rel_err(ours[:, 0], ref) <= 1e-5, (h, w, f)
    plain = rflow.sampling_timesteps(30, 240, 426, 51, use_timestep_transform=False)[:, 0]
    assert rel_err(plain, G["sched_plain"]) <= 1e-6
    batched = rflow.sampling_timesteps(30, _full(240, 3), _full(426, 3), _full(51, 3))
    assert batched.shape == (30, 3) and rel_err(batched[:, 2], G["sched_out"][1]) <= 1e-5


def test_short_clips_never_nan():
    """The reference gives NaN at t = 1000 for 1 < frames < 17 (0 latent frames); ours counts such a
    clip as 1 latent frame, i.e. the image shift, and never exceeds 1000."""
    t = G["tt_t"]
    n = len(t)
    for f, ref in zip(G["nan_frames"], G["nan_out"]):
        assert np.isnan(ref[-1])  # the reference quirk is real
        ours = np.asarray(rflow.timestep_transform(t, _full(240, n), _full(426, n), _full(f, n)))
        assert np.isfinite(ours).all() and ours[-1] == 1000.0 and ours[0] == 0.0
        one_latent = rflow.timestep_transform(t, _full(240, n), _full(426, n), _full(1, n))  # image batch: n = 1
        np.testing.assert_allclose(ours, np.asarray(one_latent), rtol=1e-6)
    big = rflow.timestep_transform(jnp.array([1000.0, 999.99]), 2160.0, 3840.0, 408.0)
    assert float(big.max()) <= 1000.0


def test_logit_normal_and_sample_t():
    assert rel_err(rflow.logit_normal_t(G["ln_eps"]), G["ln_out"]) <= 1e-6
    assert rel_err(rflow.logit_normal_t(G["ln_eps"], loc=0.5, scale=1.5), G["ln_out_shift"]) <= 1e-6
    n = 20_000
    t = np.asarray(rflow.sample_t(jax.random.key(0), n))  # logit-normal(0, 1)
    assert t.min() > 0 and t.max() < 1000 and abs(np.median(t) - 500) < 15
    z = np.log(t / (1000 - t))  # back to the normal: mean 0, std 1
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    z2 = np.log((t2 := np.asarray(rflow.sample_t(jax.random.key(1), n, loc=0.5, scale=2.0))) / (1000 - t2))
    assert abs(z2.mean() - 0.5) < 0.06 and abs(z2.std() - 2) < 0.06
    u = np.asarray(rflow.sample_t(jax.random.key(2), n, sample_method="uniform"))
    assert u.min() >= 0 and u.max() < 1000 and abs(u.mean() - 500) < 10 and abs(u.std() - 1000 / 12**0.5) < 10
    with pytest.raises(ValueError, match="sample_method"):
        rflow.sample_t(jax.random.key(0), 2, sample_method="discrete")


def _cond(prefix):
    return dict(y=G[f"{prefix}_y"], mask=G[f"{prefix}_mask"], fps=G[f"{prefix}_fps"], height=G[f"{prefix}_h"],
                width=G[f"{prefix}_w"])


@pytest.mark.parametrize("with_mask", [False, True])
def test_training_loss_through_our_stdit3(model, with_mask):
    fn = nnx.jit(lambda m, x0, cond, noise, t, xm: rflow.training_loss_explicit(m, x0, cond, noise, t, x_mask=xm))
    xm = G["loss_x_mask"] if with_mask else None
    loss = fn(model, G["loss_x0"], _cond("loss"), G["loss_noise"], G["loss_t"], xm)
    ref = G["loss_xmask"] if with_mask else G["loss_plain"]
    assert loss.shape == (3,)
    assert rel_err(loss, ref) <= 1e-5


def _standin(w):
    """A pure-JAX stand-in model: velocity = tanh(w·x_t)·(1 + t/1000) + 0.1·fps, frames with
    x_mask False get an extra +3 (so a model that ignores x_mask would be caught); 2C channels."""
    def model_fn(x_t, t, *, fps, x_mask=None, **_):
        v = jnp.tanh(w * x_t) * (1 + t[:, None, None, None, None] / 1000) + 0.1 * fps[:, None, None, None, None]
        if x_mask is not None:
            v = v + 3.0 * (~x_mask)[:, None, :, None, None]
        return jnp.concatenate([v, -v], axis=1)
    return model_fn


def _numpy_loss(w, x0, noise, t, fps, x_mask=None):
    """The reference's training_losses written out independently in float64 numpy."""
    tau = (t / 1000.0)[:, None, None, None, None]
    x_t = (1 - tau) * x0 + tau * noise
    if x_mask is not None:
        x_t = np.where(x_mask[:, None, :, None, None], x_t, x0)
    v = np.tanh(w * x_t) * (1 + tau) + 0.1 * fps[:, None, None, None, None]
    if x_mask is not None:
        v = v + 3.0 * (~x_mask)[:, None, :, None, None]
    err = (v - (x0 - noise)) ** 2
    if x_mask is None:
        return err.mean(axis=(1, 2, 3, 4))
    b, c, tt, h, ww = err.shape
    per_frame = err.transpose(0, 2, 1, 3, 4).reshape(b, tt, -1).sum(-1)
    return (per_frame * x_mask).sum(1) / (x_mask.sum(1) * c * h * ww)


def test_training_loss_standin_vs_numpy():
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((3, 4, 5, 3, 2)).astype(np.float32)
    noise = rng.standard_normal(x0.shape).astype(np.float32)
    t = np.array([10.0, 400.0, 1000.0], np.float32)
    fps = np.array([24.0, 30.0, 120.0], np.float32)
    xm = np.array([[False, True, True, True, True], [True, False, True, False, True], [True] * 5])
    fn = _standin(0.7)
    for m in (None, xm):
        ours = rflow.training_loss_explicit(fn, x0, dict(fps=fps), noise, t, x_mask=m)
        assert rel_err(ours, _numpy_loss(0.7, x0.astype(np.float64), noise, t, fps, m)) <= 1e-6
    # an all-True mask equals no mask (as the reference's x_mask)
    allt = rflow.training_loss_explicit(fn, x0, dict(fps=fps), noise, t, x_mask=np.ones((3, 5), bool))
    np.testing.assert_allclose(allt, rflow.training_loss_explicit(fn, x0, dict(fps=fps), noise, t), rtol=1e-6)


def test_training_loss_keyed_draws_t_and_noise_from_the_key():
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((4, 4, 3, 4, 4)).astype(np.float32)
    fps = _full(24, 4)
    h, w, f = _full(240, 4), _full(426, 4), _full(51, 4)
    fn = _standin(0.5)
    xm = np.array([[False, True, True]] * 4)

    @jax.jit
    def run(key):
        loss = rflow.training_loss(fn, x0, dict(fps=fps), key, x_mask=xm, height=h, width=w, num_frames=f)
        # the documented draw: split(key) → (t, noise); t logit-normal then shifted
        k_t, k_n = jax.random.split(key)
        t = rflow.timestep_transform(rflow.sample_t(k_t, 4), h, w, f)
        by_hand = rflow.training_loss_explicit(fn, x0, dict(fps=fps), jax.random.normal(k_n, x0.shape), t, x_mask=xm)
        ev = rflow.eval_loss(fn, x0, dict(fps=fps), key)
        noise4 = jax.random.normal(jax.random.fold_in(key, 4), x0.shape)
        ev4 = rflow.training_loss_explicit(fn, x0, dict(fps=fps), noise4, jnp.full((4,), rflow.eval_timesteps()[4]))
        return loss, by_hand, ev, ev4

    (a, a_hand, ev, ev4), (b, *_), (c, *_) = (run(jax.random.key(k)) for k in (0, 0, 1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c)) and np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, a_hand, rtol=1e-6)
    assert ev.shape == (10, 4)
    np.testing.assert_allclose(ev[4], ev4, rtol=1e-6)


def test_eval_timesteps():
    t = rflow.eval_timesteps()
    assert len(t) == 10 and t[0] == pytest.approx(1000 / 11) and t[-1] == pytest.approx(10000 / 11)
    np.testing.assert_allclose(np.diff(t), 1000 / 11, rtol=1e-5)


def _null(model, y):
    return np.broadcast_to(np.asarray(model.y_embedder.y_embedding[...])[None, None], y.shape)


def test_cfg_sample_matches_reference(model):
    """5 steps, cfg 7, text masks of different lengths (the null caption keeps the prompt's mask)."""
    z = G["sample_z"]
    b = z.shape[0]
    cond = dict(y=G["sample_y"], mask=G["sample_mask"], fps=_full(24, b), height=_full(64, b), width=_full(64, b))
    out = rflow.sample(model, z, cond, _null(model, G["sample_y"]), key=jax.random.key(0), num_sampling_steps=5,
                       cfg_scale=7.0, height=cond["height"], width=cond["width"], num_frames=_full(17, b),
                       progress=False)
    assert out.shape == z.shape and out.dtype == jnp.float32
    assert rel_err(out, G["sample_out"]) <= 1e-4


def test_condition_frame_sample_matches_reference(model):
    """Edit mask [[0, 1, 0.5], [1, 1, 0]]: image-to-video, a partial edit and a kept last frame,
    with the re-noising draws the real loop made (step_noise)."""
    z, ref, edit = G["csample_z"], G["csample_ref"], G["csample_edit"]
    b = z.shape[0]
    h, w, f = (_full(v, b) for v in G["csample_hwf"])
    cond = dict(y=G["csample_y"], mask=G["csample_mask"], fps=_full(24, b), height=h, width=w)
    out = rflow.sample(model, z, cond, _null(model, G["csample_y"]), key=jax.random.key(0), num_sampling_steps=5,
                       cfg_scale=7.0, height=h, width=w, num_frames=f, mask=edit, x_cond=ref,
                       step_noise=G["csample_noise"], progress=False)
    assert rel_err(out, G["csample_out"]) <= 1e-4
    np.testing.assert_array_equal(np.asarray(out)[0, :, 0], ref[0, :, 0])  # condition frames unchanged
    np.testing.assert_array_equal(np.asarray(out)[1, :, 2], ref[1, :, 2])


def _numpy_sample(fn_np, z, ts, cfg, edit=None, ref=None, step_noise=None):
    """RFLOW.sample's loop written out in numpy (float64), for a numpy model fn_np(x, t, x_mask)."""
    z = z.astype(np.float64)
    b = len(z)
    if edit is not None:
        z = np.where((edit < 1)[:, None, :, None, None], ref, z)
        added = edit == 1
    for i, t in enumerate(ts):
        dt = (t - ts[i + 1] if i + 1 < len(ts) else t) / 1000
        xm = None
        if edit is not None:
            x0 = z.copy()
            up = edit * 1000 >= t[:, None]
            new = up & ~added
            tau = t[:, None, None, None, None] / 1000
            z = np.where(new[:, None, :, None, None], (1 - tau) * x0 + tau * step_noise[i], x0)
            added = up
            xm = np.concatenate([up, up])
        out = fn_np(np.concatenate([z, z]), np.concatenate([t, t]), xm)
        v = out[b:] + cfg * (out[:b] - out[b:])
        z = z + v * dt[:, None, None, None, None]
        if edit is not None:
            z = np.where(up[:, None, :, None, None], z, x0)
    return z


def test_sampler_plain_callable_vs_numpy_and_keyed_noise(capsys):
    """A stand-in model (y enters the velocity, so CFG matters) against the loop written in numpy;
    keyed re-noising: deterministic per key, condition frames kept, the edited frame depends on
    the key; a progress bar changes nothing."""
    rng = np.random.default_rng(2)
    b, steps = 2, 6
    z = rng.standard_normal((b, 4, 3, 2, 2)).astype(np.float32)
    ref = rng.standard_normal(z.shape).astype(np.float32)
    y = rng.standard_normal((b, 1, 5, 3)).astype(np.float32)
    null = rng.standard_normal((5, 3)).astype(np.float32)  # [L, D] broadcasts to y's shape
    edit = np.array([[0.0, 1.0, 0.5], [1.0, 0.3, 0.0]], np.float32)
    noise = rng.standard_normal((steps,) + z.shape).astype(np.float32)
    h, w, f = _full(240, b), _full(426, b), _full(51, b)

    def fn(x, t, *, y, mask, x_mask=None):
        s = jnp.sum(y * mask[:, None, :, None], axis=(1, 2, 3))[:, None, None, None, None]
        v = jnp.sin(x) * (1 + t[:, None, None, None, None] / 1000) - 0.05 * s
        if x_mask is not None:
            v = v + 2.0 * (~x_mask)[:, None, :, None, None]
        return jnp.concatenate([v, v * 0], 1)

    tmask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])

    def fn_np(x, t, xm):
        yy = np.concatenate([y, np.broadcast_to(null, y.shape)])
        s = np.sum(yy * np.concatenate([tmask, tmask])[:, None, :, None], axis=(1, 2, 3))[:, None, None, None, None]
        v = np.sin(x) * (1 + t[:, None, None, None, None] / 1000) - 0.05 * s
        return v + (2.0 * (~xm)[:, None, :, None, None] if xm is not None else 0)

    ts = np.asarray(rflow.sampling_timesteps(steps, h, w, f), np.float64)
    cond = dict(y=y, mask=tmask)
    kw = dict(num_sampling_steps=steps, cfg_scale=7.0, height=h, width=w, num_frames=f)
    plain = rflow.sample(fn, z, cond, null, key=None, progress=False, **kw)
    assert rel_err(plain, _numpy_sample(fn_np, z, ts, 7.0)) <= 1e-5
    edited = rflow.sample(fn, z, cond, null, key=None, mask=edit, x_cond=ref, step_noise=noise, progress=False, **kw)
    assert rel_err(edited, _numpy_sample(fn_np, z, ts, 7.0, edit, ref, noise)) <= 1e-5

    capsys.readouterr()
    run = jax.jit(lambda key: rflow.sample(fn, z, cond, null, key=key, mask=edit, x_cond=ref, progress=True, **kw))
    a, a2, c = (np.asarray(run(jax.random.key(k))) for k in (0, 0, 1))
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(a[0, :, 0], ref[0, :, 0])
    np.testing.assert_array_equal(a[1, :, 2], ref[1, :, 2])
    assert not np.allclose(a[0, :, 2], c[0, :, 2]) and np.array_equal(a[0, :, 0], c[0, :, 0])
    assert "sampling" not in capsys.readouterr().err  # inside the caller's jit: traced inline, no bar

    # Outside a jit the bar drives one compiled call per step: the same bits as one call for all steps.
    shown = rflow.sample(fn, z, cond, null, key=jax.random.key(0), mask=edit, x_cond=ref, progress=True, **kw)
    assert "sampling" in capsys.readouterr().err
    quiet = rflow.sample(fn, z, cond, null, key=jax.random.key(0), mask=edit, x_cond=ref, progress=False, **kw)
    np.testing.assert_array_equal(np.asarray(shown), np.asarray(quiet))
    assert rel_err(shown, a) <= 1e-6


def test_sampler_bar_steps_are_one_cached_program(model, capsys):
    """The progress bar calls the compiled steps once per step (host-driven): the result is the
    one-call result bit for bit, the program has no host callback (jax does not write programs with
    host callbacks to its persistent cache, so a bar inside the loop meant a full compile on every
    `python -m jaxsora.sample`), and every step reuses one executable."""
    z = G["sample_z"]
    b = z.shape[0]
    cond = dict(y=G["sample_y"], mask=G["sample_mask"], fps=_full(24, b), height=_full(64, b), width=_full(64, b))
    kw = dict(key=jax.random.key(0), num_sampling_steps=5, cfg_scale=7.0, height=cond["height"],
              width=cond["width"], num_frames=_full(17, b))
    null = _null(model, G["sample_y"])
    quiet = rflow.sample(model, z, cond, null, progress=False, **kw)
    before = rflow.programs().module_steps._cache_size()
    shown = rflow.sample(model, z, cond, null, progress=True, **kw)
    assert rflow.programs().module_steps._cache_size() == before  # no new program for the bar, none per step
    assert "sampling" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(shown), np.asarray(quiet))

    graphdef, state = nnx.split(model)
    carry, cond2 = rflow.sample_init(z, cond, null)
    ts = jnp.broadcast_to(rflow.sampling_timesteps(5, cond["height"], cond["width"], _full(17, b)), (5, b))
    hlo = rflow.programs().module_steps.lower(graphdef, state, carry, cond2, None, ts, None, None, jnp.float32(7), 0, 1)
    text = hlo.as_text()
    assert "while" in text and "callback" not in text.lower()
