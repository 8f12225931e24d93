"""T5 v1.1 text encoder (Open-Sora 1.2's caption encoder) in Flax NNX, its loaders and tokenizers.

Open-Sora 1.2 (`opensora/models/text_encoder/t5.py`) encodes captions with the encoder half of `DeepFloyd/t5-v1_1-xxl`
(Hugging Face `T5EncoderModel`, d_model 4096, 24 layers, 64 heads, d_ff 10240), in bfloat16,
with the tokenizer padding/truncating every caption to 300 tokens (EOS appended) and returning
the attention mask. STDiT3 consumes `y = last_hidden_state[:, None]` `[B, 1, 300, 4096]` and the
mask `[B, 300]`; `caption_channels` of STDiT3 is therefore the encoder's `d_model`
(`TextEncoder.caption_channels`). The learned null caption (`y_embedding`) lives in STDiT3, not
here.

The encoder (`T5EncoderModel`) follows Hugging Face's `T5EncoderModel` math:

* token embedding `shared` `[V, D]`, no scaling, no absolute positions;
* per block: pre-norm self-attention with **no** 1/√d scaling (T5 convention) plus a relative
  position bias (bidirectional buckets, computed once from block 0's `relative_attention_bias`
  and shared by every block, as HF does), then a pre-norm feed-forward — gated GELU with the tanh
  approximation for v1.1 (`feed_forward_proj="gated-gelu"`), ReLU for the original T5;
* T5LayerNorm = RMS norm without bias or mean subtraction, variance in float32;
* a final RMS norm; no biases anywhere.

Parameters are float32 by default (`param_dtype`) and the computation runs in `dtype`
(bfloat16 on GPU); scores, softmax and norms' statistics are float32. Parameters carry logical
sharding names (`"vocab"`, `"embed"`, `"heads"`, `"mlp"`; `None` for small tensors) so T5-XXL
(4.7B parameters) can be sharded with the same rules table as STDiT3 (`load_t5_encoder(..., mesh=,
rules=)` places every tensor on its sharding as it is read).

Tokenizers: `HFTokenizer` wraps `transformers.AutoTokenizer` (SentencePiece `spiece.model` or a
`tokenizer.json`) with the reference's call (padding to `model_max_length`, truncation, EOS,
attention mask); `ByteTokenizer` is ByT5-style (id = utf-8 byte + 3, pad 0, EOS 1) and needs no
vocabulary file. `build_text_encoder(cfg)` gives a host-side `TextEncoder` for
`{"kind": "t5", "path": ...}` or a random-weight `{"kind": "tiny", ...}` byte-level encoder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.errors import MissingFile, UnknownKey
from jaxsora.io.fill import fill_module
from jaxsora.io.weights import open_state_dict
from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.models.text_defaults import TINY_DEFAULTS
from jaxsora.parallel import compile_options, constraints

# Open-Sora 1.2 (configs/opensora-v1-2/train/*.py, text_encoder): model_max_length=300.
OPENSORA_MODEL_MAX_LENGTH = 300
# T5 / ByT5 special ids (HF T5Config defaults: pad_token_id=0, eos_token_id=1; ByT5 unk=2).
PAD_ID = 0
EOS_ID = 1
BYTE_OFFSET = 3  # ByT5: token id = utf-8 byte + 3 (0 pad, 1 eos, 2 unk)
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class T5Config:
    """The encoder fields of a Hugging Face `T5Config`. Defaults: T5-v1.1-XXL
    (`DeepFloyd/t5-v1_1-xxl`, Open-Sora 1.2's text encoder)."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32  # HF T5Config default
    relative_attention_max_distance: int = 128  # HF T5Config default
    layer_norm_epsilon: float = 1e-6  # HF T5Config default
    feed_forward_proj: str = "gated-gelu"  # T5 v1.1; "relu" for the original T5

    def __post_init__(self):
        _ = self.activation  # validates feed_forward_proj

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def activation(self) -> Callable[[jax.Array], jax.Array]:
        """HF's `dense_act_fn`: "gated-gelu" means `gelu_new` (tanh approximation)."""
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(f"feed_forward_proj must be 'ACT' or 'gated-ACT', got {self.feed_forward_proj!r}")
        name = "gelu_new" if self.feed_forward_proj == "gated-gelu" else parts[-1]
        acts = {
            "relu": jax.nn.relu,
            "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
            "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
            "gelu": lambda x: jax.nn.gelu(x, approximate=False),
            "silu": jax.nn.silu,
            "swish": jax.nn.silu,
        }
        if name not in acts:
            raise ValueError(f"unsupported T5 activation {name!r} (feed_forward_proj={self.feed_forward_proj!r})")
        return acts[name]

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> T5Config:
        """From a Hugging Face `config.json` dict (T5EncoderModel or T5ForConditionalGeneration)."""
        missing = [k for k in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads") if k not in d]
        if missing:
            raise KeyError(f"T5 config.json lacks {missing}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: d[k] for k in fields if k in d})


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------
def _normal(std: float):
    def init(key, shape, dtype=jnp.float32):
        return std * jax.random.normal(key, shape, dtype)

    return init


def _param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, dtype))


class T5LayerNorm(nnx.Module):
    """RMS norm, scale only: `w · x / sqrt(mean(x²) + eps)`; statistics in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype, dtype):
        self.weight = nnx.Param(nnx.with_partitioning(jax.nn.initializers.ones, (None,))(None, (dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        return (self.weight[...].astype(jnp.float32) * (xf * jax.lax.rsqrt(var + self.eps))).astype(self.dtype)


class Linear(nnx.Module):
    """Bias-free linear; `weight` is stored `[in, out]` (HF's `[out, in]` transposed)."""

    def __init__(self, din: int, dout: int, names: tuple, std: float, *, rngs, param_dtype, dtype):
        self.weight = _param(rngs, _normal(std), (din, dout), names, param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,io->...o", x.astype(self.dtype), self.weight[...].astype(self.dtype))


def relative_position_bucket(q_len: int, k_len: int, num_buckets: int = 32, max_distance: int = 128) -> np.ndarray:
    """Bidirectional T5 buckets `[q_len, k_len]` int32 for relative position `k − q` (static).

    Half the buckets for k > q, half for k ≤ q; within a half, exact buckets for |d| < n/4 and
    log-spaced ones up to `max_distance` (everything beyond shares the last bucket). Computed in
    float32 with HF's operation order so the bucket edges agree exactly.
    """
    rel = np.arange(k_len, dtype=np.int64)[None, :] - np.arange(q_len, dtype=np.int64)[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).astype(np.int64) * half
    dist = np.abs(rel)
    max_exact = half // 2
    with np.errstate(divide="ignore"):
        large = np.log(dist.astype(np.float32) / np.float32(max_exact))
        large = large / np.float32(math.log(max_distance / max_exact)) * np.float32(half - max_exact)
    large = max_exact + np.where(dist < max_exact, 0, large).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (buckets + np.where(dist < max_exact, dist, large)).astype(np.int32)


class T5Attention(nnx.Module):
    def __init__(self, cfg: T5Config, has_relative_bias: bool, *, rngs, param_dtype, dtype):
        inner = cfg.num_heads * cfg.d_kv
        d = cfg.d_model
        # HF T5PreTrainedModel._init_weights stds (factor 1.0); used for random ("tiny") encoders.
        mk = lambda din, dout, names, std: Linear(
            din, dout, names, std, rngs=rngs, param_dtype=param_dtype, dtype=dtype
        )
        self.q = mk(d, inner, ("embed", "heads"), (d * cfg.d_kv) ** -0.5)
        self.k = mk(d, inner, ("embed", "heads"), d**-0.5)
        self.v = mk(d, inner, ("embed", "heads"), d**-0.5)
        self.o = mk(inner, d, ("heads", "embed"), inner**-0.5)
        if has_relative_bias:
            self.relative_attention_bias = _param(
                rngs,
                _normal(d**-0.5),
                (cfg.relative_attention_num_buckets, cfg.num_heads),
                (None, None),
                param_dtype,
            )
        self.cfg = cfg
        self.dtype = dtype

    def position_bias(self, length: int) -> jax.Array:
        """[1, H, L, L] float32 from this layer's bucket table (block 0 only)."""
        idx = relative_position_bucket(
            length,
            length,
            self.cfg.relative_attention_num_buckets,
            self.cfg.relative_attention_max_distance,
        )
        values = jnp.take(self.relative_attention_bias[...].astype(jnp.float32), jnp.asarray(idx), axis=0)
        return jnp.transpose(values, (2, 0, 1))[None]

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        """x: [B, L, D]; bias: [B or 1, H, L, L] float32 (position bias + key mask)."""
        b, n, _ = x.shape
        h, dk = self.cfg.num_heads, self.cfg.d_kv
        q = self.q(x).reshape(b, n, h, dk)
        k = self.k(x).reshape(b, n, h, dk)
        v = self.v(x).reshape(b, n, h, dk)
        # T5: no 1/sqrt(d_kv) scaling (it is folded into the weights' initialisation).
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) + bias
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, h * dk)
        return self.o(out)


class T5FeedForward(nnx.Module):
    """`wo(act(wi_0 x) · wi_1 x)` (gated, v1.1) or `wo(act(wi x))` (original T5)."""

    def __init__(self, cfg: T5Config, *, rngs, param_dtype, dtype):
        mk = lambda din, dout, names, std: Linear(
            din, dout, names, std, rngs=rngs, param_dtype=param_dtype, dtype=dtype
        )
        d, f = cfg.d_model, cfg.d_ff
        if cfg.is_gated:
            self.wi_0 = mk(d, f, ("embed", "mlp"), d**-0.5)
            self.wi_1 = mk(d, f, ("embed", "mlp"), d**-0.5)
        else:
            self.wi = mk(d, f, ("embed", "mlp"), d**-0.5)
        self.wo = mk(f, d, ("mlp", "embed"), f**-0.5)
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        act = self.cfg.activation
        hidden = act(self.wi_0(x)) * self.wi_1(x) if self.cfg.is_gated else act(self.wi(x))
        hidden = constraints.constrain(hidden, ("batch", "seq", "mlp"))
        return self.wo(hidden)


def _clamp_fp16(x: jax.Array) -> jax.Array:
    """HF T5Block: in float16, clamp to finfo.max − 1000 to keep inf out of the residual."""
    if x.dtype != jnp.float16:
        return x
    big = jnp.finfo(jnp.float16).max - 1000
    return jnp.clip(x, -big, big)


class T5Block(nnx.Module):
    def __init__(self, cfg: T5Config, has_relative_bias: bool, *, rngs, param_dtype, dtype):
        kw = dict(param_dtype=param_dtype, dtype=dtype)
        self.attn_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, **kw)
        self.attn = T5Attention(cfg, has_relative_bias, rngs=rngs, **kw)
        self.ff_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, **kw)
        self.ff = T5FeedForward(cfg, rngs=rngs, **kw)

    def __call__(self, h: jax.Array, bias: jax.Array) -> jax.Array:
        h = _clamp_fp16(h + self.attn(self.attn_norm(h), bias))
        h = _clamp_fp16(h + self.ff(self.ff_norm(h)))
        return constraints.constrain(h, ("batch", "seq", "embed"))


class T5EncoderModel(nnx.Module):
    """T5 encoder stack. `model(input_ids [B, L] int, attention_mask [B, L] 0/1)` →
    last hidden states `[B, L, d_model]` in `dtype` (HF `T5EncoderModel(...).last_hidden_state`).

    Padded query positions are computed too (they attend to the valid keys), exactly as HF does.
    """

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        kw = dict(param_dtype=param_dtype, dtype=self.dtype)
        self.shared = _param(rngs, _normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), param_dtype)
        self.block = nnx.List([T5Block(cfg, i == 0, rngs=rngs, **kw) for i in range(cfg.num_layers)])
        self.final_layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon, **kw)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        b, n = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, n), jnp.int32)
        h = jnp.take(self.shared[...], input_ids, axis=0).astype(self.dtype)
        h = constraints.constrain(h, ("batch", "seq", "embed"))
        # HF: additive key mask (1 − mask)·finfo(f32).min plus block 0's relative bias, shared.
        key_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
        bias = self.block[0].attn.position_bias(n) + key_bias.astype(jnp.float32)
        for blk in self.block:
            h = blk(h, bias)
        return self.final_layer_norm(h)


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoint loading
# --------------------------------------------------------------------------------------------
def hf_key_map(cfg: T5Config) -> dict[tuple, tuple[str, bool]]:
    """{our nnx path: (HF T5EncoderModel state-dict key, transpose?)}."""
    out: dict[tuple, tuple[str, bool]] = {("shared",): ("shared.weight", False)}
    for i in range(cfg.num_layers):
        p, hp = ("block", i), f"encoder.block.{i}.layer"
        for n in ("q", "k", "v", "o"):
            out[p + ("attn", n, "weight")] = (f"{hp}.0.SelfAttention.{n}.weight", True)
        if i == 0:
            out[p + ("attn", "relative_attention_bias")] = (
                f"{hp}.0.SelfAttention.relative_attention_bias.weight",
                False,
            )
        out[p + ("attn_norm", "weight")] = (f"{hp}.0.layer_norm.weight", False)
        for n in (("wi_0", "wi_1") if cfg.is_gated else ("wi",)) + ("wo",):
            out[p + ("ff", n, "weight")] = (f"{hp}.1.DenseReluDense.{n}.weight", True)
        out[p + ("ff_norm", "weight")] = (f"{hp}.1.layer_norm.weight", False)
    out[("final_layer_norm", "weight")] = ("encoder.final_layer_norm.weight", False)
    return out


def read_hf_config(folder: str) -> T5Config:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise MissingFile(f"{folder}: no config.json (expected a Hugging Face T5 folder)")
    with open(path) as f:
        d = json.load(f)
    try:
        return T5Config.from_hf(d)
    except KeyError as e:
        raise UnknownKey(f"{path}: {e.args[0]}") from None


def _logical_names(var) -> tuple:
    """The logical axis names a parameter was created with (`nnx.with_partitioning`)."""
    md = var.get_metadata()
    for k in ("out_sharding", "sharding_names", "sharding"):  # flax 0.12 / older spellings
        if md.get(k) is not None:
            return tuple(md[k])
    return (None,) * len(var.shape)


def load_t5_encoder(
    folder: str,
    dtype=jnp.float32,
    *,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> T5EncoderModel:
    """Load the encoder of a local Hugging Face T5 folder (`T5EncoderModel` or
    `T5ForConditionalGeneration`: config.json + model.safetensors or a sharded index).

    `dtype` is the compute dtype; parameters are cast to `param_dtype` (float32 default). With
    `mesh` and `rules` (a logical-axis rules table), each tensor is placed on its `NamedSharding`
    as it is read, so the host holds one tensor at a time beyond the memory map.
    Raises naming the missing file, missing key or mismatched shape.
    """
    if (mesh is None) != (rules is None):
        raise ValueError("load_t5_encoder: give both mesh and rules to shard, or neither")
    cfg = read_hf_config(folder)
    sd = open_state_dict(folder)  # model.safetensors, its sharded index, or pytorch_model.bin
    abstract = nnx.eval_shape(lambda: T5EncoderModel(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
    keymap = hf_key_map(cfg)
    unknown = [p for p, _ in nnx.to_flat_state(nnx.state(abstract)) if p not in keymap]
    if unknown:  # a bug in hf_key_map, not in the checkpoint
        raise AssertionError(f"no HF key for parameters {unknown}")

    def key(path: tuple) -> str:
        k = keymap[path][0]
        if k == "shared.weight" and k not in sd:
            return "encoder.embed_tokens.weight"  # untied copies / encoder-only exports
        return k

    def place(path, var, arr):
        spec = constraints.logical_to_spec(_logical_names(var), rules)
        return jax.device_put(arr, jax.sharding.NamedSharding(mesh, spec))

    model, _ = fill_module(
        abstract, sd, source=folder, key=key, dtype=param_dtype,
        file_shape=lambda p, shape: shape[::-1] if keymap[p][1] else shape,
        to_model=lambda p, a: a.T if keymap[p][1] else a,
        unexpected="ignore",  # a T5ForConditionalGeneration file also holds the decoder
        place=place if mesh is not None else None,
        # A progress bar for real checkpoints (T5-XXL: 219 tensors, ~19 GB in float32), not tiny ones.
        progress=f"loading T5 from {folder}",
    )
    return model


# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------
class ByteTokenizer:
    """ByT5-style byte tokenizer (no vocabulary file): id = utf-8 byte + 3, pad 0, EOS 1.

    `__call__(texts) -> (input_ids [B, L] int32, attention_mask [B, L] int32)`, truncated to
    L − 1 bytes then EOS, padded to `model_max_length` — the same convention as the HF call
    (`padding="max_length", truncation=True, add_special_tokens=True`).
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, model_max_length: int):
        if model_max_length < 1:
            raise ValueError(f"model_max_length must be >= 1, got {model_max_length}")
        self.model_max_length = model_max_length

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        L = self.model_max_length
        ids = np.full((len(texts), L), PAD_ID, np.int32)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"caption {i} is {type(t).__name__}, expected str")
            b = np.frombuffer(t.encode("utf-8"), np.uint8)[: L - 1].astype(np.int32) + BYTE_OFFSET
            ids[i, : len(b)] = b
            ids[i, len(b)] = EOS_ID
        return ids, (ids != PAD_ID).astype(np.int32)


class HFTokenizer:
    """A `transformers` T5 tokenizer called as Open-Sora's T5Embedder does."""

    def __init__(self, folder_or_tokenizer, model_max_length: int):
        if isinstance(folder_or_tokenizer, str):
            folder = folder_or_tokenizer
            if not any(os.path.exists(os.path.join(folder, f)) for f in ("spiece.model", "tokenizer.json")):
                raise FileNotFoundError(f"{folder}: no spiece.model or tokenizer.json for the T5 tokenizer")
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        else:
            self.tokenizer = folder_or_tokenizer
        self.model_max_length = model_max_length

    def __call__(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        out = self.tokenizer(
            list(texts),
            max_length=self.model_max_length,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            add_special_tokens=True,
            return_tensors="np",
        )
        return out["input_ids"].astype(np.int32), out["attention_mask"].astype(np.int32)


# --------------------------------------------------------------------------------------------
# host-side wrapper
# --------------------------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TextEncoder:
    """Tokenizer + frozen T5 encoder, jitted. `encode(texts)` → `(y [B, 1, L, D] float32 numpy,
    mask [B, L] int32 numpy)`, L = `model_max_length`, D = `caption_channels` (= d_model).

    The batch is padded up to a power of two (≤ log₂ compiles per length). Hidden states at
    padded token positions are whatever the encoder gives there (as in the reference); STDiT3
    only uses tokens where mask = 1.

    Host-side and single-process: the result is gathered to this host as numpy. Under
    multi-host training, call the model inside the jitted step or read a precomputed cache
    (`jaxsora.data.cache`).
    """

    def __init__(self, model: T5EncoderModel, tokenizer, config: dict | None = None):
        self.graphdef, self.state = nnx.split(model)
        self.tokenizer = tokenizer
        self.model_max_length = int(tokenizer.model_max_length)
        self.caption_channels = int(model.config.d_model)
        self.config = dict(config or {})
        graphdef = self.graphdef

        @functools.partial(jax.jit, compiler_options=compile_options.of_default_backend())
        def forward(state, ids, mask):
            return nnx.merge(graphdef, state)(ids, mask).astype(jnp.float32)

        self._forward = forward

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return self.tokenizer(list(texts))

    def encode_tokens(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """ids, mask: [B, L] → hidden states [B, L, D] float32 numpy."""
        b = ids.shape[0]
        pb = _next_pow2(b)
        if pb != b:
            ids = np.concatenate([ids, np.zeros((pb - b, ids.shape[1]), ids.dtype)])
            mask = np.concatenate([mask, np.ones((pb - b, mask.shape[1]), mask.dtype)])
        return np.asarray(self._forward(self.state, jnp.asarray(ids), jnp.asarray(mask)))[:b]

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, str):
            raise TypeError("encode expects a list of captions, got a single str")
        if len(texts) == 0:
            L, D = self.model_max_length, self.caption_channels
            return np.zeros((0, 1, L, D), np.float32), np.zeros((0, L), np.int32)
        ids, mask = self.tokenize(texts)
        return self.encode_tokens(ids, mask)[:, None], mask.astype(np.int32)


def tiny_t5_config(d_model=32, num_layers=2, num_heads=2, d_ff=64, d_kv=None, vocab_size=BYTE_VOCAB_SIZE) -> T5Config:
    return T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv or max(1, d_model // num_heads),
        d_ff=d_ff,
        num_layers=num_layers,
        num_heads=num_heads,
    )


def build_text_encoder(cfg: Mapping[str, Any], *, mesh: jax.sharding.Mesh | None = None, rules=None) -> TextEncoder:
    """From a config dict (or ConfigDict):

    * `{"kind": "t5", "path": folder, "model_max_length": 300, "dtype": "bfloat16",
      "tokenizer": folder (optional, default path), "param_dtype": "float32"}` — a HF T5 folder;
    * `{"kind": "tiny", "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64,
      "model_max_length": 32, "seed": 0, "dtype": "float32"}` — random weights, byte tokenizer,
      no files (demo/tests).

    With `mesh` and `rules` (logical-axis rules, as for STDiT3) a "t5" encoder's parameters are
    sharded over the mesh as they load (T5-XXL beside STDiT3-XL/2).
    """
    cfg = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    kind = cfg.get("kind")
    if kind == "t5":
        if not cfg.get("path"):
            raise ValueError("text encoder kind 't5' needs 'path' (a Hugging Face T5 folder)")
        cfg.setdefault("model_max_length", OPENSORA_MODEL_MAX_LENGTH)
        cfg.setdefault("dtype", "bfloat16")  # Open-Sora 1.2 runs T5 in bf16
        model = load_t5_encoder(
            cfg["path"],
            jnp.dtype(cfg["dtype"]),
            param_dtype=jnp.dtype(cfg.get("param_dtype", "float32")),
            mesh=mesh,
            rules=rules,
        )
        tok_path = cfg.get("tokenizer") or cfg["path"]
        tokenizer = (
            ByteTokenizer(cfg["model_max_length"])
            if tok_path == "byte"
            else HFTokenizer(tok_path, cfg["model_max_length"])
        )
        return TextEncoder(model, tokenizer, cfg)
    if kind == "tiny":
        known = {
            "kind",
            "d_model",
            "num_layers",
            "num_heads",
            "d_ff",
            "d_kv",
            "model_max_length",
            "seed",
            "dtype",
        }
        extra = set(cfg) - known
        if extra:
            raise ValueError(f"unknown keys for a tiny text encoder: {sorted(extra)}")
        cfg = {**TINY_DEFAULTS, **cfg}
        tcfg = tiny_t5_config(cfg["d_model"], cfg["num_layers"], cfg["num_heads"], cfg["d_ff"], cfg.get("d_kv"))
        model = T5EncoderModel(tcfg, rngs=nnx.Rngs(int(cfg["seed"])), dtype=jnp.dtype(cfg["dtype"]))
        return TextEncoder(model, ByteTokenizer(cfg["model_max_length"]), cfg)
    raise ValueError(f"text encoder 'kind' must be 't5' or 'tiny', got {kind!r}")
