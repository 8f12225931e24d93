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


def build_text_encoder_from_config(cfg: Mapping[str, Any], *, mesh=None, rules=None):
    from jaxsora.models.t5 import build_text_encoder

    return build_text_encoder(_plain(cfg), mesh=mesh, rules=rules)


def build_vae_from_config(cfg: Mapping[str, Any]):
    """`{"kind": "identity", "downsample": [1, f, f]}` (pixel space, the CPU demo) or
    `{"kind": "opensora", "path": file_or_folder, "dtype": "bfloat16"}` (OpenSora VAE v1.2)."""
    from jaxsora.models import vae as vae_lib

    cfg = _plain(cfg)
    kind = cfg.pop("kind", None)
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
