"""Config groups → components: the model config, the text encoder, the VAE, and the frozen
encoders as the jitted train step sees them (`Encoders`).

Shared by `python -m jaxsora.train`, its dry run, `jaxsora.tools.search_bs` and
`python -m jaxsora.sample` (the sampler rebuilds the encoders from the config stored in a
checkpoint). With `abstract=True` the encoders are shapes only (no weights are read): the dry run
and the batch-size search compile the real step without the multi-GB VAE and T5 files.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.models.contracts import VAE, TextEncoder  # noqa: F401  (the encoders' types, re-exported)
from jaxsora.models.from_config import (  # noqa: F401  (re-exported: train.build's names)
    _TEXT_KEYS,
    _VAE_KEYS,
    _own_keys,
    _plain,
    build_model_config,
    build_text_encoder_from_config,
    build_vae_from_config,
    frozen_encoder_configs,
)


# --------------------------------------------------------------------------------------------
# the encoders of a train step
# --------------------------------------------------------------------------------------------
class TextInputs:
    """Captions → the step's text inputs, on the host — inside the loader's workers, so neither
    tokenization nor cache reads run on the training thread. Picklable.

    With a tokenizer: ids [b, L] int32 (the step runs T5); with a text-state cache: the cached
    states themselves as `ids` [b, L, D] float32 (each row's caption hash is checked)."""

    def __init__(self, tokenizer=None, cache=None):
        if (tokenizer is None) == (cache is None):
            raise ValueError("TextInputs needs exactly one of a tokenizer or a text-state cache")
        self.tokenizer, self.cache = tokenizer, cache

    def __call__(self, texts: Sequence[str], rows: Sequence[int]) -> dict:
        texts = [str(t) for t in texts]
        if self.cache is not None:
            y, mask = self.cache.lookup(np.asarray(rows), texts)
            return dict(ids=np.asarray(y, np.float32)[:, 0], text_mask=np.asarray(mask, np.int32))
        ids, mask = self.tokenizer(texts)
        mask = np.asarray(mask, np.int32)
        full = np.nonzero(mask.sum(axis=1) >= mask.shape[1])[0]
        if len(full) and not getattr(self, "_said_truncated", False):
            # Said once per process (the loader's workers each say it once): the reference truncates too.
            self._said_truncated = True
            print(f"[jaxsora.data] a caption fills all {mask.shape[1]} text tokens (row {int(rows[full[0]])}); longer "
                  "captions are truncated to the tokenizer's model_max_length, as Open-Sora does", file=sys.stderr,
                  flush=True)
        return dict(ids=np.asarray(ids, np.int32), text_mask=mask)


@dataclasses.dataclass
class Encoders:
    """The frozen VAE and text encoder as jit arguments plus the functions the step calls.

    weights: pytree of arrays (placed on the mesh once) or of ShapeDtypeStructs (abstract);
    encode_video(weights, video [B, 3, T, H, W] in [-1, 1], key) → latents [B, C, t, h, w];
    encode_text(weights, ids, mask) → text states [B, L, D] float32;
    text_inputs: host-side captions → step inputs (None when abstract).
    """

    weights: Any
    encode_video: Callable
    encode_text: Callable
    latent_size: Callable[[Sequence[int]], tuple]
    in_channels: int
    caption_channels: int
    model_max_length: int
    text_from_cache: bool
    text_inputs: TextInputs | None
    latents_dtype: str | None = None  # set when the batches carry a feature cache's latents (no VAE)

    def video_spec(self, batch: int, size: Sequence[int]) -> dict:
        """Shape/dtype of the step's pixels for `batch` rows of pixel size (T, H, W): uint8 `video`,
        or `latents` [B, C, t, h, w] from a feature cache."""
        if self.latents_dtype is None:
            return dict(video=((batch, 3, *size), jnp.uint8))
        return dict(latents=((batch, self.in_channels, *self.latent_size(tuple(size))), jnp.dtype(self.latents_dtype)))

    def text_spec(self, batch: int) -> dict:
        """Shapes/dtypes of the step's `ids`/`text_mask` for `batch` rows."""
        L = self.model_max_length
        ids = ((batch, L, self.caption_channels), jnp.float32) if self.text_from_cache else ((batch, L), jnp.int32)
        return dict(ids=ids, text_mask=((batch, L), jnp.int32))


def _t5_abstract(cfg: dict):
    """T5's architecture from the folder's config.json (T5-v1.1-XXL when absent), shapes only."""
    from jaxsora.models import t5 as t5_lib

    if cfg.get("kind") == "tiny":
        cfg = {**t5_lib.TINY_DEFAULTS, **cfg}
        tcfg = t5_lib.tiny_t5_config(cfg["d_model"], cfg["num_layers"], cfg["num_heads"], cfg["d_ff"], cfg.get("d_kv"))
        dtype, param_dtype = jnp.dtype(cfg["dtype"]), jnp.float32
    else:
        path = os.path.join(str(cfg.get("path", "")), "config.json")
        tcfg = t5_lib.read_hf_config(os.path.dirname(path)) if os.path.isfile(path) else t5_lib.T5Config()
        dtype, param_dtype = jnp.dtype(cfg.get("dtype", "bfloat16")), jnp.dtype(cfg.get("param_dtype", "float32"))
    model = nnx.eval_shape(lambda: t5_lib.T5EncoderModel(tcfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                         param_dtype=param_dtype))
    return model, tcfg.d_model, int(cfg.get("model_max_length", t5_lib.OPENSORA_MODEL_MAX_LENGTH))


def build_encoders(config, mesh: jax.sharding.Mesh, rules, *, abstract: bool = False) -> Encoders:
    """The run's frozen encoders. T5 is read straight into its FSDP shards; the other weights are
    placed (replicated) on the mesh once, so no step re-sends them. With `data.text_cache` the
    cached states replace T5. `abstract=True`: shapes only (dry run, batch-size search)."""
    from jaxsora.parallel.sharding import abstract_with_shardings, tree_shardings

    if config.data.get("features"):
        return _feature_encoders(config)
    weights = {}
    vae = build_vae_from_config(config.vae, abstract=abstract)
    if isinstance(vae, nnx.Module):
        vae_graphdef, weights["vae"] = nnx.split(vae)

        def encode_video(enc, video, key):
            return nnx.merge(vae_graphdef, enc["vae"]).encode(video, key)
    else:  # parameter-free (IdentityVAE)
        def encode_video(enc, video, key):
            return vae.encode(video, key)

    cache = None
    te_graphdef = None
    text_cfg = _plain(config.text_encoder)
    if config.data.get("text_cache"):
        from jaxsora.data.cache import TextStateCache

        cache = TextStateCache(config.data.text_cache)
        cap, max_len, text_inputs = cache.caption_channels, cache.model_max_length, TextInputs(cache=cache)
    elif abstract:
        t5_abstract, cap, max_len = _t5_abstract(text_cfg)
        te_graphdef, weights["t5"] = nnx.split(t5_abstract)
        text_inputs = None
    else:
        te = build_text_encoder_from_config(config.text_encoder, mesh=mesh, rules=rules)
        te_graphdef, weights["t5"] = te.graphdef, te.state
        cap, max_len, text_inputs = te.caption_channels, te.model_max_length, TextInputs(tokenizer=te.tokenizer)

    def encode_text(enc, ids, mask):
        if te_graphdef is None:
            return ids.astype(jnp.float32)  # cached states [B, L, D]
        return nnx.merge(te_graphdef, enc["t5"])(ids, mask).astype(jnp.float32)

    shardings = tree_shardings(weights, mesh, rules)
    weights = abstract_with_shardings(weights, shardings) if abstract else jax.device_put(weights, shardings)
    return Encoders(weights, encode_video, encode_text, vae.get_latent_size, int(vae.out_channels), int(cap),
                    int(max_len), cache is not None, text_inputs)


def _feature_encoders(config) -> Encoders:
    """`data.features`: the batches carry latents and text states, so neither the VAE nor T5 is
    loaded; only their shapes are read (the VAE's latent sizes, from its architecture). The
    config's encoders must be those the features were made with — they sample its checkpoints."""
    from jaxsora.data.features import FeatureStore
    from jaxsora.errors import ConfigError

    store = FeatureStore(config.data.features)
    ours, theirs = frozen_encoder_configs(config), {k: store.manifest.get(k) for k in ("vae", "text_encoder")}
    for name in ours:
        if json.loads(json.dumps(ours[name], default=str)) != theirs[name]:
            raise ConfigError(f"data.features {store.dir} was encoded with {name} {theirs[name]}, the config has "
                              f"{ours[name]}: set the config's {name} to the features' (it samples the checkpoints)")
    vae = build_vae_from_config(config.vae, abstract=True)
    if int(vae.out_channels) != store.latent_channels:
        raise ConfigError(f"data.features {store.dir}: latents have {store.latent_channels} channels, the config's VAE "
                          f"{vae.out_channels}")

    def no_encoder(*_):
        raise AssertionError("a data.features run encodes nothing: its batches carry latents and text states")

    return Encoders({}, no_encoder, lambda enc, ids, mask: ids.astype(jnp.float32), vae.get_latent_size,
                    store.latent_channels, store.caption_channels, store.model_max_length, True, None,
                    latents_dtype=store.dtype)
