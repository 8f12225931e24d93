"""Config groups → components: the text encoder, the VAE and the STDiT3 config of a run's `text_encoder`,
`vae` and `model` groups. Used by training (`jaxsora.train.build`) and by sampling
(`jaxsora.infer.loading`, which rebuilds the encoders from the config stored in a checkpoint), so it
lives below both.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.models.config import STDiT3Config
from jaxsora.models.contracts import VAE, TextEncoder
from jaxsora.models.presets import get_model_config


def _plain(cfg) -> dict:
    if cfg is None:
        return {}
    return dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)


# The keys each kind uses; a config group may carry both kinds' keys (so that a stage config can be
# switched to the tiny encoder from the command line) and each builder takes its own.
_TEXT_KEYS = {"t5": {"kind", "path", "model_max_length", "dtype", "tokenizer", "param_dtype"},
              "tiny": {"kind", "d_model", "num_layers", "num_heads", "d_ff", "d_kv", "model_max_length", "seed",
                       "dtype"}}
_VAE_KEYS = {"identity": {"downsample", "scale"}, "opensora": {"path", "dtype"}}


def _own_keys(cfg, table) -> dict:
    cfg = _plain(cfg)
    keys = table.get(cfg.get("kind"))
    return {k: v for k, v in cfg.items() if k in keys or k == "kind"} if keys is not None else cfg


def frozen_encoder_configs(config) -> dict:
    """{"vae": ..., "text_encoder": ...}: the encoder settings of `config` that latents and text
    states depend on (a feature cache records them; a run training from it must match them, since
    its checkpoints are sampled with these encoders)."""
    return dict(vae=_own_keys(config.vae, _VAE_KEYS), text_encoder=_own_keys(config.text_encoder, _TEXT_KEYS))


def build_text_encoder_from_config(cfg: Mapping[str, Any], *, mesh=None, rules=None) -> TextEncoder:
    from jaxsora.models.t5 import build_text_encoder

    return build_text_encoder(_own_keys(cfg, _TEXT_KEYS), mesh=mesh, rules=rules)


def build_vae_from_config(cfg: Mapping[str, Any], *, abstract: bool = False) -> VAE:
    """`{"kind": "identity", "downsample": [1, f, f]}` (pixel space, the CPU demo) or
    `{"kind": "opensora", "path": file_or_folder, "dtype": "bfloat16"}` (OpenSora VAE v1.2).
    `abstract=True`: the OpenSora VAE's architecture with shapes only (no file is read)."""
    from jaxsora.models import vae as vae_lib

    cfg = _own_keys(cfg, _VAE_KEYS)
    kind = cfg.pop("kind", None)
    if kind == "identity":
        return vae_lib.IdentityVAE(**cfg)
    if kind == "opensora":
        path = cfg.pop("path", None)
        if abstract:
            vcfg = vae_lib.get_vae_config("OpenSoraVAE_V1_2", dtype=str(cfg.get("dtype", "float32")))
            return vae_lib.abstract_model(lambda: vae_lib.OpenSoraVAE(vcfg, rngs=nnx.Rngs(0)))
        if not path:
            raise ValueError("vae kind 'opensora' needs 'path' (the OpenSora-VAE-v1.2 weights)")
        return vae_lib.load_opensora_vae(path, **cfg)
    raise ValueError(f"vae 'kind' must be 'identity' or 'opensora', got {kind!r}")


# The `model` group's shape keys: None (the base config's placeholders) means the preset's own.
PRESET_SHAPE = ("depth", "hidden_size", "num_heads")


def build_model_config(cfg: Mapping[str, Any], *, in_channels: int, caption_channels: int,
                       model_max_length: int) -> STDiT3Config:
    """`cfg` = {"name": preset, **STDiT3Config overrides}; the encoders fix the channel counts,
    as the reference's train.py does (in_channels from the VAE, caption size from T5)."""
    cfg = {k: v for k, v in _plain(cfg).items() if not (k in PRESET_SHAPE and v is None)}
    name = cfg.pop("name", "STDiT3-XL/2")
    cfg.update(in_channels=in_channels, caption_channels=caption_channels, model_max_length=model_max_length)
    return get_model_config(name, **cfg)
