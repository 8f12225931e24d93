"""Rectified flow as Open-Sora 1.2 trains and samples it (`opensora/schedulers/rf/`), as pure jit-friendly functions.

Convention: t ∈ [0, 1000]; t = 1000 is pure noise, t = 0 is data. With τ = t/1000,
x_t = (1 − τ)·x₀ + τ·ε, and the model predicts the velocity v = x₀ − ε (channels 0..C−1 of
its output; STDiT3's other C channels are unused). Noise and timesteps always come from a
`jax.random` key; nothing draws from global state.

`training_loss` is THE function `jaxsora.train` calls; `sample_init` + `sample_steps` (the loop of
`sample`, jitted by the caller and driven by `run_steps`) are what `jaxsora.infer` /
`python -m jaxsora.sample` run.

Deliberate differences from the reference (everything else is equal to it, see tests/diffusion):
- `timestep_transform` counts at least 1 latent frame. The reference maps 1 < frames < 17 to
  `frames // 17 * 5 = 0` latent frames, so its ratio is 0 and t = 1000 becomes 0/0 = NaN.
- `timestep_transform` clips its result to [0, 1000]. The reference's float32 arithmetic can give
  1000.0001 at t = 1000 (e.g. 64×64 px, 17 frames); in its sampler that makes `mask·1000 < t`, so
  with an edit mask every frame is treated as a condition frame in the first step.
- In `sample`, reference latents `x_cond` are written into z only where the edit mask is < 1
  (upstream's `apply_mask_strategy` also overwrites frames whose edit ratio is 1).
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.parallel import compile_options

# Open-Sora 1.2: 1000 training timesteps (RFlowScheduler.num_timesteps).
NUM_TIMESTEPS = 1000
# Open-Sora 1.2 timestep_transform defaults: base_resolution = 512·512 pixels, base_num_frames = 1,
# and the VAE's hard-coded pixel → latent frame map `num_frames // 17 * 5` (rectified_flow.py).
BASE_RESOLUTION = 512 * 512
BASE_NUM_FRAMES = 1
VAE_FRAME_CHUNK, VAE_LATENT_PER_CHUNK = 17, 5
# Open-Sora 1.2 eval loss: t ∈ linspace(0, 1000, num_eval_timesteps + 2)[1:-1], default 10
# (eval/loss/eval_loss.py).
NUM_EVAL_TIMESTEPS = 10
# Open-Sora 1.2 inference config (configs/opensora-v1-2/inference/sample.py): 30 steps, cfg 7.0.
DEFAULT_SAMPLING_STEPS = 30
DEFAULT_CFG_SCALE = 7.0

ModelFn = Callable[..., jax.Array]


# --------------------------------------------------------------------------------------------
# timesteps
# --------------------------------------------------------------------------------------------
def latent_frames_for_shift(num_frames):
    """Latent frame count the timestep shift uses: `frames // 17 * 5` (Open-Sora 1.2's hard-coded
    VAE ratio), at least 1 (ours; the reference gives 0 for 1 < frames < 17). num_frames: [B] pixel
    frames. The image case (frames[0] == 1 → n = 1) is handled by `timestep_transform`."""
    nf = jnp.asarray(num_frames, jnp.float32)
    return jnp.maximum(jnp.floor(nf / VAE_FRAME_CHUNK) * VAE_LATENT_PER_CHUNK, 1.0)


def timestep_transform(t, height, width, num_frames, scale: float = 1.0, num_timesteps: int = NUM_TIMESTEPS):
    """The resolution- and length-aware shift (SD3 §5.3.2 extended to video), as Open-Sora 1.2's
    `timestep_transform` (`opensora/schedulers/rf/rectified_flow.py`).

    t: [B] on 0..num_timesteps; height/width: [B] (or scalars) pixel sizes; num_frames: [B] (or a
    scalar) pixel frame counts. As in the reference, sample 0 decides "image batch"
    (num_frames[0] == 1 → n = 1 latent frame for every sample). Returns [B] float32 in
    [0, num_timesteps]:  r = sqrt(h·w / 512²) · sqrt(n) · scale,  τ' = r·τ / (1 + (r − 1)·τ).
    Never NaN for positive sizes (see the module docstring for the two deviations).
    """
    t = jnp.atleast_1d(jnp.asarray(t, jnp.float32))
    h = jnp.broadcast_to(jnp.asarray(height, jnp.float32), t.shape)
    w = jnp.broadcast_to(jnp.asarray(width, jnp.float32), t.shape)
    nf = jnp.broadcast_to(jnp.asarray(num_frames, jnp.float32), t.shape)
    tau = t / num_timesteps
    ratio_space = jnp.sqrt(h * w / BASE_RESOLUTION)
    n = jnp.where(nf[0] == 1, jnp.ones_like(nf), latent_frames_for_shift(nf))
    ratio = ratio_space * jnp.sqrt(n / BASE_NUM_FRAMES) * scale
    new_tau = ratio * tau / (1 + (ratio - 1) * tau)
    return jnp.clip(new_tau * num_timesteps, 0.0, float(num_timesteps))


def logit_normal_t(eps, loc: float = 0.0, scale: float = 1.0, num_timesteps: int = NUM_TIMESTEPS):
    """t = sigmoid(loc + scale·ε)·1000 for standard-normal ε [B]: the first simplex component of the
    reference's 1-D `LogisticNormal(loc, scale)` draw, scaled to 0..1000."""
    return jax.nn.sigmoid(loc + scale * jnp.asarray(eps, jnp.float32)) * num_timesteps


def sample_t(key, batch: int, *, sample_method: str = "logit-normal", loc: float = 0.0, scale: float = 1.0,
             num_timesteps: int = NUM_TIMESTEPS):
    """Training timesteps [B] before the transform: "uniform" U(0,1)·1000 or "logit-normal"
    sigmoid(N(loc, scale))·1000 (RFlowScheduler.sample_method)."""
    if sample_method == "uniform":
        return jax.random.uniform(key, (batch,), jnp.float32) * num_timesteps
    if sample_method == "logit-normal":
        return logit_normal_t(jax.random.normal(key, (batch,), jnp.float32), loc, scale, num_timesteps)
    raise ValueError(f"scheduler sample_method must be 'uniform' or 'logit-normal', got {sample_method!r}")


def eval_timesteps(num_eval_timesteps: int = NUM_EVAL_TIMESTEPS) -> np.ndarray:
    """Eval-loss timesteps (Open-Sora 1.2's `eval/loss/eval_loss.py`): the interior points of
    linspace(0, 1000, n + 2), float32 [n] (83.3 … 916.7 for n = 10). No logit-normal draw and no shift."""
    return np.linspace(0, NUM_TIMESTEPS, num_eval_timesteps + 2, dtype=np.float32)[1:-1]


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
def add_noise(x0, noise, t, num_timesteps: int = NUM_TIMESTEPS):
    """x_t = (1 − t/1000)·x₀ + (t/1000)·ε.  x0/noise: [B, ...]; t: [B]."""
    tau = (jnp.asarray(t, jnp.float32) / num_timesteps).reshape((-1,) + (1,) * (x0.ndim - 1))
    return (1 - tau) * x0 + tau * noise


def masked_mean(err, x_mask=None):
    """Per-sample mean [B] of err [B, C, T, H, W]: over all of C, T, H, W, or with x_mask [B, T]
    over C, H, W and the True frames only: Σ_{t: mask} Σ_{c,h,w} err / (#True · C·H·W), as the
    reference's `mean_flat(err, mask)`."""
    if x_mask is None:
        return jnp.mean(err, axis=tuple(range(1, err.ndim)))
    m = jnp.asarray(x_mask).astype(err.dtype)
    per_frame = err.shape[1] * err.shape[3] * err.shape[4]
    return jnp.einsum("bcthw,bt->b", err, m) / (jnp.sum(m, axis=1) * per_frame)


def training_loss_explicit(model_fn: ModelFn, x0, cond: dict, noise, t, *, x_mask=None):
    """Per-sample loss [B] for given noise ε [B, C, T, H, W] and (already transformed) t [B].

    x_t = add_noise(x₀, ε, t); frames with x_mask [B, T] == False are fed clean (x_t = x₀) and left
    out of the loss; x_mask is also passed to the model as `x_mask=` (as scripts/train.py does).
    model_fn(x_t, t, **cond) → [B, ≥C, T, H, W]; the first C channels are the velocity, whose
    target is x₀ − ε. Squared error in float32, no per-timestep weighting.
    """
    x0 = jnp.asarray(x0)
    t = jnp.asarray(t, jnp.float32)
    x_t = add_noise(x0, noise, t)
    kwargs = dict(cond)
    if x_mask is not None:
        x_mask = jnp.asarray(x_mask, bool)
        x_t = jnp.where(x_mask[:, None, :, None, None], x_t, x0)  # = add_noise(x0, noise, 0)
        kwargs["x_mask"] = x_mask
    out = model_fn(x_t, t, **kwargs)
    v_pred = out[:, : x0.shape[1]].astype(jnp.float32)
    target = (x0 - noise).astype(jnp.float32)
    return masked_mean(jnp.square(v_pred - target), x_mask)


def training_loss(model_fn: ModelFn, x0, cond: dict, key, *, x_mask=None, height, width, num_frames,
                  sample_method: str = "logit-normal", loc: float = 0.0, scale: float = 1.0,
                  use_timestep_transform: bool = True, transform_scale: float = 1.0, noise_dtype=jnp.float32):
    """The training objective (RFlowScheduler.training_losses), per-sample loss [B].

    x0: [B, C, T, H, W] clean latents; cond: model kwargs (y [B, 1, L, D], mask [B, L], fps,
    height, width [B]); key: a `jax.random` key, split into the t draw and the noise draw.
    height/width: [B] pixel sizes, num_frames: [B] pixel frame counts (for the shift).
    t ~ sample_method (Open-Sora 1.2 stages: logit-normal, loc 0, scale 1, transform on), then
    shifted by `timestep_transform(t, height, width, num_frames, scale=transform_scale)`.
    noise_dtype: the dtype ε is drawn in (the reference trains with bf16 noise; default float32).
    """
    k_t, k_noise = jax.random.split(key)
    t = sample_t(k_t, x0.shape[0], sample_method=sample_method, loc=loc, scale=scale)
    if use_timestep_transform:
        t = timestep_transform(t, height, width, num_frames, scale=transform_scale)
    noise = jax.random.normal(k_noise, x0.shape, noise_dtype).astype(jnp.float32)
    return training_loss_explicit(model_fn, x0, cond, noise, t, x_mask=x_mask)


def eval_loss(model_fn: ModelFn, x0, cond: dict, key, *, x_mask=None,
              num_eval_timesteps: int = NUM_EVAL_TIMESTEPS):
    """Eval loss (Open-Sora 1.2's eval/loss/eval_loss.py): per-sample loss at each of the fixed
    `eval_timesteps(n)`, fresh noise per timestep (from `fold_in(key, i)`). Returns [n, B];
    the reference's bucket figure is `mean over samples, then over the n timesteps`."""
    ts = jnp.asarray(eval_timesteps(num_eval_timesteps))
    b = x0.shape[0]

    def one(i):
        noise = jax.random.normal(jax.random.fold_in(key, i), x0.shape, jnp.float32)
        return training_loss_explicit(model_fn, x0, cond, noise, jnp.full((b,), ts[i]), x_mask=x_mask)

    return jax.lax.map(one, jnp.arange(num_eval_timesteps))


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------
def sampling_timesteps(num_sampling_steps: int, height, width, num_frames, use_timestep_transform: bool = True):
    """The t fed to the model at each step, float32 [steps, B] (the refharness's shape; B is the
    length of height/width/num_frames, 1 for scalars): t_i = (1 − i/N)·1000 for i = 0..N−1, shifted
    by `timestep_transform` with the inference height/width/frames (RFLOW.sample)."""
    h = jnp.atleast_1d(jnp.asarray(height, jnp.float32))
    w = jnp.atleast_1d(jnp.asarray(width, jnp.float32))
    nf = jnp.atleast_1d(jnp.asarray(num_frames, jnp.float32))
    b = max(h.shape[0], w.shape[0], nf.shape[0])
    h, w, nf = (jnp.broadcast_to(a, (b,)) for a in (h, w, nf))
    base = (1.0 - jnp.arange(num_sampling_steps, dtype=jnp.float32) / num_sampling_steps) * NUM_TIMESTEPS
    ts = jnp.broadcast_to(base[:, None], (num_sampling_steps, b))
    if use_timestep_transform:
        ts = jax.vmap(lambda t: timestep_transform(t, h, w, nf))(ts)
    return ts


def _cfg_cond(cond: dict, null_y):
    """Model kwargs for the [cond; uncond] double batch: y = [y; null_y], every other [B, ...]
    entry repeated (the text mask too: the null caption uses the prompt's token count)."""
    out = {}
    for k, v in cond.items():
        if v is None:
            continue
        v = jnp.asarray(v)
        out[k] = v if v.ndim == 0 else jnp.concatenate([v, v], 0)
    y = jnp.asarray(cond["y"])
    out["y"] = jnp.concatenate([y, jnp.broadcast_to(jnp.asarray(null_y, y.dtype), y.shape)], 0)
    return out


def _is_key_batch(key) -> bool:
    """A [B] array of typed `jax.random` keys (one per sample), as opposed to one key."""
    return (key is not None and jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key)
            and jnp.ndim(key) == 1)


def _step_noise(key, i, shape):
    """Re-noising draw of step i: from `fold_in(key, i)`, or with a [B] batch of keys, sample b's
    from `fold_in(key[b], i)` — then each sample's draws depend on its own key only, not on the
    batch it is in (what `jaxsora.infer` uses for per-prompt reproducibility)."""
    if _is_key_batch(key):
        return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, i), shape[1:], jnp.float32))(key)
    return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)


def sample_init(z, cond: dict, null_y, *, mask=None, x_cond=None):
    """The sampler's state before step 0 → (carry, cond2): carry = (z [B, C, T, H, W] float32 with
    the reference latents written where the edit mask is < 1, noise_added [B, T] bool), cond2 = the
    model kwargs of the [cond; uncond] double batch (`_cfg_cond`)."""
    b = z.shape[0]
    z = jnp.asarray(z, jnp.float32)
    if mask is not None:
        mask = jnp.asarray(mask, jnp.float32)
        if mask.shape != (b, z.shape[2]):
            raise ValueError(f"sample: edit mask must be [B, T] = {(b, z.shape[2])}, got {mask.shape}")
        if x_cond is not None:
            z = jnp.where((mask < 1)[:, None, :, None, None], jnp.asarray(x_cond, jnp.float32), z)
    noise_added = (mask == 1) if mask is not None else jnp.zeros((b, z.shape[2]), bool)
    return (z, noise_added), _cfg_cond(cond, null_y)


def sample_steps(model_fn: ModelFn, carry, cond2: dict, key, ts, *, mask=None, step_noise=None,
                 cfg_scale=DEFAULT_CFG_SCALE, start=0, stop=None):
    """Steps start..stop−1 of the sampling loop (one `lax.fori_loop`) → the carry after them.
    carry, cond2: from `sample_init` (or a previous call); ts: [steps, B] model timesteps;
    key / step_noise / mask: see `sample`. start/stop may be traced: one compiled program then runs
    any range of steps, and running the steps one call at a time gives the same bits as one call."""
    steps, b = ts.shape
    stop = steps if stop is None else stop
    z, _ = carry
    c = z.shape[1]
    dts = jnp.concatenate([ts[:-1] - ts[1:], ts[-1:]], axis=0) / NUM_TIMESTEPS  # last Δ = t_{N−1}
    cfg_scale = jnp.asarray(cfg_scale, jnp.float32)
    if step_noise is not None:
        step_noise = jnp.asarray(step_noise, jnp.float32)
        if step_noise.shape != (steps,) + z.shape:
            raise ValueError(f"step_noise must be [steps, *z.shape] = {(steps,) + z.shape}, got {step_noise.shape}")
    if mask is not None:
        mask = jnp.asarray(mask, jnp.float32)

    def body(i, carry):
        z, noise_added = carry
        t = ts[i]
        kwargs = dict(cond2)
        if mask is not None:
            # RFLOW.sample: a frame is generated at this step iff mask·1000 ≥ t; frames that newly
            # qualify are re-noised to level t from the current z; the rest stay the reference.
            x0 = z
            eps = step_noise[i] if step_noise is not None else _step_noise(key, i, z.shape)
            upper = mask * NUM_TIMESTEPS >= t[:, None]  # [B, T]
            kwargs["x_mask"] = jnp.concatenate([upper, upper], 0)
            fresh = upper & ~noise_added
            z = jnp.where(fresh[:, None, :, None, None], add_noise(x0, eps, t), x0)
            noise_added = upper
        out = model_fn(jnp.concatenate([z, z], 0), jnp.concatenate([t, t], 0), **kwargs)
        pred = out[:, :c].astype(jnp.float32)
        v = pred[b:] + cfg_scale * (pred[:b] - pred[b:])  # uncond + s·(cond − uncond)
        z = z + v * dts[i][:, None, None, None, None]
        if mask is not None:
            z = jnp.where(upper[:, None, :, None, None], z, x0)
        return z, noise_added

    return jax.lax.fori_loop(start, stop, body, carry)


def run_steps(step_fn: Callable, carry, steps: int, bar=None):
    """Drive a sampler from the host: `step_fn(carry, start, stop)` → carry (a jitted `sample_steps`).
    bar None: one call for all steps. bar a tqdm-like object: one call per step and `bar.update(1)`
    as each step finishes (the next step is already queued), so a cached program shows progress
    without a host callback inside it (jax does not cache programs with host callbacks)."""
    if bar is None:
        return step_fn(carry, 0, steps)
    done = None
    for i in range(steps):
        carry = step_fn(carry, i, i + 1)
        if done is not None:
            jax.block_until_ready(done)
            bar.update(1)
        done = carry
    jax.block_until_ready(done)
    bar.update(1)
    return carry


def denoise(model_fn: ModelFn, z, cond: dict, null_y, ts, *, key=None, cfg_scale=DEFAULT_CFG_SCALE, mask=None,
            x_cond=None, step_noise=None):
    """The whole sampling loop as one traceable function (`sample_init` + `sample_steps`), for callers
    that jit it themselves; `sample` without the schedule, the jit and the bar. ts: [steps, B] model
    timesteps (`sampling_timesteps`); key: one key or a [B] array of per-sample keys (see
    `_step_noise`), used only with a mask. Returns z [B, C, T, H, W] float32."""
    if mask is not None and step_noise is None and key is None:
        raise ValueError("denoise: an edit mask re-noises frames; pass key= (a jax.random key) or step_noise=")
    carry, cond2 = sample_init(z, cond, null_y, mask=mask, x_cond=x_cond)
    z, _ = sample_steps(model_fn, carry, cond2, key, ts, mask=mask, step_noise=step_noise, cfg_scale=cfg_scale)
    return z


def _module_steps_impl(graphdef, state, carry, cond2, key, ts, mask, step_noise, cfg_scale, start, stop):
    return sample_steps(nnx.merge(graphdef, state), carry, cond2, key, ts, mask=mask, step_noise=step_noise,
                        cfg_scale=cfg_scale, start=start, stop=stop)


def _fn_steps_impl(model_fn, carry, cond2, key, ts, mask, step_noise, cfg_scale, start, stop):
    return sample_steps(model_fn, carry, cond2, key, ts, mask=mask, step_noise=step_noise, cfg_scale=cfg_scale,
                        start=start, stop=stop)


def programs() -> types.SimpleNamespace:
    """`sample`'s jitted pieces (init, steps of an nnx.Module, steps of a plain function), with the default
    backend's compiler options (`jaxsora.parallel.compile_options`); made once per set of options."""
    return _programs(tuple(sorted((compile_options.of_default_backend() or {}).items())))


@functools.cache
def _programs(options: tuple) -> types.SimpleNamespace:
    opts = dict(options) or None
    return types.SimpleNamespace(
        init=jax.jit(sample_init, compiler_options=opts),
        module_steps=jax.jit(_module_steps_impl, static_argnames=("graphdef",), compiler_options=opts),
        fn_steps=jax.jit(_fn_steps_impl, static_argnames=("model_fn",), compiler_options=opts))


def sample(model_fn: ModelFn, z, cond: dict, null_y, *, key, num_sampling_steps: int = DEFAULT_SAMPLING_STEPS,
           cfg_scale: float = DEFAULT_CFG_SCALE, height, width, num_frames, mask=None, x_cond=None,
           use_timestep_transform: bool = True, progress: bool = True, step_noise=None):
    """Classifier-free-guided Euler sampling (Open-Sora 1.2's `RFLOW.sample`) → z [B, C, T, H, W] float32.

    model_fn: `model_fn(x, t, **kwargs)` → [2B, ≥C, T, H, W], or an `nnx.Module` with that call
        (its parameters are arguments of the compiled loop, cached per graph). A plain callable is
        a static argument of the compiled loop (compiled once per function object).
    z: [B, C, T, H, W] initial noise (Open-Sora seeds it separately; draw it from your own key).
    cond: model kwargs for the prompts: y [B, 1, L, D], mask [B, L] (text), fps/height/width [B].
    null_y: [B, 1, L, D] (or [L, D], broadcast) null caption, the model's `y_embedder.y_embedding`;
        the unconditional half reuses the PROMPT's text mask, as the reference does.
    height/width: [B] pixel sizes and num_frames: [B] pixel frames, for the timestep shift.
    mask: [B, T] float edit mask (1 = generate, 0 = keep the condition frame, in between = edit
        strength: the frame is noised to level mask·1000 and generated from there); None = plain
        text-to-video (no x_mask passed to the model).
    x_cond: [B, C, T, H, W] reference latents written into z where mask < 1 (image-to-video,
        extension); None = z already holds them.
    key: `jax.random` key for the re-noising of edited frames (only used with a mask; step i uses
        `fold_in(key, i)`), or a [B] array of keys (sample b: `fold_in(key[b], i)`, independent of
        the batch); step_noise: optional explicit [steps, B, C, T, H, W] noise instead.
    progress: a tqdm bar on stderr, one compiled call per step (`run_steps`; the same bits as one
        call). Inside the caller's own jit the loop is traced inline, once, and shows no bar.

    Schedule: `sampling_timesteps(...)`; update z += v̂·(t_i − t_{i+1})/1000 (last step to 0);
    v̂ = v_uncond + cfg_scale·(v_cond − v_uncond) on the first C output channels.
    """
    if mask is not None and step_noise is None and key is None:
        raise ValueError("sample: an edit mask re-noises frames; pass key= (a jax.random key) or step_noise=")
    ts = sampling_timesteps(num_sampling_steps, height, width, num_frames, use_timestep_transform)
    ts = jnp.broadcast_to(ts, (num_sampling_steps, z.shape[0]))
    cfg_scale = jnp.asarray(cfg_scale, jnp.float32)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((z, cond, null_y, key, mask, x_cond,
                                                                           step_noise, ts))):
        return denoise(model_fn, z, cond, null_y, ts, key=key, cfg_scale=cfg_scale, mask=mask, x_cond=x_cond,
                       step_noise=step_noise)
    carry, cond2 = programs().init(z, cond, null_y, mask=mask, x_cond=x_cond)
    if isinstance(model_fn, nnx.Module):
        graphdef, state = nnx.split(model_fn)
        call = functools.partial(programs().module_steps, graphdef, state)
    else:
        call = functools.partial(programs().fn_steps, model_fn)
    step_fn = lambda carry, start, stop: call(carry, cond2, key, ts, mask, step_noise, cfg_scale,  # noqa: E731
                                              start, stop)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_sampling_steps, desc="sampling", leave=False)
    try:
        z, _ = run_steps(step_fn, carry, num_sampling_steps, bar)
    finally:
        if bar is not None:
            bar.close()
    return z
