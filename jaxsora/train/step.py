"""The train state and the jitted train step.

One step (Open-Sora 1.2 `scripts/train.py`, spec §6): encode the video with the frozen VAE and the
captions with the frozen text encoder → draw the frame-conditioning masks → rectified-flow loss
of STDiT3 (caption dropout inside) → gradients of the trainable parameters → global-norm clip →
AdamW → EMA. A step whose loss or gradient norm is not finite leaves the state unchanged (it is
counted in the metrics and by the loop).

The state is donated; every distinct bucket shape compiles once (the persistent compilation
cache keeps the executables across runs).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxsora.diffusion import rflow
from jaxsora.data.video import to_model_range
from jaxsora.diffusion.masks import MaskGenerator
from jaxsora.models.stdit3 import STDiT3, trainable_filter
from jaxsora.train.optim import ema_update


@struct.dataclass
class TrainState:
    step: jax.Array  # optimizer steps applied (int32)
    params: Any  # nnx.State of the trainable Params
    frozen: Any  # nnx.State of everything else in the model (frozen Params, Buffers)
    opt_state: Any
    ema: Any  # nnx.State, float32, same tree as params
    rng: jax.Array  # raw key data (uint32), so orbax stores it as a plain array


def split_model(model: STDiT3):
    """(graphdef, trainable state, frozen state)."""
    return nnx.split(model, trainable_filter(model.config), ...)


def init_state(model: STDiT3, tx: optax.GradientTransformation, seed: int) -> tuple[Any, TrainState]:
    graphdef, params, frozen = split_model(model)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        frozen=frozen,
        opt_state=tx.init(params),
        ema=jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params),  # not an alias: both are donated
        rng=jax.random.key_data(jax.random.key(seed)),
    )
    return graphdef, state


def weight_norm(params) -> jax.Array:
    return optax.tree.norm(params)


def make_train_step(
    graphdef,
    tx: optax.GradientTransformation,
    *,
    encode_video: Callable[[jax.Array, jax.Array], jax.Array],
    encode_text: Callable[[jax.Array, jax.Array], jax.Array],
    scheduler_cfg: dict,
    mask_ratios: Optional[dict],
    ema_decay: float,
    lr_fn: Callable,
):
    """Returns `step(state, batch, encoders) -> (state, metrics)`, to be jitted by the caller.

    batch: video [B, 3, T, H, W] uint8 (mapped to [-1, 1] here) or f32 in [-1, 1]; ids/text_mask
    [B, L] int32; fps/height/width [B] f32 (pixels); num_frames [B] f32 (pixel frames).
    encoders: the frozen encoders' weights (any pytree), passed as jit *arguments* so that large
    VAE/T5 weights are not baked into the executable as constants.
    encode_video(encoders, video, key) → latents [B, C, T', H', W'] (no gradient);
    encode_text(encoders, ids, text_mask) → [B, L, D] text states (no gradient).
    """
    mask_gen = MaskGenerator(dict(mask_ratios)) if mask_ratios else None
    sched = dict(scheduler_cfg or {})

    def step(state: TrainState, batch: dict, encoders=None):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        k_vae, k_mask, k_loss, k_drop = jax.random.split(key, 4)
        video = batch["video"]
        if video.dtype == jnp.uint8:
            video = to_model_range(video)
        x0 = jax.lax.stop_gradient(encode_video(encoders, video, k_vae).astype(jnp.float32))
        y = jax.lax.stop_gradient(encode_text(encoders, batch["ids"], batch["text_mask"]))[:, None]
        b, t = x0.shape[0], x0.shape[2]
        x_mask = mask_gen.get_masks(k_mask, b, t) if mask_gen is not None else None
        cond = dict(y=y, mask=batch["text_mask"], fps=batch["fps"], height=batch["height"], width=batch["width"])

        def loss_fn(params):
            model = nnx.merge(graphdef, params, state.frozen)

            def model_fn(x_t, t_, **c):
                return model(x_t, t_, dropout_key=k_drop, **c)

            per_sample = rflow.training_loss(
                model_fn, x0, cond, k_loss, x_mask=x_mask, height=batch["height"], width=batch["width"],
                num_frames=batch["num_frames"], **sched,
            )
            return jnp.mean(per_sample)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        params = keep(new_params, state.params)
        opt_state = keep(opt_state, state.opt_state)
        ema = keep(ema_update(state.ema, params, ema_decay), state.ema)
        new_state = state.replace(step=state.step + finite.astype(jnp.int32), params=params,
                                  opt_state=opt_state, ema=ema)
        metrics = dict(loss=loss, grad_norm=grad_norm, weight_norm=weight_norm(params),
                       lr=lr_fn(state.step), nonfinite=(~finite).astype(jnp.int32))
        return new_state, metrics

    return step
