"""Video autoencoders behind one interface: `encode(video, key)`, `encode_mean(video)`,
`decode(z, num_frames)` on [B, C, T, H, W], `out_channels`, `get_latent_size((T, H, W))`.

`IdentityVAE` works in pixel space (optionally average-pooled), so a small STDiT3 learns on CPU in
minutes (the demo). The OpenSora VAE v1.2 (spatial SDXL AutoencoderKL + temporal VAE) lives beside it.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from einops import rearrange, repeat


class IdentityVAE:
    """Pixel-space "VAE": encode = average pool by `downsample` (t, h, w) and multiply by `scale`;
    decode = nearest upsample of z / scale. An exact round trip when downsample is (1, 1, 1).
    Pixels in [-1, 1] have roughly unit scale already, so `scale` defaults to 1."""

    def __init__(self, downsample: Sequence[int] = (1, 1, 1), scale: float = 1.0):
        self.downsample = tuple(int(d) for d in downsample)
        if len(self.downsample) != 3 or min(self.downsample) < 1:
            raise ValueError(f"downsample must be three positive ints (t, h, w), got {downsample}")
        self.scale = float(scale)
        self.out_channels = 3

    def get_latent_size(self, size):
        return tuple(-(-int(n) // d) for n, d in zip(size, self.downsample))

    def encode_mean(self, video: jax.Array) -> jax.Array:
        ft, fh, fw = self.downsample
        b, c, t, h, w = video.shape
        pad = [(0, 0), (0, 0)] + [(0, (-n) % f) for n, f in zip((t, h, w), self.downsample)]
        v = jnp.pad(video.astype(jnp.float32), pad, mode="edge")
        z = rearrange(v, "b c (t ft) (h fh) (w fw) -> b c t h w (ft fh fw)", ft=ft, fh=fh, fw=fw).mean(-1)
        return z * self.scale

    def encode(self, video: jax.Array, key: jax.Array = None) -> jax.Array:
        return self.encode_mean(video)

    def decode(self, z: jax.Array, num_frames: int) -> jax.Array:
        ft, fh, fw = self.downsample
        x = jnp.asarray(z, jnp.float32) / self.scale
        x = repeat(x, "b c t h w -> b c (t ft) (h fh) (w fw)", ft=ft, fh=fh, fw=fw)
        return x[:, :, :num_frames]
