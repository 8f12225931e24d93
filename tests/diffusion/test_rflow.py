"""Rectified flow vs the real Open-Sora 1.2 RFLOW (goldens: tests/fixtures/gen/rflow.py)."""
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


def test_timestep_transform_matches_reference():
    for (h, w, f), ref in zip(G["tt_settings"], G["tt_out"]):
        n = len(G["tt_t"])
        ours = rflow.timestep_transform(G["tt_t"], np.full(n, h), np.full(n, w), np.full(n, f))
        assert rel_err(ours, ref) <= 1e-5, (h, w, f)


def test_sampling_schedules_match_reference():
    for (h, w, f), ref in zip(G["tt_settings"], G["sched_out"]):
        ours = rflow.sampling_timesteps(30, h, w, f)[:, 0]
        assert rel_err(ours, ref) <= 1e-5, (h, w, f)
    plain = rflow.sampling_timesteps(30, 240, 426, 51, use_timestep_transform=False)[:, 0]
    assert rel_err(plain, G["sched_plain"]) <= 1e-6


def test_logit_normal_matches_reference():
    assert rel_err(rflow.logit_normal_t(G["ln_eps"]), G["ln_out"]) <= 1e-6
    assert rel_err(rflow.logit_normal_t(G["ln_eps"], loc=0.5, scale=1.5), G["ln_out_shift"]) <= 1e-6


def test_transform_never_nan_for_short_clips():
    # The reference gives NaN at t = 1000 for 1 < frames < 17 (0 latent frames); ours treats such
    # a clip as 1 latent frame.
    t = jnp.array([0.0, 500.0, 1000.0])
    for f in (2, 5, 16):
        out = rflow.timestep_transform(t, jnp.full(3, 240.0), jnp.full(3, 426.0), jnp.full(3, float(f)))
        assert np.isfinite(np.asarray(out)).all()
        ref_1frame_ratio = rflow.timestep_transform(t, jnp.full(3, 240.0), jnp.full(3, 426.0), jnp.full(3, 17.0))
        assert np.all(np.asarray(out) <= np.asarray(ref_1frame_ratio) + 1e-3)
        assert float(out[-1]) == pytest.approx(1000.0)


def _cond(prefix):
    return dict(y=G[f"{prefix}_y"], mask=G[f"{prefix}_mask"], fps=G[f"{prefix}_fps"], height=G[f"{prefix}_h"],
                width=G[f"{prefix}_w"])


@pytest.mark.parametrize("with_mask", [False, True])
def test_training_loss_through_our_stdit3(model, with_mask):
    fn = nnx.jit(lambda m, x0, cond, noise, t, xm: rflow.training_loss_explicit(
        lambda x_t, t_, **c: m(x_t, t_, **c), x0, cond, noise, t, x_mask=xm))
    xm = G["loss_x_mask"] if with_mask else None
    loss = fn(model, G["loss_x0"], _cond("loss"), G["loss_noise"], G["loss_t"], xm)
    ref = G["loss_xmask"] if with_mask else G["loss_plain"]
    assert loss.shape == (3,)
    assert rel_err(loss, ref) <= 1e-5


def test_training_loss_keyed_is_deterministic_and_finite(model):
    cond = _cond("loss")
    f = nnx.jit(lambda m, key: rflow.training_loss(
        lambda x_t, t_, **c: m(x_t, t_, **c), G["loss_x0"], cond, key, height=G["loss_h"], width=G["loss_w"],
        num_frames=jnp.full(3, 51.0)))
    a, b, c = f(model, jax.random.key(0)), f(model, jax.random.key(0)), f(model, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c)) and np.isfinite(np.asarray(a)).all()


def test_masked_loss_ignores_condition_frames():
    x0 = jnp.ones((1, 2, 3, 2, 2))
    noise = jnp.zeros_like(x0)
    xm = jnp.array([[True, False, True]])

    def model_fn(x_t, t, **kw):  # perfect on frames 0 and 2, wrong by 5 on frame 1
        return jnp.concatenate([x0.at[:, :, 1].add(5.0)] * 2, axis=1)

    loss = rflow.training_loss_explicit(model_fn, x0, {}, noise, jnp.array([500.0]), x_mask=xm)
    assert float(loss[0]) == 0.0
    full = rflow.training_loss_explicit(model_fn, x0, {}, noise, jnp.array([500.0]))
    assert float(full[0]) == pytest.approx(25.0 / 3)


def test_cfg_sample_matches_reference(model):
    z = G["sample_z"]
    b = z.shape[0]
    null = np.broadcast_to(np.asarray(model.y_embedder.y_embedding[...])[None, None], G["sample_y"].shape)
    cond = dict(y=G["sample_y"], mask=G["sample_mask"], fps=np.full(b, 24.0, np.float32),
                height=np.full(b, 64.0, np.float32), width=np.full(b, 64.0, np.float32))
    out = nnx.jit(lambda m, z, cond, null: rflow.sample(
        lambda x, t, **c: m(x, t, **c), z, cond, null, key=jax.random.key(0), num_sampling_steps=5, cfg_scale=7.0,
        height=cond["height"], width=cond["width"], num_frames=np.full(b, 17.0), progress=False))(model, z, cond, null)
    assert rel_err(out, G["sample_out"]) <= 1e-4


def test_condition_frames_are_kept(model):
    """Image-to-video: frame 0 of the reference latents survives sampling unchanged."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((1, 4, 3, 8, 8)).astype(np.float32)
    ref = rng.standard_normal((1, 4, 3, 8, 8)).astype(np.float32)
    y = rng.standard_normal((1, 1, 8, 32)).astype(np.float32)
    cond = dict(y=y, mask=np.ones((1, 8), np.int64), fps=np.full(1, 24.0, np.float32))
    null = np.broadcast_to(np.asarray(model.y_embedder.y_embedding[...])[None, None], y.shape)
    edit = np.array([[0.0, 1.0, 1.0]], np.float32)
    out = rflow.sample(lambda x, t, **c: model(x, t, **c), z, cond, null, key=jax.random.key(0), num_sampling_steps=3,
                       height=np.full(1, 64.0), width=np.full(1, 64.0), num_frames=np.full(1, 17.0), mask=edit,
                       x_cond=ref, progress=False)
    np.testing.assert_allclose(np.asarray(out[:, :, 0]), ref[:, :, 0], rtol=0, atol=0)
    assert not np.allclose(np.asarray(out[:, :, 1:]), ref[:, :, 1:])


def test_eval_timesteps():
    t = rflow.eval_timesteps()
    assert len(t) == 10 and t[0] == pytest.approx(1000 / 11) and t[-1] == pytest.approx(10000 / 11)
