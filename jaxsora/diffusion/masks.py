"""Frame-conditioning masks for training (Open-Sora 1.2 `MaskGenerator`, spec §5).

A mask is [T] bool over *latent* frames: True = a normal noised frame, False = a clean condition
frame (image-to-video, extension, interpolation). One mask type is drawn per sample with the
configured probabilities; `identity` (all True) takes what the others leave.

Driven by a `jax.random` key and usable inside jit (T is static). Differences from the
reference, where it would crash or misbehave: the quarter_* types with T < 4 (T // 4 = 0) condition
one frame instead of failing; T ≤ 1 always gives all True, as in the reference.
"""
from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp

# The reference's key names, in its order; "intepolate" (sic) is the spelling configs use.
MASK_TYPES = (
    "identity", "quarter_random", "quarter_head", "quarter_tail", "quarter_head_tail", "image_random",
    "image_head", "image_tail", "image_head_tail", "random", "intepolate",
)


class MaskGenerator:
    def __init__(self, mask_ratios: Mapping[str, float]):
        ratios = {str(k): float(v) for k, v in dict(mask_ratios).items()}
        unknown = sorted(set(ratios) - set(MASK_TYPES))
        if unknown:
            raise ValueError(f"unknown mask type(s) {unknown}; valid: {list(MASK_TYPES)}")
        bad = {k: v for k, v in ratios.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"mask ratios must lie in [0, 1], got {bad}")
        if "identity" not in ratios:  # reference: identity = 1 − Σ others, appended last
            ratios["identity"] = 1.0 - sum(ratios.values())
        total = sum(ratios.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6) or ratios["identity"] < -1e-6:
            raise ValueError(f"mask ratios must sum to 1 (identity included), got {total:.6f}: {ratios}")
        self.mask_ratios = ratios
        # Draw order = dict order, as the reference walks the cumulative sum.
        self._names = list(ratios)
        self._cum = jnp.cumsum(jnp.asarray([max(ratios[n], 0.0) for n in self._names], jnp.float32))

    def mask_type_index(self, u):
        """u ~ U(0,1) → index into `self._names` (first cumulative bound exceeding u)."""
        idx = jnp.sum(u >= self._cum)
        return jnp.minimum(idx, len(self._names) - 1)

    def get_mask(self, key, num_frames: int) -> jax.Array:
        """[T] bool for one sample."""
        t = int(num_frames)
        if t <= 1:
            return jnp.ones((t,), bool)
        k_type, k_size, k_pos, k_ratio, k_rand = jax.random.split(key, 5)
        qmax = max(t // 4, 1)
        size = jax.random.randint(k_size, (), 1, qmax + 1)  # randint(1, qmax) inclusive
        frames = jnp.arange(t)
        ones = jnp.ones((t,), bool)

        def quarter_random():
            pos = jax.random.randint(k_pos, (), 0, t - size + 1)
            return ~((frames >= pos) & (frames < pos + size))

        def image_random():
            pos = jax.random.randint(k_pos, (), 0, t)
            return frames != pos

        def random_mask():
            ratio = jax.random.uniform(k_ratio, (), minval=0.1, maxval=0.9)
            m = jax.random.uniform(k_rand, (t,)) > ratio
            return jnp.where(jnp.any(m), m, m.at[-1].set(True))

        def interpolate():
            start = jax.random.randint(k_pos, (), 0, 2)
            return ~((frames >= start) & ((frames - start) % 2 == 0))

        builders = {
            "identity": lambda: ones,
            "quarter_random": quarter_random,
            "quarter_head": lambda: frames >= size,
            "quarter_tail": lambda: frames < t - size,
            "quarter_head_tail": lambda: (frames >= size) & (frames < t - size),
            "image_random": image_random,
            "image_head": lambda: frames != 0,
            "image_tail": lambda: frames != t - 1,
            "image_head_tail": lambda: (frames != 0) & (frames != t - 1),
            "random": random_mask,
            "intepolate": interpolate,
        }
        idx = self.mask_type_index(jax.random.uniform(k_type, ()))
        return jax.lax.switch(idx, [builders[n] for n in self._names])

    def get_masks(self, key, batch_size: int, num_frames: int) -> jax.Array:
        """[B, T] bool, one independent draw per sample."""
        keys = jax.random.split(key, batch_size)
        return jax.vmap(lambda k: self.get_mask(k, num_frames))(keys)
