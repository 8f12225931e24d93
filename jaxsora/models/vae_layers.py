"""Building blocks of the Open-Sora 1.2 video VAE, in Flax NNX.

Two networks live here:

* `AutoencoderKL`: the diffusers image VAE (the SDXL-VAE architecture that `OpenSoraVAE_V1_2` wraps),
  i.e. diffusers' `Encoder`/`Decoder` with `DownEncoderBlock2D`/`UpDecoderBlock2D` blocks of
  `ResnetBlock2D`, a mid-block with one single-head self-attention, `quant_conv`/`post_quant_conv`.
* `TemporalVAE`: Open-Sora's `VAE_Temporal` (MAGVIT-v2 style causal 3D convs,
  `opensora/models/vae/vae_temporal.py` at tag v1.2.0), 4x temporal compression, no spatial
  down-sampling.

Conventions (so that loading a PyTorch state_dict is a pure renaming-free copy):

* Every parameter's NNX path joined with "." **is** its PyTorch state-dict key, and every parameter
  keeps the PyTorch layout: conv weights `[O, I, *kernel]`, linear weights `[out, in]`.
* Activations are channels-last inside (`[N, H, W, C]` / `[N, T, H, W, C]`); the convolutions tell XLA
  the PyTorch kernel layout through `dimension_numbers`, so no weight transposes are needed.
* Parameters are float32; `dtype` is the compute dtype. GroupNorm statistics and the attention softmax
  are computed in float32, as in the reference (diffusers upcasts the VAE softmax).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx

from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable

# diffusers AutoencoderKL: every GroupNorm / the mid-block attention norm uses eps 1e-6
# (Encoder/Decoder `resnet_eps=1e-6`, `conv_norm_out` eps=1e-6).
SPATIAL_NORM_EPS = 1e-6
# Open-Sora 1.2 VAE_Temporal: `nn.GroupNorm(num_groups, C)` with PyTorch's default eps 1e-5.
TEMPORAL_NORM_EPS = 1e-5
# Both posteriors (diffusers DiagonalGaussianDistribution and Open-Sora's copy in vae/utils.py)
# clamp the log-variance to [-30, 20].
LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0


# --------------------------------------------------------------------------------------------
# generic layers
# --------------------------------------------------------------------------------------------
_SHAPES_ONLY = contextvars.ContextVar("jaxsora_vae_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only_init():
    """Inside `nnx.eval_shape` only: initializers return zeros instead of tracing `jax.random`
    (the values are abstract there anyway; tracing ~500 threefry draws costs seconds)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _torch_uniform(fan_in: int):
    """PyTorch's default Conv/Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (only used when a
    model is built without weights; real use loads a checkpoint).

    With a concrete key the numbers are drawn on the host with numpy (seeded from the key), because
    hundreds of eager `jax.random` calls of distinct shapes each compile a program (minutes for the
    full model on CPU); under a trace (`nnx.eval_shape`, `jit`) it is `jax.random.uniform`."""
    bound = 1.0 / math.sqrt(max(fan_in, 1))

    def init(key, shape, dtype=jnp.float32):
        if _SHAPES_ONLY.get():
            return jnp.zeros(shape, dtype)
        try:
            seed = np.asarray(jax.random.key_data(key)).astype(np.uint32).ravel().tolist()
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return jax.random.uniform(key, shape, dtype, -bound, bound)
        rng = np.random.default_rng(seed)
        return jnp.asarray(rng.uniform(-bound, bound, shape).astype(np.float32), dtype)

    return init


class Identity(nnx.Module):
    """Parameter-free placeholder, kept so list indices match PyTorch's `nn.Identity` slots."""

    def __call__(self, x):
        return x


class Conv(nnx.Module):
    """N-d convolution (N = 2 or 3) on channels-last input, weight in PyTorch layout `[O, I, *k]`.

    `padding` is explicit zero padding per spatial dim, `((lo, hi), ...)`, matching the order of the
    kernel dims (T, H, W) / (H, W)."""

    def __init__(self, cin: int, cout: int, kernel: Sequence[int], *, stride: Sequence[int] | int = 1,
                 padding: Sequence[tuple[int, int]] | None = None, bias: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        kernel = tuple(int(k) for k in kernel)
        nd = len(kernel)
        if nd not in (2, 3):
            raise ValueError(f"Conv supports 2-d and 3-d kernels, got {kernel}")
        self.stride = (stride,) * nd if isinstance(stride, int) else tuple(stride)
        self.padding = tuple(padding) if padding is not None else tuple((k // 2, k // 2) for k in kernel)
        self.dtype = dtype
        fan_in = cin * math.prod(kernel)
        self.weight = nnx.Param(_torch_uniform(fan_in)(rngs.params(), (cout, cin) + kernel))
        self.bias = nnx.Param(_torch_uniform(fan_in)(rngs.params(), (cout,))) if bias else None
        self._dn = ("NHWC", "OIHW", "NHWC") if nd == 2 else ("NDHWC", "OIDHW", "NDHWC")

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.conv_general_dilated(
            x.astype(self.dtype), self.weight[...].astype(self.dtype), window_strides=self.stride,
            padding=self.padding, dimension_numbers=self._dn)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Linear(nnx.Module):
    """`y = x W^T + b` with the PyTorch weight layout `[out, in]`."""

    def __init__(self, din: int, dout: int, *, bias: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        self.weight = nnx.Param(_torch_uniform(din)(rngs.params(), (dout, din)))
        self.bias = nnx.Param(_torch_uniform(din)(rngs.params(), (dout,))) if bias else None

    def __call__(self, x):
        y = jnp.einsum("...i,oi->...o", x.astype(self.dtype), self.weight[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm on channels-last input `[N, ..., C]`: groups of consecutive channels,
    biased variance over (spatial dims, channels of the group), float32 statistics."""

    def __init__(self, num_groups: int, channels: int, *, eps: float, dtype=jnp.float32):
        if channels % num_groups:
            raise ValueError(f"GroupNorm: {channels} channels are not divisible by {num_groups} groups")
        self.num_groups, self.eps, self.dtype = num_groups, eps, dtype
        self.weight = nnx.Param(jnp.asarray(np.ones((channels,), np.float32)))
        self.bias = nnx.Param(jnp.asarray(np.zeros((channels,), np.float32)))

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        g = self.num_groups
        xg = x.astype(jnp.float32).reshape(shape[:-1] + (g, shape[-1] // g))
        axes = tuple(range(1, xg.ndim - 2)) + (xg.ndim - 1,)
        mean = xg.mean(axes, keepdims=True)
        var = jnp.square(xg - mean).mean(axes, keepdims=True)
        y = ((xg - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (y * self.weight[...] + self.bias[...]).astype(self.dtype)


def gaussian_split(moments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Channels-last moments `[..., 2L]` -> (mean, clamped logvar), each `[..., L]` in float32."""
    mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
    return mean, jnp.clip(logvar, LOGVAR_MIN, LOGVAR_MAX)


def gaussian_sample(mean: jax.Array, logvar: jax.Array, key: jax.Array) -> jax.Array:
    """`mean + exp(logvar / 2) * N(0, 1)` (DiagonalGaussianDistribution.sample)."""
    return mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape, jnp.float32)


# --------------------------------------------------------------------------------------------
# spatial VAE: diffusers AutoencoderKL
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpatialVAEConfig:
    """The subset of a diffusers `AutoencoderKL` config.json this port supports
    (all-`DownEncoderBlock2D` / `UpDecoderBlock2D` blocks, SiLU)."""

    in_channels: int = 3
    out_channels: int = 3
    # SDXL VAE (PixArt-alpha/pixart_sigma_sdxlvae_T5_diffusers, subfolder vae): (128, 256, 512, 512)
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_diffusers(cls, cfg: dict, source: str = "config") -> SpatialVAEConfig:
        """From a diffusers `AutoencoderKL` config dict (config.json); unsupported variants raise."""
        n = len(cfg.get("block_out_channels", (64,)))
        down = tuple(cfg.get("down_block_types", ("DownEncoderBlock2D",) * n))
        up = tuple(cfg.get("up_block_types", ("UpDecoderBlock2D",) * n))
        if any(b != "DownEncoderBlock2D" for b in down) or any(b != "UpDecoderBlock2D" for b in up):
            raise ValueError(f"{source}: only DownEncoderBlock2D/UpDecoderBlock2D blocks are supported, "
                             f"got down_block_types={down}, up_block_types={up}")
        if len(down) != n or len(up) != n:
            raise ValueError(f"{source}: {len(down)} down / {len(up)} up blocks for {n} block_out_channels")
        if cfg.get("act_fn", "silu") != "silu":
            raise ValueError(f"{source}: act_fn={cfg['act_fn']!r} is not supported (only 'silu')")
        if cfg.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
            raise ValueError(f"{source}: _class_name={cfg['_class_name']!r}, expected 'AutoencoderKL'")
        return cls(
            in_channels=int(cfg.get("in_channels", 3)),
            out_channels=int(cfg.get("out_channels", 3)),
            block_out_channels=tuple(int(c) for c in cfg.get("block_out_channels", (64,))),
            layers_per_block=int(cfg.get("layers_per_block", 1)),
            latent_channels=int(cfg.get("latent_channels", 4)),
            norm_num_groups=int(cfg.get("norm_num_groups", 32)),
            use_quant_conv=bool(cfg.get("use_quant_conv", True)),
            use_post_quant_conv=bool(cfg.get("use_post_quant_conv", True)),
            mid_block_add_attention=bool(cfg.get("mid_block_add_attention", True)),
        )


def _conv2d(cin, cout, k, *, rngs, dtype, stride=1, padding=None, bias=True):
    return Conv(cin, cout, (k, k), stride=stride, padding=padding, bias=bias, dtype=dtype, rngs=rngs)


class ResnetBlock2D(nnx.Module):
    """diffusers ResnetBlock2D without time embedding: GN-SiLU-conv3-GN-SiLU-conv3 (+1x1 shortcut)."""

    def __init__(self, cin: int, cout: int, groups: int, *, rngs, dtype):
        self.norm1 = GroupNorm(groups, cin, eps=SPATIAL_NORM_EPS, dtype=dtype)
        self.conv1 = _conv2d(cin, cout, 3, rngs=rngs, dtype=dtype)
        self.norm2 = GroupNorm(groups, cout, eps=SPATIAL_NORM_EPS, dtype=dtype)
        self.conv2 = _conv2d(cout, cout, 3, rngs=rngs, dtype=dtype)
        self.conv_shortcut = _conv2d(cin, cout, 1, rngs=rngs, dtype=dtype) if cin != cout else None

    def __call__(self, x):  # x: [N, H, W, C]
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + h  # output_scale_factor = 1


class Downsample2D(nnx.Module):
    """diffusers Downsample2D(padding=0): zero-pad right/bottom by one, then a stride-2 3x3 conv."""

    def __init__(self, c: int, *, rngs, dtype):
        self.conv = _conv2d(c, c, 3, stride=2, padding=((0, 1), (0, 1)), rngs=rngs, dtype=dtype)

    def __call__(self, x):
        return self.conv(x)


class Upsample2D(nnx.Module):
    """diffusers Upsample2D: nearest x2, then a 3x3 conv."""

    def __init__(self, c: int, *, rngs, dtype):
        self.conv = _conv2d(c, c, 3, rngs=rngs, dtype=dtype)

    def __call__(self, x):  # [N, H, W, C] -> [N, 2H, 2W, C]
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x)


class DownEncoderBlock2D(nnx.Module):
    def __init__(self, cin, cout, num_layers, groups, add_downsample, *, rngs, dtype):
        self.resnets = nnx.List([ResnetBlock2D(cin if i == 0 else cout, cout, groups, rngs=rngs, dtype=dtype)
                                 for i in range(num_layers)])
        self.downsamplers = nnx.List([Downsample2D(cout, rngs=rngs, dtype=dtype)]) if add_downsample else None

    def __call__(self, x):
        for r in self.resnets:
            x = r(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class UpDecoderBlock2D(nnx.Module):
    def __init__(self, cin, cout, num_layers, groups, add_upsample, *, rngs, dtype):
        self.resnets = nnx.List([ResnetBlock2D(cin if i == 0 else cout, cout, groups, rngs=rngs, dtype=dtype)
                                 for i in range(num_layers)])
        self.upsamplers = nnx.List([Upsample2D(cout, rngs=rngs, dtype=dtype)]) if add_upsample else None

    def __call__(self, x):
        for r in self.resnets:
            x = r(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class VAEAttention(nnx.Module):
    """The mid-block self-attention of diffusers' VAE: GroupNorm, one head of width C over the H*W
    tokens, softmax(q k^T / sqrt(C)) in float32, output projection, residual."""

    def __init__(self, c: int, groups: int, *, rngs, dtype):
        self.dtype = dtype
        self.group_norm = GroupNorm(groups, c, eps=SPATIAL_NORM_EPS, dtype=dtype)
        self.to_q = Linear(c, c, rngs=rngs, dtype=dtype)
        self.to_k = Linear(c, c, rngs=rngs, dtype=dtype)
        self.to_v = Linear(c, c, rngs=rngs, dtype=dtype)
        self.to_out = nnx.List([Linear(c, c, rngs=rngs, dtype=dtype)])

    def __call__(self, x):  # x: [N, H, W, C]
        n, h, w, c = x.shape
        t = self.group_norm(x).reshape(n, h * w, c)
        q, k, v = self.to_q(t), self.to_k(t), self.to_v(t)
        logits = jnp.einsum("nqc,nkc->nqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(c)
        p = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        o = self.to_out[0](jnp.einsum("nqk,nkc->nqc", p, v))
        return x + o.reshape(n, h, w, c).astype(x.dtype)


class UNetMidBlock2D(nnx.Module):
    def __init__(self, c: int, groups: int, add_attention: bool, *, rngs, dtype):
        self.resnets = nnx.List([ResnetBlock2D(c, c, groups, rngs=rngs, dtype=dtype) for _ in range(2)])
        self.attentions = nnx.List([VAEAttention(c, groups, rngs=rngs, dtype=dtype)]) if add_attention else None

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder2D(nnx.Module):
    def __init__(self, cfg: SpatialVAEConfig, *, rngs, dtype):
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = _conv2d(cfg.in_channels, ch[0], 3, rngs=rngs, dtype=dtype)
        blocks, prev = [], ch[0]
        for i, c in enumerate(ch):
            blocks.append(DownEncoderBlock2D(prev, c, cfg.layers_per_block, g, i < len(ch) - 1,
                                             rngs=rngs, dtype=dtype))
            prev = c
        self.down_blocks = nnx.List(blocks)
        self.mid_block = UNetMidBlock2D(ch[-1], g, cfg.mid_block_add_attention, rngs=rngs, dtype=dtype)
        self.conv_norm_out = GroupNorm(g, ch[-1], eps=SPATIAL_NORM_EPS, dtype=dtype)
        self.conv_out = _conv2d(ch[-1], 2 * cfg.latent_channels, 3, rngs=rngs, dtype=dtype)  # double_z

    def __call__(self, x):  # [N, H, W, 3] -> [N, H/f, W/f, 2L]
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder2D(nnx.Module):
    def __init__(self, cfg: SpatialVAEConfig, *, rngs, dtype):
        ch, g = tuple(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = _conv2d(cfg.latent_channels, ch[0], 3, rngs=rngs, dtype=dtype)
        self.mid_block = UNetMidBlock2D(ch[0], g, cfg.mid_block_add_attention, rngs=rngs, dtype=dtype)
        blocks, prev = [], ch[0]
        for i, c in enumerate(ch):
            blocks.append(UpDecoderBlock2D(prev, c, cfg.layers_per_block + 1, g, i < len(ch) - 1,
                                           rngs=rngs, dtype=dtype))
            prev = c
        self.up_blocks = nnx.List(blocks)
        self.conv_norm_out = GroupNorm(g, ch[-1], eps=SPATIAL_NORM_EPS, dtype=dtype)
        self.conv_out = _conv2d(ch[-1], cfg.out_channels, 3, rngs=rngs, dtype=dtype)

    def __call__(self, z):  # [N, h, w, L] -> [N, h*f, w*f, 3]
        x = self.mid_block(self.conv_in(z))
        for b in self.up_blocks:
            x = b(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """diffusers `AutoencoderKL` (parameter names and layouts as its state_dict).

    Public methods use the diffusers layout `[B, C, H, W]` and scale (no scaling factor):
    `encode_mean(x)` = `encode(x).latent_dist.mean`, `encode_moments(x)` = (mean, clamped logvar),
    `decode(z)` = `decode(z).sample`. The `*_nhwc` methods are the channels-last internals."""

    def __init__(self, config: SpatialVAEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.encoder = Encoder2D(config, rngs=rngs, dtype=dtype)
        self.decoder = Decoder2D(config, rngs=rngs, dtype=dtype)
        L = config.latent_channels
        self.quant_conv = _conv2d(2 * L, 2 * L, 1, rngs=rngs, dtype=dtype) if config.use_quant_conv else None
        self.post_quant_conv = _conv2d(L, L, 1, rngs=rngs, dtype=dtype) if config.use_post_quant_conv else None

    def moments_nhwc(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, H, W, 3] -> (mean, logvar) [N, H/f, W/f, L] float32."""
        m = self.encoder(x)
        if self.quant_conv is not None:
            m = self.quant_conv(m)
        return gaussian_split(m)

    def decode_nhwc(self, z: jax.Array) -> jax.Array:
        """z [N, h, w, L] (unscaled) -> pixels [N, h*f, w*f, 3] float32."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z.astype(self.dtype))
        return self.decoder(z).astype(jnp.float32)

    def encode_moments(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, C, H, W] -> (mean, logvar) [B, L, H/f, W/f]."""
        mean, logvar = self.moments_nhwc(rearrange(x, "b c h w -> b h w c"))
        return rearrange(mean, "b h w c -> b c h w"), rearrange(logvar, "b h w c -> b c h w")

    def encode_mean(self, x: jax.Array) -> jax.Array:
        """x [B, C, H, W] -> posterior mean [B, L, H/f, W/f] (diffusers `latent_dist.mean`)."""
        return self.encode_moments(x)[0]

    def decode(self, z: jax.Array) -> jax.Array:
        """z [B, L, h, w] (unscaled latent) -> image [B, C, h*f, w*f] (diffusers `decode(z).sample`)."""
        return rearrange(self.decode_nhwc(rearrange(z, "b c h w -> b h w c")), "b h w c -> b c h w")


# --------------------------------------------------------------------------------------------
# temporal VAE: Open-Sora VAE_Temporal
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TemporalVAEConfig:
    """`VAE_Temporal` kwargs. Defaults = Open-Sora 1.2 `VAE_Temporal_SD`
    (filters 128, 4 ResBlocks per level, multipliers (1, 2, 2, 4), time down-sampling after
    levels 1 and 2, 32 groups)."""

    in_out_channels: int = 4
    latent_embed_dim: int = 4
    embed_dim: int = 4
    filters: int = 128
    num_res_blocks: int = 4
    channel_multipliers: tuple[int, ...] = (1, 2, 2, 4)
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    num_groups: int = 32

    @property
    def time_downsample_factor(self) -> int:
        return 2 ** sum(bool(t) for t in self.temporal_downsample)

    def latent_frames(self, t: int) -> int:
        """Latent frames of a clip of t frames: zeros are prepended to a multiple of the factor."""
        f = self.time_downsample_factor
        return -(-int(t) // f)


class CausalConv3d(nnx.Module):
    """Open-Sora CausalConv3d: time padded only in front by (k_t - 1) + (1 - stride_t), H and W
    symmetrically by k // 2, then a Conv3d with stride (s_t, 1, 1). Holds the conv as `.conv`."""

    def __init__(self, cin: int, cout: int, kernel: int | Sequence[int] = 3, *, t_stride: int = 1,
                 bias: bool = True, rngs, dtype):
        k = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        kt, kh, kw = k
        pad = ((kt - 1 + 1 - t_stride, 0), (kh // 2, kh // 2), (kw // 2, kw // 2))
        self.conv = Conv(cin, cout, k, stride=(t_stride, 1, 1), padding=pad, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x):  # [N, T, H, W, C]
        return self.conv(x)


class ResBlock3d(nnx.Module):
    """Open-Sora ResBlock: GN-SiLU-conv3^3-GN-SiLU-conv3^3 (no biases), 1^3 shortcut `conv3` when
    the width changes."""

    def __init__(self, cin: int, cout: int, groups: int, *, rngs, dtype):
        self.norm1 = GroupNorm(groups, cin, eps=TEMPORAL_NORM_EPS, dtype=dtype)
        self.conv1 = CausalConv3d(cin, cout, 3, bias=False, rngs=rngs, dtype=dtype)
        self.norm2 = GroupNorm(groups, cout, eps=TEMPORAL_NORM_EPS, dtype=dtype)
        self.conv2 = CausalConv3d(cout, cout, 3, bias=False, rngs=rngs, dtype=dtype)
        self.conv3 = CausalConv3d(cin, cout, 1, bias=False, rngs=rngs, dtype=dtype) if cin != cout else None

    def __call__(self, x):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        if self.conv3 is not None:
            x = self.conv3(x)
        return h + x


class TemporalEncoder(nnx.Module):
    def __init__(self, cfg: TemporalVAEConfig, *, rngs, dtype):
        f, n, g = cfg.filters, len(cfg.channel_multipliers), cfg.num_groups
        self.conv_in = CausalConv3d(cfg.in_out_channels, f, 3, bias=False, rngs=rngs, dtype=dtype)
        levels, convs, prev = [], [], f
        for i, m in enumerate(cfg.channel_multipliers):
            c = f * m
            blocks = []
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResBlock3d(prev, c, g, rngs=rngs, dtype=dtype))
                prev = c
            levels.append(nnx.List(blocks))
            if i < n - 1:
                if cfg.temporal_downsample[i]:
                    convs.append(CausalConv3d(prev, c, 3, t_stride=2, rngs=rngs, dtype=dtype))
                else:
                    convs.append(Identity())
        self.block_res_blocks = nnx.List(levels)
        self.conv_blocks = nnx.List(convs)
        self.res_blocks = nnx.List([ResBlock3d(prev, prev, g, rngs=rngs, dtype=dtype)
                                    for _ in range(cfg.num_res_blocks)])
        self.norm1 = GroupNorm(g, prev, eps=TEMPORAL_NORM_EPS, dtype=dtype)
        self.conv2 = CausalConv3d(prev, 2 * cfg.latent_embed_dim, 1, rngs=rngs, dtype=dtype)

    def __call__(self, x):  # [N, T, H, W, C_in] -> [N, T/4, H, W, 2 * latent_embed_dim]
        x = self.conv_in(x)
        for i, level in enumerate(self.block_res_blocks):
            for blk in level:
                x = blk(x)
            if i < len(self.conv_blocks):
                x = self.conv_blocks[i](x)
        for blk in self.res_blocks:
            x = blk(x)
        return self.conv2(jax.nn.silu(self.norm1(x)))


class TemporalDecoder(nnx.Module):
    def __init__(self, cfg: TemporalVAEConfig, *, rngs, dtype):
        f, n, g = cfg.filters, len(cfg.channel_multipliers), cfg.num_groups
        self.temporal_downsample = tuple(bool(t) for t in cfg.temporal_downsample)
        top = f * cfg.channel_multipliers[-1]
        self.conv1 = CausalConv3d(cfg.latent_embed_dim, top, 3, bias=True, rngs=rngs, dtype=dtype)
        self.res_blocks = nnx.List([ResBlock3d(top, top, g, rngs=rngs, dtype=dtype)
                                    for _ in range(cfg.num_res_blocks)])
        levels, convs, prev = [None] * n, [None] * (n - 1), top
        for i in reversed(range(n)):  # built deepest first, stored by level index (as upstream)
            c = f * cfg.channel_multipliers[i]
            blocks = []
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResBlock3d(prev, c, g, rngs=rngs, dtype=dtype))
                prev = c
            levels[i] = nnx.List(blocks)
            if i > 0:
                ts = 2 if self.temporal_downsample[i - 1] else 1
                convs[i - 1] = (CausalConv3d(prev, prev * ts, 3, rngs=rngs, dtype=dtype) if ts > 1
                                else Identity())
        self.block_res_blocks = nnx.List(levels)
        self.conv_blocks = nnx.List(convs)
        self.norm1 = GroupNorm(g, prev, eps=TEMPORAL_NORM_EPS, dtype=dtype)
        self.conv_out = CausalConv3d(prev, cfg.in_out_channels, 3, rngs=rngs, dtype=dtype)

    def __call__(self, z):  # [N, t, H, W, latent_embed_dim] -> [N, 4t, H, W, C_out]
        x = self.conv1(z)
        for blk in self.res_blocks:
            x = blk(x)
        for i in reversed(range(len(self.block_res_blocks))):
            for blk in self.block_res_blocks[i]:
                x = blk(x)
            if i > 0 and self.temporal_downsample[i - 1]:
                # depth-to-time: channel index c * 2 + t_offset ("B (C ts) T H W -> B C (T ts) H W")
                x = rearrange(self.conv_blocks[i - 1](x), "n t h w (c ts) -> n (t ts) h w c", ts=2)
        return self.conv_out(jax.nn.silu(self.norm1(x)))


class TemporalVAE(nnx.Module):
    """Open-Sora `VAE_Temporal`, channels-last: `moments(x)` and `decode(z, num_frames)`."""

    def __init__(self, config: TemporalVAEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.encoder = TemporalEncoder(config, rngs=rngs, dtype=dtype)
        self.quant_conv = CausalConv3d(2 * config.latent_embed_dim, 2 * config.embed_dim, 1, rngs=rngs, dtype=dtype)
        self.post_quant_conv = CausalConv3d(config.embed_dim, config.latent_embed_dim, 1, rngs=rngs, dtype=dtype)
        self.decoder = TemporalDecoder(config, rngs=rngs, dtype=dtype)

    def time_padding(self, num_frames: int) -> int:
        f = self.config.time_downsample_factor
        return (f - num_frames % f) % f

    def moments(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, T, H, W, C] -> (mean, clamped logvar) [N, ceil(T/4), H, W, embed_dim], float32.
        Zeros are prepended in time to a multiple of 4 (VAE_Temporal.encode)."""
        pad = self.time_padding(x.shape[1])
        x = jnp.pad(x.astype(self.dtype), ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
        return gaussian_split(self.quant_conv(self.encoder(x)))

    def decode(self, z: jax.Array, num_frames: int) -> jax.Array:
        """z [N, t, H, W, embed_dim] -> [N, 4t - pad, H, W, C] float32, dropping the first
        pad = (4 - num_frames % 4) % 4 frames (VAE_Temporal.decode)."""
        x = self.decoder(self.post_quant_conv(z.astype(self.dtype)))
        return x[:, self.time_padding(int(num_frames)):].astype(jnp.float32)
