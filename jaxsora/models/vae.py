"""Video autoencoders behind one interface: `encode(video, key)`, `encode_mean(video)`,
`decode(z, num_frames)` on `[B, C, T, H, W]`, `out_channels`, `get_latent_size((T, H, W))`.

* `OpenSoraVAE`: Open-Sora 1.2's `VideoAutoencoderPipeline` as `OpenSoraVAE_V1_2` configures it
  (`opensora/models/vae/vae.py`): a diffusers `AutoencoderKL` per frame (the SDXL-VAE architecture, latents x 0.18215),
  then the causal temporal VAE (`VAE_Temporal_SD`, 4x in time) on 17-frame chunks, then a per-channel
  `(z - shift) / scale`. Parameter paths equal the reference state-dict keys
  (`spatial_vae.module.*`, `temporal_vae.*`, `scale`, `shift`), so `load_opensora_vae` is a copy.
* `load_spatial_vae(folder)`: a diffusers `AutoencoderKL` folder on its own (diffusers layout and scale).
* `IdentityVAE`: pixel space (optionally average-pooled), for the CPU demo.

Inputs are pixels in [-1, 1]; outputs are float32. `dtype` is the compute dtype (bfloat16 on GPU,
as Open-Sora runs its VAE); parameters stay float32.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange, repeat
from flax import nnx

from jaxsora.errors import MissingFile
from jaxsora.io.fill import fill_module
from jaxsora.io.weights import open_state_dict
from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.models.layers import Buffer
from jaxsora.models.vae_layers import (
    AutoencoderKL,
    SpatialVAEConfig,
    TemporalVAE,
    TemporalVAEConfig,
    gaussian_sample,
    shapes_only_init,
)

# Open-Sora 1.2 (opensora/models/vae/vae.py, VideoAutoencoderKL): latents are multiplied by the SD1
# constant 0.18215 on encode and divided by it on decode (hard-coded; not SDXL's 0.13025).
SPATIAL_SCALING_FACTOR = 0.18215
# Open-Sora 1.2 OpenSoraVAE_V1_2: per-channel normalisation of the temporal latent.
OPENSORA_V1_2_SHIFT = (-0.10, 0.34, 0.27, 0.98)
OPENSORA_V1_2_SCALE = (3.85, 2.32, 2.33, 3.06)
# Open-Sora 1.2 OpenSoraVAE_V1_2 defaults: micro_frame_size=17 (temporal encode chunk, in frames),
# micro_batch_size=4 (frames per spatial-VAE call).
MICRO_FRAME_SIZE = 17
MICRO_BATCH_SIZE = 4

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _as_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type if dtype is not None else jnp.float32


# --------------------------------------------------------------------------------------------
# configs and presets
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpenSoraVAEConfig:
    spatial: SpatialVAEConfig = SpatialVAEConfig()
    temporal: TemporalVAEConfig = TemporalVAEConfig()
    micro_frame_size: int | None = MICRO_FRAME_SIZE  # None: the whole clip in one temporal call
    micro_batch_size: int | None = MICRO_BATCH_SIZE  # None: all frames in one spatial call
    shift: tuple[float, ...] = OPENSORA_V1_2_SHIFT
    scale: tuple[float, ...] = OPENSORA_V1_2_SCALE
    scaling_factor: float = SPATIAL_SCALING_FACTOR
    dtype: str = "float32"  # compute dtype


# The refharness tiny configs (ref_vae.TINY_SPATIAL_CONFIG / TINY_TEMPORAL_CONFIG).
TINY_SPATIAL = SpatialVAEConfig(block_out_channels=(16, 32, 32, 32), layers_per_block=2, norm_num_groups=8)
TINY_TEMPORAL = TemporalVAEConfig(filters=32, num_res_blocks=2, num_groups=8)

VAE_PRESETS: dict[str, OpenSoraVAEConfig] = {
    # Open-Sora 1.2: SDXL-VAE spatial part + VAE_Temporal_SD, 17-frame chunks, 4-frame micro-batches.
    "OpenSoraVAE_V1_2": OpenSoraVAEConfig(),
    "tiny": OpenSoraVAEConfig(spatial=TINY_SPATIAL, temporal=TINY_TEMPORAL),
}


def get_vae_config(name: str | OpenSoraVAEConfig = "OpenSoraVAE_V1_2", **overrides) -> OpenSoraVAEConfig:
    """A preset ("OpenSoraVAE_V1_2", "tiny") or a config, with field overrides."""
    if isinstance(name, OpenSoraVAEConfig):
        cfg = name
    elif name in VAE_PRESETS:
        cfg = VAE_PRESETS[name]
    else:
        raise ValueError(f"unknown VAE preset {name!r}: use one of {sorted(VAE_PRESETS)}")
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _map_frames(module: nnx.Module, method: str, frames: jax.Array, micro: int | None):
    """Apply `module.method` to frames `[N, ...]` in micro-batches of `micro` frames with
    `jax.lax.map` (jittable; the last chunk is zero-padded, each frame is independent)."""
    n = frames.shape[0]
    if micro is None or n <= micro:
        return getattr(module, method)(frames)
    chunks = -(-n // micro)
    pad = chunks * micro - n
    x = jnp.pad(frames, ((0, pad),) + ((0, 0),) * (frames.ndim - 1))
    x = x.reshape((chunks, micro) + frames.shape[1:])
    graphdef, state = nnx.split(module)

    def body(chunk):
        return getattr(nnx.merge(graphdef, state), method)(chunk)

    out = jax.lax.map(body, x)
    return jax.tree.map(lambda a: a.reshape((chunks * micro,) + a.shape[2:])[:n], out)


def latent_frames(num_frames: int, micro_frame_size: int | None = MICRO_FRAME_SIZE, factor: int = 4) -> int:
    """Open-Sora 1.2 latent frame count: each full chunk of 17 frames -> 5 latents, the rest r -> ceil(r/4).
    1 -> 1, 17 -> 5, 34 -> 10, 51 -> 15, 102 -> 30."""
    t = int(num_frames)
    if micro_frame_size is None:
        return -(-t // factor)
    per_chunk = -(-micro_frame_size // factor)
    return per_chunk * (t // micro_frame_size) + -(-(t % micro_frame_size) // factor)


class VideoAutoencoderKL(nnx.Module):
    """Open-Sora's `VideoAutoencoderKL`: holds the diffusers-style `AutoencoderKL` as `.module`
    (hence the `spatial_vae.module.*` keys)."""

    def __init__(self, config: SpatialVAEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.module = AutoencoderKL(config, rngs=rngs, dtype=dtype)


# --------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------
class OpenSoraVAE(nnx.Module):
    """Open-Sora 1.2 video VAE (`OpenSoraVAE_V1_2` / `VideoAutoencoderPipeline`).

    encode:  video [B, 3, T, H, W] in [-1, 1] -> z [B, 4, T_lat, H/8, W/8] (normalised latent)
    decode:  z [B, 4, T_lat, h, w], num_frames -> video [B, 3, num_frames, 8h, 8w] (not clamped)
    T_lat = 5 * (T // 17) + ceil((T % 17) / 4), see `get_latent_size`.
    """

    def __init__(self, config: OpenSoraVAEConfig = OpenSoraVAEConfig(), *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = _as_dtype(config.dtype)
        if config.spatial.latent_channels != config.temporal.in_out_channels:
            raise ValueError(f"spatial latent_channels={config.spatial.latent_channels} != temporal "
                             f"in_out_channels={config.temporal.in_out_channels}")
        self.spatial_vae = VideoAutoencoderKL(config.spatial, rngs=rngs, dtype=self.dtype)
        self.temporal_vae = TemporalVAE(config.temporal, rngs=rngs, dtype=self.dtype)
        c = config.temporal.embed_dim
        if len(config.shift) != c or len(config.scale) != c:
            raise ValueError(f"shift/scale need {c} entries, got {config.shift} / {config.scale}")
        # registered as buffers [1, C, 1, 1, 1] upstream
        self.scale = Buffer(jnp.asarray(config.scale, jnp.float32).reshape(1, c, 1, 1, 1))
        self.shift = Buffer(jnp.asarray(config.shift, jnp.float32).reshape(1, c, 1, 1, 1))

    @classmethod
    def from_config(cls, config: str | OpenSoraVAEConfig = "OpenSoraVAE_V1_2", *, seed: int = 0,
                    rngs: nnx.Rngs | None = None, **overrides) -> OpenSoraVAE:
        """Random-weight model from a preset name or config (for shapes only:
        `abstract_model(lambda: OpenSoraVAE.from_config(...))`, i.e. `nnx.eval_shape`)."""
        return cls(get_vae_config(config, **overrides), rngs=rngs if rngs is not None else nnx.Rngs(seed))

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def out_channels(self) -> int:
        return self.config.temporal.in_out_channels  # VideoAutoencoderPipeline.out_channels

    @property
    def spatial_factor(self) -> int:
        return self.config.spatial.downsample_factor

    def get_latent_size(self, size: Sequence[int | None]) -> tuple[int | None, ...]:
        """(T, H, W) pixels -> (T_lat, H // 8, W // 8); None stays None."""
        t, h, w = size
        f = self.spatial_factor
        return (None if t is None else latent_frames(t, self.config.micro_frame_size,
                                                     self.config.temporal.time_downsample_factor),
                None if h is None else int(h) // f, None if w is None else int(w) // f)

    # ---- encode ------------------------------------------------------------------------------
    def _spatial_moments(self, video: jax.Array):
        """video [B, 3, T, H, W] -> (mean, logvar) [B, T, h, w, 4] of the per-frame posterior."""
        b = video.shape[0]
        frames = rearrange(video, "b c t h w -> (b t) h w c").astype(self.dtype)
        mean, logvar = _map_frames(self.spatial_vae.module, "moments_nhwc", frames, self.config.micro_batch_size)
        return (rearrange(mean, "(b t) h w c -> b t h w c", b=b), rearrange(logvar, "(b t) h w c -> b t h w c", b=b))

    def _temporal_moments(self, xz: jax.Array):
        """xz [B, T, h, w, 4] (scaled spatial latents) -> (mean, logvar) [B, T_lat, h, w, 4]: independent
        chunks of micro_frame_size frames (full chunks are folded into the batch), concatenated in T."""
        tv, m = self.temporal_vae, self.config.micro_frame_size
        b, t = xz.shape[:2]
        if m is None or t <= m:
            return tv.moments(xz)
        n_full, rest = divmod(t, m)
        full = rearrange(xz[:, :n_full * m], "b (n t) h w c -> (b n) t h w c", n=n_full)
        outs = [tuple(rearrange(a, "(b n) t h w c -> b (n t) h w c", b=b) for a in tv.moments(full))]
        if rest:
            outs.append(tv.moments(xz[:, n_full * m:]))
        return tuple(jnp.concatenate([o[i] for o in outs], axis=1) for i in range(2))

    def _normalize(self, z_btHWc: jax.Array) -> jax.Array:
        z = rearrange(z_btHWc, "b t h w c -> b c t h w")
        return (z - self.shift[...]) / self.scale[...]

    def encode_mean(self, video: jax.Array) -> jax.Array:
        """video [B, 3, T, H, W] -> normalised posterior means [B, 4, T_lat, H/8, W/8] (deterministic:
        both posteriors give their mean, the reference harness' `pipeline_encode(sample=False)`)."""
        mean, _ = self._spatial_moments(video)
        zt, _ = self._temporal_moments((mean * self.config.scaling_factor).astype(self.dtype))
        return self._normalize(zt)

    def encode(self, video: jax.Array, key: jax.Array) -> jax.Array:
        """As the reference encodes: samples the spatial posterior (then x 0.18215) and the temporal
        posterior with `key`. video [B, 3, T, H, W] -> [B, 4, T_lat, H/8, W/8]."""
        k_spatial, k_temporal = jax.random.split(key)
        mean, logvar = self._spatial_moments(video)
        xz = gaussian_sample(mean, logvar, k_spatial) * self.config.scaling_factor
        zm, zlv = self._temporal_moments(xz.astype(self.dtype))
        return self._normalize(gaussian_sample(zm, zlv, k_temporal))

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, z: jax.Array, num_frames: int) -> jax.Array:
        """z [B, 4, T_lat, h, w] (normalised) -> video [B, 3, num_frames, 8h, 8w] float32.

        z * scale + shift; the temporal VAE on chunks of 5 latent frames, chunk k decoded to
        min(17, num_frames - 17k) frames; then the spatial decoder on z / 0.18215 per frame."""
        num_frames = int(num_frames)
        b, _, tl = z.shape[:3]
        expected = self.get_latent_size((num_frames, None, None))[0]
        if tl != expected:
            raise ValueError(f"decode: z has {tl} latent frames but num_frames={num_frames} needs {expected}")
        z = z.astype(jnp.float32) * self.scale[...] + self.shift[...]
        z = rearrange(z, "b c t h w -> b t h w c").astype(self.dtype)
        tv, m = self.temporal_vae, self.config.micro_frame_size
        if m is None or tl <= latent_frames(m, m):
            xz = tv.decode(z, min(num_frames, m) if m else num_frames)
        else:
            mz = latent_frames(m, m)  # 5 latent frames per 17-frame chunk
            n_full = min(tl // mz, num_frames // m)
            full = rearrange(z[:, :n_full * mz], "b (n t) h w c -> (b n) t h w c", n=n_full)
            parts = [rearrange(tv.decode(full, m), "(b n) t h w c -> b (n t) h w c", b=b)]
            left = num_frames - n_full * m
            for s in range(n_full * mz, tl, mz):  # the remainder (at most one chunk for consistent inputs)
                parts.append(tv.decode(z[:, s:s + mz], min(m, left)))
                left -= m
            xz = jnp.concatenate(parts, axis=1)
        frames = rearrange(xz, "b t h w c -> (b t) h w c") / self.config.scaling_factor
        x = _map_frames(self.spatial_vae.module, "decode_nhwc", frames.astype(self.dtype),
                        self.config.micro_batch_size)
        return rearrange(x, "(b t) h w c -> b c t h w", b=b).astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# weight loading
# --------------------------------------------------------------------------------------------
def abstract_model(build):
    """`nnx.eval_shape(build)` without tracing the random initializers (shapes and dtypes only)."""
    with shapes_only_init():
        return nnx.eval_shape(build)


def _flat_keys(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """'.'-joined NNX paths (= PyTorch state-dict keys) -> shape, for every Param/Buffer."""
    _, state = nnx.split(model)
    return {".".join(str(p) for p in path): tuple(v.shape) for path, v in nnx.to_flat_state(state)}


# diffusers' legacy attention names (old checkpoints) -> current ones; diffusers converts them at load too.
_LEGACY_ATTN = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _modernize_spatial_keys(sd: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if "attentions" in parts and len(parts) >= 2 and parts[-2] in _LEGACY_ATTN:
            k = ".".join(parts[:-2] + [_LEGACY_ATTN[parts[-2]], parts[-1]])
        if ".attentions." in k and k.endswith(".weight") and v.ndim == 4 and v.shape[2:] == (1, 1):
            v = v[:, :, 0, 0]  # conv-1x1 attention projections of very old checkpoints
        out[k] = v
    return out


def load_spatial_vae(folder: str | os.PathLike, dtype="float32") -> AutoencoderKL:
    """A diffusers `AutoencoderKL` folder (`config.json` + `diffusion_pytorch_model.safetensors`, or a
    `vae/` subfolder holding them) -> `AutoencoderKL` with `encode_mean(x)` / `decode(z)` on
    `[B, C, H, W]`, in the diffusers layout and scale (no scaling factor)."""
    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")) and os.path.isdir(os.path.join(folder, "vae")):
        folder = os.path.join(folder, "vae")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise MissingFile(f"{folder}: no config.json (expected a diffusers AutoencoderKL folder)")
    with open(cfg_path) as f:
        config = SpatialVAEConfig.from_diffusers(json.load(f), source=cfg_path)
    sd = _modernize_spatial_keys(open_state_dict(folder))
    dt = _as_dtype(dtype)
    abstract = abstract_model(lambda: AutoencoderKL(config, rngs=nnx.Rngs(0), dtype=dt))
    return fill_module(abstract, sd, source=folder, dtype=np.float32)[0]  # parameters stay float32


def load_opensora_vae(path: str | os.PathLike, dtype="float32",
                      config: str | OpenSoraVAEConfig = "OpenSoraVAE_V1_2", **overrides) -> OpenSoraVAE:
    """The Open-Sora VAE v1.2 checkpoint (`spatial_vae.module.*`, `temporal_vae.*`, `scale`, `shift`;
    hpcai-tech/OpenSora-VAE-v1.2) from `.safetensors`, `.pth`/`.bin` or a folder with
    `model.safetensors`. `config` names the architecture (default: the real one); the loaded
    `scale`/`shift` buffers replace the config's values."""
    sd = open_state_dict(path)
    spatial = {k[len("spatial_vae.module."):]: v for k, v in sd.items() if k.startswith("spatial_vae.module.")}
    spatial = {"spatial_vae.module." + k: v for k, v in _modernize_spatial_keys(spatial).items()}
    sd = {**{k: v for k, v in sd.items() if not k.startswith("spatial_vae.module.")}, **spatial}
    cfg = get_vae_config(config, dtype=dtype if isinstance(dtype, str) else jnp.dtype(dtype).name, **overrides)
    for name in ("scale", "shift"):
        if name in sd:
            cfg = dataclasses.replace(cfg, **{name: tuple(float(v) for v in np.asarray(sd[name]).reshape(-1))})
    abstract = abstract_model(lambda: OpenSoraVAE(cfg, rngs=nnx.Rngs(0)))
    return fill_module(abstract, sd, source=os.fspath(path), dtype=np.float32)[0]


def state_dict_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Reference state-dict key -> shape of a model (works on `nnx.eval_shape` results)."""
    return _flat_keys(model)


def to_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """Reference state-dict (PyTorch keys and layouts) as float32 numpy arrays."""
    _, state = nnx.split(model)
    return {".".join(str(p) for p in path): np.asarray(v[...], np.float32) for path, v in nnx.to_flat_state(state)}


def load_state_dict(model: nnx.Module, tensors: dict[str, np.ndarray], source: str = "state dict") -> nnx.Module:
    """A new model of `model`'s structure holding `tensors` (keys/shapes checked)."""
    return fill_module(nnx.clone(model), tensors, source=source, dtype=np.float32)[0]


# --------------------------------------------------------------------------------------------
# pixel-space stand-in
# --------------------------------------------------------------------------------------------
class IdentityVAE:
    """Pixel-space "VAE" for the CPU demo, with `OpenSoraVAE`'s interface.

    encode = average pool by `downsample` (t, h, w) (edge-padded to a multiple), times `scale`;
    decode = nearest upsample of z / scale, cropped to num_frames (and to the pooled size x factor).
    Channels stay 3 (`out_channels` = 3). An exact round trip when downsample is (1, 1, 1).
    Pixels in [-1, 1] have roughly unit scale already (natural video has std ~0.5), so `scale`
    defaults to 1; pass e.g. 2.0 for latents of about unit variance."""

    def __init__(self, downsample: Sequence[int] = (1, 1, 1), scale: float = 1.0):
        self.downsample = tuple(int(d) for d in downsample)
        if len(self.downsample) != 3 or min(self.downsample) < 1:
            raise ValueError(f"downsample must be three positive ints (t, h, w), got {downsample}")
        self.scale = float(scale)
        self.out_channels = 3

    def get_latent_size(self, size):
        return tuple(None if n is None else -(-int(n) // d) for n, d in zip(size, self.downsample))

    def encode_mean(self, video: jax.Array) -> jax.Array:
        """video [B, 3, T, H, W] -> [B, 3, ceil(T/ft), ceil(H/fh), ceil(W/fw)]."""
        ft, fh, fw = self.downsample
        b, c, t, h, w = video.shape
        pad = [(0, 0), (0, 0)] + [(0, (-n) % f) for n, f in zip((t, h, w), self.downsample)]
        v = jnp.pad(video.astype(jnp.float32), pad, mode="edge")
        z = rearrange(v, "b c (t ft) (h fh) (w fw) -> b c t h w (ft fh fw)", ft=ft, fh=fh, fw=fw).mean(-1)
        return z * self.scale

    def encode(self, video: jax.Array, key: jax.Array = None) -> jax.Array:
        """Deterministic: the same as `encode_mean` (the key is accepted for interface parity)."""
        return self.encode_mean(video)

    def decode(self, z: jax.Array, num_frames: int) -> jax.Array:
        """z [B, 3, t, h, w] -> [B, 3, num_frames, h*fh, w*fw] (nearest)."""
        ft, fh, fw = self.downsample
        x = jnp.asarray(z, jnp.float32) / self.scale
        x = repeat(x, "b c t h w -> b c (t ft) (h fh) (w fw)", ft=ft, fh=fh, fw=fw)
        return x[:, :, :num_frames]
