"""Frame-conditioning masks for training (Open-Sora 1.2's `MaskGenerator`, `opensora/utils/train_utils.py`).

A mask is [T] bool over *latent* frames: True = a normal noised frame, False = a clean condition
frame (image-to-video, extension, interpolation). One mask type is drawn per sample with the
configured probabilities; `identity` (all True) takes what the others leave.

Driven by a `jax.random` key and usable inside jit (B and T static); the whole batch is drawn with
vectorized ops (no per-sample switch), so it compiles fast. The reference draws from python
`random`, so the draws are the same distribution, not the same numbers. Behaviour at the edges:
- T ≤ 1: all True, whatever the type (as the reference).
- quarter_* with T < 4: the reference crashes (randint(1, T // 4 = 0)); here the run length is
  drawn from 1..max(T // 4, 1), i.e. exactly 1 frame (quarter_head_tail with T = 2 then conditions
  both frames, as the reference's slicing would).
- `random` never returns all False: the last frame is set True (as the reference).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

# The reference's key names, in its order; "intepolate" (sic) is the spelling configs use.
MASK_TYPES = (
    "identity", "quarter_random", "quarter_head", "quarter_tail", "quarter_head_tail", "image_random",
    "image_head", "image_tail", "image_head_tail", "random", "intepolate",
)
# Open-Sora 1.2 MaskGenerator: condition runs are at most T // 4 frames ("condition_frames_max"),
# and the "random" type drops each frame with probability U(0.1, 0.9).
QUARTER_DIVISOR = 4
RANDOM_RATIO_RANGE = (0.1, 0.9)


class MaskGenerator:
    """mask_ratios: {type: probability} over `MASK_TYPES`; "identity" is added as 1 − Σ others if
    absent (last in draw order, as the reference). Raises ValueError naming `mask_ratios` for an
    unknown key, a ratio outside [0, 1], or a total ≠ 1 (tolerance 1e-6)."""

    def __init__(self, mask_ratios: Mapping[str, float]):
        ratios = {str(k): float(v) for k, v in dict(mask_ratios).items()}
        unknown = sorted(set(ratios) - set(MASK_TYPES))
        if unknown:
            raise ValueError(f"mask_ratios: unknown mask type(s) {unknown}; valid: {list(MASK_TYPES)}")
        bad = {k: v for k, v in ratios.items() if not 0.0 <= v <= 1.0}
        if bad:
            raise ValueError(f"mask_ratios: every ratio must lie in [0, 1], got {bad}")
        if "identity" not in ratios:  # reference: identity = 1 − Σ others, appended last
            ratios["identity"] = 1.0 - sum(ratios.values())
        total = sum(ratios.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6) or ratios["identity"] < -1e-6:
            raise ValueError(f"mask_ratios must sum to 1 (identity included, tolerance 1e-6), got {total:.6f}: "
                             f"{ratios}")
        self.mask_ratios = ratios
        # Draw order = dict order: the reference walks the cumulative sum in insertion order.
        self._names = list(ratios)
        self._cum = np.cumsum([max(ratios[n], 0.0) for n in self._names]).astype(np.float32)
        self._draw = jax.jit(self._draw_impl, static_argnums=(1, 2))

    @property
    def names(self) -> list:
        """Mask type names in draw order (the index `get_masks_and_types` returns)."""
        return list(self._names)

    def mask_type_index(self, u):
        """u ~ U(0,1), any shape → int32 index into `names`: the first type whose cumulative ratio
        exceeds u (the reference's walk over the dict); rounding past the end gives the last type."""
        u = jnp.asarray(u, jnp.float32)
        idx = jnp.sum(u[..., None] >= jnp.asarray(self._cum), axis=-1).astype(jnp.int32)
        return jnp.minimum(idx, len(self._names) - 1)

    def get_masks(self, key, batch_size: int, num_frames: int) -> jax.Array:
        """x_mask [B, T] bool (True = noised frame, False = clean condition frame), one independent
        draw per sample. batch_size and num_frames (latent frames) are static."""
        return self.get_masks_and_types(key, batch_size, num_frames)[0]

    def get_mask(self, key, num_frames: int) -> jax.Array:
        """[T] bool for one sample."""
        return self.get_masks(key, 1, num_frames)[0]

    def get_masks_and_types(self, key, batch_size: int, num_frames: int):
        """([B, T] bool masks, [B] int32 type indices into `names`). Compiled once per (B, T)."""
        return self._draw(key, int(batch_size), int(num_frames))

    def _draw_impl(self, key, b: int, t: int):
        # one draw per sample: type, run length, position, parity, random ratio, then T per-frame
        u = jax.random.uniform(key, (b, 5 + max(t, 0)))
        idx = self.mask_type_index(u[:, 0])
        if t <= 1:
            return jnp.ones((b, t), bool), idx
        frames = jnp.arange(t)[None]  # [1, T]

        def randint(v, lo, hi):  # inclusive integer in [lo, hi] from v ~ U(0, 1), per sample [B, 1]
            return jnp.clip(lo + jnp.floor(v * (hi - lo + 1)), lo, hi).astype(jnp.int32)[:, None]

        qmax = max(t // QUARTER_DIVISOR, 1)
        size = randint(u[:, 1], 1, qmax)  # randint(1, T // 4)
        run_pos = randint(u[:, 2], 0, t - size[:, 0])  # randint(0, T − size)
        img_pos = randint(u[:, 2], 0, t - 1)
        start = randint(u[:, 3], 0, 1)
        lo, hi = RANDOM_RATIO_RANGE
        ratio = (lo + (hi - lo) * u[:, 4])[:, None]
        rand = u[:, 5:] > ratio
        rand = rand | (~jnp.any(rand, axis=1, keepdims=True) & (frames == t - 1))  # never all False
        ones = jnp.ones((b, t), bool)
        head, tail = frames >= size, frames < t - size
        built = {
            "identity": ones,
            "quarter_random": ~((frames >= run_pos) & (frames < run_pos + size)),
            "quarter_head": head & ones,
            "quarter_tail": tail & ones,
            "quarter_head_tail": head & tail,
            "image_random": frames != img_pos,
            "image_head": (frames != 0) & ones,
            "image_tail": (frames != t - 1) & ones,
            "image_head_tail": (frames != 0) & (frames != t - 1) & ones,
            "random": rand,
            "intepolate": ~((frames >= start) & ((frames - start) % 2 == 0)),
        }
        stacked = jnp.stack([built[n] for n in self._names])  # [K, B, T]
        return jnp.take_along_axis(stacked, idx[None, :, None], axis=0)[0], idx
