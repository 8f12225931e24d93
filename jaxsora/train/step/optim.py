"""The optimizer recipe of Open-Sora 1.2 and the Lambda speed run (spec §6, §7.3).

* AdamW (ColossalAI HybridAdam, adamw_mode): betas (0.9, 0.999), eps 1e-15, bias correction,
  decoupled weight decay `p ← p − lr·(adam + wd·p)` on every trainable parameter (biases, norms
  and tables included), after global-norm clipping (1.0).
* Learning-rate schedules, as a function of the optimizer step k (0-based):
  - "constant": lr (official stage 2 has no scheduler);
  - "linear_warmup" (LinearWarmupLR): lr·(k+1)/(W+1) for k < W, then lr;
  - "1cycle" (Lambda OneCycleScheduler, cos or linear anneal): min→max over W steps, max→final
    (= lr) over D steps, then final. Its construction steps once at k = 0, so step 0 uses min.
* EMA (decay 0.99 in every 1.2 config) of the trainable parameters, in float32, updated every
  step after the optimizer step, starting from the initial parameters.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax


def lr_schedule(optim_cfg) -> optax.Schedule:
    kind = optim_cfg.get("lr_schedule", "linear_warmup")  # as configs/base.py (no warmup: constant)
    base = float(optim_cfg["lr"])
    warmup = int(optim_cfg.get("warmup_steps") or 0)
    if kind == "constant" or (kind == "linear_warmup" and warmup == 0):
        return lambda k: jnp.asarray(base, jnp.float32)
    if kind == "linear_warmup":
        def sched(k):
            k = jnp.asarray(k, jnp.float32)
            return jnp.where(k < warmup, base * (k + 1) / (warmup + 1), base)
        return sched
    if kind == "1cycle":
        lo, hi = float(optim_cfg["min_lr"]), float(optim_cfg["max_lr"])
        down = int(optim_cfg.get("cooldown_steps") or 0)
        linear = optim_cfg.get("anneal_strategy", "cos") == "linear"
        if warmup <= 0:
            raise ValueError("optim.lr_schedule='1cycle' needs optim.warmup_steps > 0")

        def anneal(start, end, frac):
            if linear:
                return start + (end - start) * frac
            return end + (start - end) / 2 * (jnp.cos(math.pi * frac) + 1)

        def sched(k):
            k = jnp.asarray(k, jnp.float32)
            up = anneal(lo, hi, jnp.clip(k / warmup, 0, 1))
            dn = anneal(hi, base, jnp.clip((k - warmup) / max(down, 1), 0, 1))
            return jnp.where(k < warmup, up, jnp.where(k < warmup + down, dn, base))
        return sched
    raise ValueError(f"optim.lr_schedule must be constant, linear_warmup or 1cycle, got {kind!r}")


def make_optimizer(optim_cfg) -> optax.GradientTransformation:
    betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    tx = optax.adamw(
        learning_rate=lr_schedule(optim_cfg),
        b1=betas[0],
        b2=betas[1],
        eps=float(optim_cfg.get("eps", 1e-15)),  # Open-Sora 1.2: adam_eps 1e-15
        weight_decay=float(optim_cfg.get("weight_decay", 0.0)),
    )
    clip = optim_cfg.get("grad_clip", 1.0)  # Open-Sora 1.2: grad_clip 1.0 (global L2 norm)
    return optax.chain(optax.clip_by_global_norm(float(clip)), tx) if clip else tx


def ema_update(ema, params, decay: float):
    """ema ← decay·ema + (1 − decay)·params, in float32."""
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p.astype(jnp.float32)).astype(e.dtype), ema, params)
