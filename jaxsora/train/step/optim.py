"""The optimizer recipe of Open-Sora 1.2 and the Lambda speed run (`scripts/train.py`, the Lambda fork's
`opensora/utils/lr_scheduler.py`).

* AdamW (ColossalAI HybridAdam, adamw_mode): betas (0.9, 0.999), eps 1e-15, bias correction,
  decoupled weight decay `p ← p − lr·(adam + wd·p)` on every trainable parameter (biases, norms
  and tables included), after global-norm clipping (1.0).
* Learning-rate schedules, as a function of the optimizer step k (0-based):
  - "constant": lr (official stage 2 has no scheduler);
  - "linear_warmup" (LinearWarmupLR): lr·(k+1)/(W+1) for k < W, then lr;
  - "1cycle" (Lambda OneCycleScheduler, cos or linear anneal): min→max over W steps, max→final
    (= lr) over D steps, then final. Its construction steps once at k = 0, so step 0 uses min.
  - "warmup_stable_decay" (jaxsora's; the CPU demo): "linear_warmup" until step S = decay_start (or the
    warm-up's end, if later), then lr→min_lr over D = cooldown_steps (cos or linear, as "1cycle"), then
    min_lr (D = 0: min_lr from S on).
* EMA (decay 0.99 in every 1.2 config) of the trainable parameters, in float32, updated every
  step after the optimizer step, starting from the initial parameters.

`AdamW.tx()` is that recipe as an optax chain: it initializes the optimizer state (its layout is what
checkpoints hold) and is the reference `AdamW.update` is tested against. The train step runs
`AdamW.update`: the same formulas in the same order, written so that XLA updates each parameter in few
passes over memory (see there).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def lr_schedule(optim_cfg) -> optax.Schedule:
    kind = optim_cfg.get("lr_schedule", "linear_warmup")  # as configs/base.py (no warmup: constant)
    base = float(optim_cfg["lr"])
    warmup = int(optim_cfg.get("warmup_steps") or 0)
    if kind == "constant" or (kind == "linear_warmup" and warmup == 0):
        return lambda k: jnp.asarray(base, jnp.float32)

    def warmed(k):  # "linear_warmup"
        k = jnp.asarray(k, jnp.float32)
        return jnp.where(k < warmup, base * (k + 1) / (warmup + 1), base)

    if kind == "linear_warmup":
        return warmed
    linear = optim_cfg.get("anneal_strategy", "cos") == "linear"

    def anneal(start, end, frac):
        if linear:
            return start + (end - start) * frac
        return end + (start - end) / 2 * (jnp.cos(math.pi * frac) + 1)

    if kind == "warmup_stable_decay":
        start = max(int(optim_cfg.get("decay_start") or 0), warmup)  # a run shorter than its warm-up plus decay
        down = int(optim_cfg.get("cooldown_steps") or 0)
        low = float(optim_cfg.get("min_lr") or 0.0)

        def sched(k):
            k = jnp.asarray(k, jnp.float32)
            dn = anneal(base, low, jnp.clip((k - start) / down, 0, 1)) if down else jnp.asarray(low, jnp.float32)
            return jnp.where(k < start, warmed(k), dn)
        return sched
    if kind == "1cycle":
        lo, hi = float(optim_cfg["min_lr"]), float(optim_cfg["max_lr"])
        down = int(optim_cfg.get("cooldown_steps") or 0)
        if warmup <= 0:
            raise ValueError("optim.lr_schedule='1cycle' needs optim.warmup_steps > 0")

        def sched(k):
            k = jnp.asarray(k, jnp.float32)
            up = anneal(lo, hi, jnp.clip(k / warmup, 0, 1))
            dn = anneal(hi, base, jnp.clip((k - warmup) / max(down, 1), 0, 1))
            return jnp.where(k < warmup, up, jnp.where(k < warmup + down, dn, base))
        return sched
    raise ValueError(f"optim.lr_schedule must be constant, linear_warmup, 1cycle or warmup_stable_decay, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class AdamW:
    """The recipe's numbers: global-norm clipping, then AdamW with decoupled weight decay."""
    lr: Callable  # optimizer step (0-based) -> learning rate
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip: float  # max global L2 norm of the gradients; 0: no clipping

    @classmethod
    def from_config(cls, optim_cfg) -> AdamW:
        betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
        return cls(lr=lr_schedule(optim_cfg), b1=float(betas[0]), b2=float(betas[1]),
                   eps=float(optim_cfg.get("eps", 1e-15)),  # Open-Sora 1.2: adam_eps 1e-15
                   weight_decay=float(optim_cfg.get("weight_decay", 0.0)),
                   grad_clip=float(optim_cfg.get("grad_clip", 1.0) or 0.0))  # Open-Sora 1.2: grad_clip 1.0

    def tx(self) -> optax.GradientTransformation:
        tx = optax.adamw(learning_rate=self.lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        return optax.chain(optax.clip_by_global_norm(self.grad_clip), tx) if self.grad_clip else tx

    def update(self, grads, grad_norm, opt_state, params, ema, *, ema_decay: float, accept, max_norm_growth: float):
        """One optimizer step — clip, AdamW, EMA — kept only if it is accepted: `tx().update` and
        `optax.apply_updates`, then `ema_update`, each array keeping its old value where the step is rejected.

        grad_norm: ‖grads‖ (global L2). accept: scalar bool, the step's own verdict (finite loss and gradients).
        max_norm_growth > 0 also rejects a step whose parameters' norm would be non-finite or grow more than
        that many times. Returns (params, opt_state, ema, ‖params‖ (those returned), the update's norm over the old
        one (1 with no growth check), accepted).

        Why not `tx().update`: XLA:CPU then writes the clipped gradients, the new moments, the candidate
        parameters and the selections each to memory — 8 arrays of each parameter's size, ~27 passes over
        them a step. Here each output is written once, straight from its inputs: with the growth check the
        candidate parameters first, from (g, m, v, p) (the verdict needs their norm), then the moments from
        (g, m) and (g, v), the parameters from the candidate, the EMA from the parameters — 5 arrays, ~20
        passes; without it the moments, then the parameters from the moments just written (the old ones are
        overwritten in place), then the EMA — 4. The candidate and the moments read the gradients through
        separate `optimization_barrier`s, so that XLA shares neither the clipped gradients nor the new
        moments between them (each would be one more array written). At bench/step.py's `realistic` (22M
        parameters): the update alone 82 ms instead of 104-109, in the step 132-168 ms of XLA:CPU's time
        instead of 215-232 (2026-11-28). The numbers are optax's formulas in optax's order
        (tests/train/test_optim.py compares them, and counts the arrays written).
        """
        state = _AdamState.of(opt_state, clipped=bool(self.grad_clip))
        count = optax.safe_increment(state.adam.count)
        bc1 = 1 - self.b1 ** count  # optax.tree.bias_correction
        bc2 = 1 - self.b2 ** count
        step_size = -1 * self.lr(state.sched.count)  # optax.scale_by_learning_rate (flip_sign)

        def clip(g):  # optax.clip_by_global_norm
            if not self.grad_clip:
                return g
            return jax.lax.select(jnp.squeeze(grad_norm < self.grad_clip), g,
                                  (g / grad_norm.astype(g.dtype)) * self.grad_clip)

        def first(g, m):  # optax.tree.update_moment, order 1
            return (1 - self.b1) * (clip(g) ** 1) + self.b1 * m

        def second(g, v):  # optax.tree.update_moment_per_elem_norm, order 2
            return (1 - self.b2) * (clip(g) ** 2) + self.b2 * v

        def applied(m1, v1, p):  # the parameters after the step, from the new moments
            u = (m1 / bc1.astype(m1.dtype)) / (jnp.sqrt(v1 / bc2.astype(v1.dtype) + 0.0) + self.eps)
            if self.weight_decay != 0.0:  # optax.add_decayed_weights skips a zero decay
                u = u + self.weight_decay * p
            u = jnp.array(step_size, dtype=u.dtype) * u
            return jnp.asarray(p + u).astype(p.dtype)  # optax.apply_updates

        def keep(a, b):
            return jnp.where(accept, a, b)

        barrier = jax.lax.optimization_barrier
        growth = jnp.ones((), jnp.float32)
        if max_norm_growth > 0:  # the verdict needs the new parameters' norm: they are computed first
            new = jax.tree.map(lambda g, m, v, p: applied(first(g, m), second(g, v), p),
                               *barrier((grads, state.adam.mu, state.adam.nu)), params)
            new_norm, old_norm = optax.tree.norm(new), optax.tree.norm(params)
            growth = new_norm / jnp.maximum(old_norm, jnp.finfo(jnp.float32).tiny)
            accept = accept & jnp.isfinite(new_norm) & (growth <= max_norm_growth)
        mu = jax.tree.map(lambda g, m: keep(first(g, m), m), *barrier((grads, state.adam.mu)))
        nu = jax.tree.map(lambda g, v: keep(second(g, v), v), *barrier((grads, state.adam.nu)))
        if max_norm_growth > 0:
            params = jax.tree.map(keep, new, params)
            norm = keep(new_norm, old_norm)
        else:  # from the moments just written (equal where it counts): the old ones are overwritten in place
            params = jax.tree.map(lambda m1, v1, p: keep(applied(m1, v1, p), p), mu, nu, params)
            norm = optax.tree.norm(params)
        ema = jax.tree.map(keep, ema_update(ema, params, ema_decay), ema)
        adam = state.adam._replace(count=keep(count, state.adam.count), mu=mu, nu=nu)
        sched = state.sched._replace(count=keep(optax.safe_increment(state.sched.count), state.sched.count))
        return params, state.replace(adam, sched), ema, norm, growth, accept


@dataclasses.dataclass(frozen=True)
class _AdamState:
    """The parts of `AdamW.tx()`'s state that a step changes, and how to put them back."""
    outer: tuple  # the whole state
    clipped: bool
    adam: optax.ScaleByAdamState
    sched: optax.ScaleByScheduleState

    @classmethod
    def of(cls, opt_state, clipped: bool) -> _AdamState:
        chain = opt_state[1] if clipped else opt_state  # (clip, adamw) or adamw alone
        adam, sched = chain[0], chain[-1]
        if not (isinstance(adam, optax.ScaleByAdamState) and isinstance(sched, optax.ScaleByScheduleState)):
            raise TypeError(f"not the state of AdamW.tx(): {jax.tree.structure(opt_state)}")
        return cls(opt_state, clipped, adam, sched)

    def replace(self, adam, sched):
        chain = self.outer[1] if self.clipped else self.outer
        chain = (adam, *chain[1:-1], sched)
        return (self.outer[0], chain) if self.clipped else chain


def ema_update(ema, params, decay: float):
    """ema ← decay·ema + (1 − decay)·params, in float32."""
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p.astype(jnp.float32)).astype(e.dtype), ema, params)
