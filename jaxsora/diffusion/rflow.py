"""Rectified flow as Open-Sora 1.2 trains and samples it (spec §2), as pure jit-friendly functions.

Convention: t ∈ [0, 1000]; t = 1000 is pure noise, t = 0 is data. With τ = t/1000,
x_t = (1 − τ)·x₀ + τ·ε, and the model predicts the velocity v = x₀ − ε (channels 0..C−1 of
its output). Noise and timesteps always come from a `jax.random` key.

The training loss and the sampler here are the ones `jaxsora.train` and `jaxsora.sample` call.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Open-Sora 1.2: 1000 training timesteps (RFlowScheduler.num_timesteps).
NUM_TIMESTEPS = 1000
# Open-Sora 1.2 timestep transform constants: base resolution 512·512 pixels, base 1 frame,
# and the VAE's hard-coded pixel→latent frame map `n // 17 * 5`.
BASE_RESOLUTION = 512 * 512
VAE_FRAME_CHUNK, VAE_LATENT_PER_CHUNK = 17, 5
# Open-Sora 1.2 eval loss: 10 interior points of linspace(0, 1000, 12) (eval/loss/eval_loss.py).
NUM_EVAL_TIMESTEPS = 10

ModelFn = Callable[..., jax.Array]


def timestep_transform(t, height, width, num_frames, scale: float = 1.0, num_timesteps: int = NUM_TIMESTEPS):
    """The resolution- and length-aware shift (SD3 §5.3.2 extended to video), spec §2.1.

    t: [B] on 0..num_timesteps; height/width: [B] pixel sizes; num_frames: [B] pixel frame counts
    (only sample 0 decides "image batch", as in the reference). Returns [B] float32.

    Difference from the reference: for 1 < frames < 17 the reference maps to 0 latent frames,
    so the ratio is 0 and t = 1000 gives 0/0 = NaN. Here the latent frame count is at least 1
    (such clips are one VAE chunk, ≥ 1 latent frame), so the result is always finite; for every
    other input it equals the reference.
    """
    t = jnp.asarray(t, jnp.float32) / num_timesteps
    h = jnp.asarray(height, jnp.float32)
    w = jnp.asarray(width, jnp.float32)
    nf = jnp.asarray(num_frames, jnp.float32)
    ratio_space = jnp.sqrt(h * w / BASE_RESOLUTION)
    latent = jnp.floor(nf / VAE_FRAME_CHUNK) * VAE_LATENT_PER_CHUNK
    latent = jnp.maximum(latent, 1.0)
    n = jnp.where(nf[0] == 1, jnp.ones_like(nf), latent)
    ratio = ratio_space * jnp.sqrt(n) * scale
    new_t = ratio * t / (1 + (ratio - 1) * t)
    return new_t * num_timesteps


def logit_normal_t(eps, loc: float = 0.0, scale: float = 1.0, num_timesteps: int = NUM_TIMESTEPS):
    """sigmoid(loc + scale·ε)·1000 — the reference's 1-D LogisticNormal draw."""
    return jax.nn.sigmoid(loc + scale * jnp.asarray(eps, jnp.float32)) * num_timesteps


def sample_t(key, batch: int, *, sample_method: str = "logit-normal", loc: float = 0.0, scale: float = 1.0,
             num_timesteps: int = NUM_TIMESTEPS):
    """Training timesteps [B] before the transform: uniform or logit-normal on 0..1000."""
    if sample_method == "uniform":
        return jax.random.uniform(key, (batch,), jnp.float32) * num_timesteps
    if sample_method == "logit-normal":
        return logit_normal_t(jax.random.normal(key, (batch,), jnp.float32), loc, scale, num_timesteps)
    raise ValueError(f"sample_method must be 'uniform' or 'logit-normal', got {sample_method!r}")


def add_noise(x0, noise, t, num_timesteps: int = NUM_TIMESTEPS):
    """(1 − t/1000)·x₀ + t/1000·ε, t: [B]."""
    tau = (jnp.asarray(t, jnp.float32) / num_timesteps).reshape((-1,) + (1,) * (x0.ndim - 1))
    return (1 - tau) * x0 + tau * noise


def masked_mean(err, x_mask=None):
    """Per-sample mean of err [B, C, T, H, W]; with x_mask [B, T] only over True frames
    (the reference's `mean_flat(..., mask)`)."""
    if x_mask is None:
        return jnp.mean(err, axis=tuple(range(1, err.ndim)))
    m = x_mask.astype(err.dtype)[:, None, :, None, None]
    per_frame = err.shape[1] * err.shape[3] * err.shape[4]
    return jnp.sum(err * m, axis=(1, 2, 3, 4)) / (jnp.sum(x_mask.astype(err.dtype), axis=1) * per_frame)


def training_loss_explicit(model_fn: ModelFn, x0, cond: dict, noise, t, *, x_mask=None):
    """Per-sample loss [B] for given noise and (already transformed) t.

    Frames with x_mask == False are fed clean (x_t = x₀) and left out of the loss; x_mask is also
    passed to the model (as scripts/train.py does).
    """
    x_t = add_noise(x0, noise, t)
    kwargs = dict(cond)
    if x_mask is not None:
        x_t = jnp.where(x_mask[:, None, :, None, None], x_t, x0)
        kwargs["x_mask"] = x_mask
    out = model_fn(x_t, t, **kwargs)
    v_pred = out[:, : x0.shape[1]].astype(jnp.float32)
    err = jnp.square(v_pred - (x0 - noise).astype(jnp.float32))
    return masked_mean(err, x_mask)


def training_loss(model_fn: ModelFn, x0, cond: dict, key, *, x_mask=None, height, width, num_frames,
                  sample_method: str = "logit-normal", loc: float = 0.0, scale: float = 1.0,
                  use_timestep_transform: bool = True, transform_scale: float = 1.0):
    """The training objective (RFlowScheduler.training_losses): draw t and ε from `key`, shift t
    by resolution and length, return the per-sample loss [B]."""
    k_t, k_noise = jax.random.split(key)
    b = x0.shape[0]
    t = sample_t(k_t, b, sample_method=sample_method, loc=loc, scale=scale)
    if use_timestep_transform:
        t = timestep_transform(t, height, width, num_frames, scale=transform_scale)
    noise = jax.random.normal(k_noise, x0.shape, jnp.float32)
    return training_loss_explicit(model_fn, x0, cond, noise, t, x_mask=x_mask)


def eval_timesteps(num_eval_timesteps: int = NUM_EVAL_TIMESTEPS) -> np.ndarray:
    """Eval-loss timesteps (spec §2.3): the interior points of linspace(0, 1000, n + 2)."""
    return np.linspace(0, NUM_TIMESTEPS, num_eval_timesteps + 2)[1:-1].astype(np.float32)


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------
def sampling_timesteps(num_sampling_steps: int, height, width, num_frames, use_timestep_transform: bool = True):
    """The t fed to the model at each step, [steps, B]: t_i = (1 − i/N)·1000, shifted with the
    inference height/width/frames (RFLOW.sample)."""
    h = jnp.atleast_1d(jnp.asarray(height, jnp.float32))
    w = jnp.broadcast_to(jnp.atleast_1d(jnp.asarray(width, jnp.float32)), h.shape)
    nf = jnp.broadcast_to(jnp.atleast_1d(jnp.asarray(num_frames, jnp.float32)), h.shape)
    base = (1.0 - jnp.arange(num_sampling_steps, dtype=jnp.float32) / num_sampling_steps) * NUM_TIMESTEPS
    ts = jnp.broadcast_to(base[:, None], (num_sampling_steps, h.shape[0]))
    if use_timestep_transform:
        ts = jax.vmap(lambda t: timestep_transform(t, h, w, nf))(ts)
    return ts


def sample(model_fn: ModelFn, z, cond: dict, null_y, *, key, num_sampling_steps: int = 30, cfg_scale: float = 7.0,
           height, width, num_frames, mask=None, x_cond=None, use_timestep_transform: bool = True,
           progress: bool = True):
    """Classifier-free-guided Euler sampling (RFLOW.sample, spec §2.4). Open-Sora 1.2 inference
    uses 30 steps and cfg 7.0.

    z: [B, C, T, H, W] initial noise; cond: model kwargs with y [B, 1, L, D], mask [B, L] (text),
    fps/height/width; null_y: [B, 1, L, D] null caption (the model's y_embedding), used with the
    prompt's own text mask. mask: [B, T] float edit mask (1 = generate, 0 = keep the condition
    frame, in between = partial edit); x_cond: [B, C, T, H, W] latents whose frames are written
    into z where mask < 1 (image-to-video, extension). Returns z [B, C, T, H, W] float32.

    The loop is one jitted `lax.fori_loop`; progress goes to a host tqdm bar through
    `jax.debug.callback`.
    """
    b, c = z.shape[:2]
    ts = sampling_timesteps(num_sampling_steps, height, width, num_frames, use_timestep_transform)
    ts = jnp.broadcast_to(ts, (num_sampling_steps, b))
    dts = jnp.concatenate([ts[:-1] - ts[1:], ts[-1:]], axis=0) / NUM_TIMESTEPS
    z = jnp.asarray(z, jnp.float32)
    if mask is not None and x_cond is not None:
        keep = (jnp.asarray(mask) < 1)[:, None, :, None, None]
        z = jnp.where(keep, jnp.asarray(x_cond, jnp.float32), z)
    cond2 = {k: (jnp.concatenate([v, v], 0) if k != "y" else v) for k, v in cond.items()}
    cond2["y"] = jnp.concatenate([cond["y"], null_y], 0)
    bar = _ProgressBar(num_sampling_steps) if progress else None

    def body(i, carry):
        z, noise_added, key = carry
        t = ts[i]
        kwargs = dict(cond2)
        mask_t_upper = None
        if mask is not None:
            key, k = jax.random.split(key)
            mask_t = jnp.asarray(mask, jnp.float32) * NUM_TIMESTEPS
            x0 = z
            x_noise = add_noise(x0, jax.random.normal(k, z.shape, jnp.float32), t)
            mask_t_upper = mask_t >= t[:, None]
            kwargs["x_mask"] = jnp.concatenate([mask_t_upper, mask_t_upper], 0)
            add = mask_t_upper & ~noise_added
            z = jnp.where(add[:, None, :, None, None], x_noise, x0)
            noise_added = mask_t_upper
        out = model_fn(jnp.concatenate([z, z], 0), jnp.concatenate([t, t], 0), **kwargs)
        pred = out[:, :c].astype(jnp.float32)
        v = pred[b:] + cfg_scale * (pred[:b] - pred[b:])
        z_new = z + v * dts[i][:, None, None, None, None]
        if mask is not None:
            z_new = jnp.where(mask_t_upper[:, None, :, None, None], z_new, x0)
        if bar is not None:
            jax.debug.callback(bar.update, i)
        return z_new, noise_added, key

    noise_added = (jnp.asarray(mask) == 1) if mask is not None else jnp.zeros((b, z.shape[2]), bool)
    z, _, _ = jax.lax.fori_loop(0, num_sampling_steps, body, (z, noise_added, key))
    if bar is not None:
        z = jax.block_until_ready(z)
        bar.close()
    return z


class _ProgressBar:
    def __init__(self, total):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="sampling", leave=False)

    def update(self, i):
        self.bar.n = int(i) + 1
        self.bar.refresh()

    def close(self):
        self.bar.close()
