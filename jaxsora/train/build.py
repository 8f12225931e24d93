"""Config groups → components: the model config, the text encoder and the VAE.

Shared by `python -m jaxsora.train` and `python -m jaxsora.sample` (the sampler rebuilds the
encoders from the config stored in a checkpoint).
"""
from __future__ import annotations

from typing import Any, Mapping

from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3Config


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


def build_text_encoder_from_config(cfg: Mapping[str, Any], *, mesh=None, rules=None):
    from jaxsora.models.t5 import build_text_encoder

    cfg = _plain(cfg)
    keys = _TEXT_KEYS.get(cfg.get("kind"))
    if keys is not None:
        cfg = {k: v for k, v in cfg.items() if k in keys}
    return build_text_encoder(cfg, mesh=mesh, rules=rules)


def build_vae_from_config(cfg: Mapping[str, Any]):
    """`{"kind": "identity", "downsample": [1, f, f]}` (pixel space, the CPU demo) or
    `{"kind": "opensora", "path": file_or_folder, "dtype": "bfloat16"}` (OpenSora VAE v1.2)."""
    from jaxsora.models import vae as vae_lib

    cfg = _plain(cfg)
    kind = cfg.pop("kind", None)
    if kind in _VAE_KEYS:
        cfg = {k: v for k, v in cfg.items() if k in _VAE_KEYS[kind]}
    if kind == "identity":
        return vae_lib.IdentityVAE(**cfg)
    if kind == "opensora":
        path = cfg.pop("path", None)
        if not path:
            raise ValueError("vae kind 'opensora' needs 'path' (the OpenSora-VAE-v1.2 weights)")
        return vae_lib.load_opensora_vae(path, **cfg)
    raise ValueError(f"vae 'kind' must be 'identity' or 'opensora', got {kind!r}")


def build_model_config(cfg: Mapping[str, Any], *, in_channels: int, caption_channels: int,
                       model_max_length: int) -> STDiT3Config:
    """`cfg` = {"name": preset, **STDiT3Config overrides}; the encoders fix the channel counts,
    as the reference's train.py does (in_channels from the VAE, caption size from T5)."""
    cfg = _plain(cfg)
    name = cfg.pop("name", "STDiT3-XL/2")
    cfg.update(in_channels=in_channels, caption_channels=caption_channels, model_max_length=model_max_length)
    return get_model_config(name, **cfg)


def encoder_dims(config) -> tuple[int, int, int]:
    """(latent channels, caption channels, max text length) from the config alone, without loading
    weights (for --dry-run): Open-Sora VAE → 4, identity → 3; a T5 folder's config.json d_model,
    else T5-v1.1-XXL's 4096; a tiny encoder's d_model."""
    import json
    import os

    vae_kind = config.vae.get("kind")
    in_ch = 4 if vae_kind == "opensora" else 3
    te = config.text_encoder
    max_len = int(te.get("model_max_length", 300))
    if te.get("kind") == "tiny":
        return in_ch, int(te.get("d_model", 32)), max_len
    cap = 4096  # T5-v1.1-XXL d_model (Open-Sora 1.2 caption_channels)
    cfg_file = os.path.join(str(te.get("path", "")), "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cap = int(json.load(f).get("d_model", cap))
    return in_ch, cap, max_len
