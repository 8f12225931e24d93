"""Checks a run config before any work starts, naming what is wrong.

`ml_collections` already refuses unknown keys and wrong types in `--config.a.b=value` overrides
(the config is locked); this adds the checks that need to look outside the config: files that
must exist, mesh sizes, schedules, mask ratios and the bucket table.
"""
from __future__ import annotations

import os
import sys


class ConfigError(ValueError):
    pass


def _need_file(path, what):
    if not path:
        raise ConfigError(f"{what} is not set")
    if not os.path.exists(path):
        raise ConfigError(f"{what}: no such file or folder: {path}")


def validate_config(config, opts=None) -> None:
    """Raise ConfigError naming the first problem."""
    for group in ("model", "vae", "text_encoder", "data", "scheduler", "optim", "mesh", "train"):
        if group not in config:
            raise ConfigError(f"config has no '{group}' group")

    _need_file(config.data.get("table"), "data.table (--data-path)")
    dry = bool(opts is not None and opts.dry_run)
    for group, kind in (("vae", "opensora"), ("text_encoder", "t5")):
        if config[group].get("kind") == kind:
            try:
                _need_file(config[group].get("path"), f"{group}.path")
            except ConfigError as e:
                if not dry:
                    raise
                print(f"[jaxsora] dry run: {e} (needed to train)", file=sys.stderr)
    if opts is not None:
        if opts.load and opts.ckpt_path:
            raise ConfigError("give either --load (resume everything) or --ckpt-path (weights only), not both")
        if opts.start_from_scratch and not opts.load:
            raise ConfigError("--start-from-scratch only makes sense with --load DIR")
        for flag, path in (("--load", opts.load), ("--ckpt-path", opts.ckpt_path)):
            if path and not os.path.exists(path):
                raise ConfigError(f"{flag}: no such file or folder: {path}")

    for axis in ("data", "fsdp", "sequence"):
        v = config.mesh.get(axis, 1)
        if not isinstance(v, int) or (v < 1 and v != -1):
            raise ConfigError(f"mesh.{axis} must be a positive int or -1, got {v!r}")
    import jax

    from jaxsora.parallel.mesh import MeshError, mesh_shape

    try:
        mesh_shape(config.mesh, jax.device_count())
    except MeshError as e:
        raise ConfigError(str(e)) from e

    from jaxsora.train.optim import lr_schedule

    try:
        lr_schedule(config.optim)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"optim: {e}") from e
    if not 0.0 <= float(config.optim.ema_decay) <= 1.0:
        raise ConfigError(f"optim.ema_decay must lie in [0, 1], got {config.optim.ema_decay}")

    from jaxsora.diffusion.masks import MaskGenerator

    ratios = config.get("mask_ratios")
    if ratios:
        try:
            MaskGenerator(dict(ratios))
        except ValueError as e:
            raise ConfigError(f"mask_ratios: {e}") from e
    method = config.scheduler.get("sample_method", "logit-normal")
    if method not in ("uniform", "logit-normal"):
        raise ConfigError(f"scheduler.sample_method must be uniform or logit-normal, got {method!r}")

    from jaxsora.models.presets import available

    if config.model.get("name") not in available():
        raise ConfigError(f"model.name {config.model.get('name')!r} is not a preset; available: {available()}")
    from jaxsora.train.build import build_model_config

    try:  # every model field (remat policy, remat_blocks, ...); the encoders fix the channel counts later
        build_model_config(config.model, in_channels=4, caption_channels=64, model_max_length=8)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model: {e}") from e

    load_bucket_config_file(config)
    from jaxsora.data import buckets

    try:
        extra = config.data.get("resolutions") or None
        extra = extra.to_dict() if hasattr(extra, "to_dict") else extra
        buckets.validate_bucket_config(config.data.bucket_config, extra)
    except ValueError as e:
        raise ConfigError(f"data.bucket_config: {e}") from e


def load_bucket_config_file(config) -> None:
    """`data.bucket_config_file` (a JSON file, e.g. from `python -m jaxsora.tools.search_bs`)
    replaces `data.bucket_config`."""
    path = config.data.get("bucket_config_file")
    if not path:
        return
    import json

    import ml_collections

    _need_file(path, "data.bucket_config_file")
    try:
        with open(path) as f:
            loaded = json.load(f)
    except ValueError as e:
        raise ConfigError(f"data.bucket_config_file {path}: not JSON ({e})") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"data.bucket_config_file {path}: expected {{resolution: {{frames: [keep_prob, batch]}}}}")
    with config.unlocked():
        config.data.bucket_config = ml_collections.ConfigDict(loaded)
