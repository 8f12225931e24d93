"""Layers of STDiT3 (Open-Sora 1.2), in Flax NNX.

Every module here mirrors a module of `opensora/models/layers/blocks.py` at the reference tag
(v1.2.0), and its attribute names mirror the PyTorch attribute names, so that a parameter's NNX
path joined with "." is its PyTorch state-dict key (`kernel` ↔ `weight`, see `jaxsora.convert`).

Numerics follow the reference: LayerNorm and RMSNorm statistics in float32, attention softmax in
float32, sinusoidal embeddings computed in float32 and then cast to the compute dtype. Parameters
are float32; `dtype` is the compute dtype (bfloat16 on GPU).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.parallel import constraints

# Open-Sora 1.2: LayerNorm / LlamaRMSNorm eps in STDiT3 blocks, final layer and q/k norm.
NORM_EPS = 1e-6
# Open-Sora 1.2: sinusoid size of TimestepEmbedder / SizeEmbedder ("frequency_embedding_size").
FREQ_EMBED_DIM = 256
# Open-Sora 1.2: max_period of the timestep sinusoid, RoPE theta and the 2D pos-emb base.
SINUSOID_BASE = 10000.0
# The logit bias of padding keys: float32's lowest, so exp() of it is exactly 0 (logits are f32).
MASKED_LOGIT = float(np.finfo(np.float32).min)


class Buffer(nnx.Variable):
    """A non-trainable array that belongs in the state dict (PyTorch buffers and frozen params:
    `rope.freqs`, `y_embedder.y_embedding`). The optimizer only sees `nnx.Param`s."""


# --------------------------------------------------------------------------------------------
# initializers (STDiT3.initialize_weights)
# --------------------------------------------------------------------------------------------
xavier_uniform = jax.nn.initializers.xavier_uniform()
zeros = jax.nn.initializers.zeros


def torch_default_uniform(fan_in: int):
    """PyTorch's default Conv/Linear init: U(−1/√fan_in, 1/√fan_in) (kaiming_uniform, a=√5)."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def scaled_normal(std: float):
    def init(key, shape, dtype=jnp.float32):
        return std * jax.random.normal(key, shape, dtype)

    return init


def _contract_last(x: jax.Array, w: jax.Array, precision) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_matmul(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
    """x: [..., K] · w: [K, N] → [..., N], the matmul of every Linear layer (`dense`, LoRA's base and adapters).

    The backward is autodiff's, written out for the weight gradient dW = Σ_tokens xᵀ·dy: XLA:CPU runs that
    contraction (over the token axes of both operands) with one operand transposed to [features, tokens], and
    autodiff's form (dot(dy, x) then a transpose) had it transpose dy — the gradient of a residual stream, so the
    transpose fused into the LayerNorm/modulation backward that makes dy and that whole computation was redone
    column by column (~10 strided inputs; 4–13 ms each at bench/step.py's `realistic` shape, where the plain
    transpose costs 0.35 ms). Here the narrower of the two is the operand transposed — at equal widths x,
    the layer's input (the attention output, or the modulated LayerNorm) — and the same sums come out."""
    return _contract_last(x, w, precision)


def _dense_matmul_fwd(x, w, precision):
    return _contract_last(x, w, precision), (x, w)


def _dense_matmul_bwd(precision, res, dy):
    x, w = res
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)  # dy·wᵀ
    tokens = tuple(range(x.ndim - 1))
    if x.shape[-1] <= dy.shape[-1]:
        dw = jax.lax.dot_general(x, dy, ((tokens, tokens), ((), ())), precision=precision)  # [K, N]
    else:
        dw = jax.lax.dot_general(dy, x, ((tokens, tokens), ((), ())), precision=precision).T  # [N, K]ᵀ
    return dx, dw


dense_matmul.defvjp(_dense_matmul_fwd, _dense_matmul_bwd)


def linear_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """`nnx.Linear`'s `dot_general`: its contraction (the input's last axis with the kernel's first) through
    `dense_matmul`; anything else as `jax.lax.dot_general` computes it."""
    if dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and preferred_element_type is None \
            and out_sharding is None:
        return dense_matmul(lhs, rhs, precision)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)


def dense(
    din: int,
    dout: int,
    names: tuple,
    *,
    rngs: nnx.Rngs,
    dtype,
    kernel_init=xavier_uniform,
    bias_init=zeros,
) -> nnx.Linear:
    """A Linear with the reference's default STDiT3 init (xavier weights, zero bias) and logical
    sharding names `names = (in_axis, out_axis)` on its kernel."""
    return nnx.Linear(
        din,
        dout,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.with_partitioning(kernel_init, names),
        bias_init=nnx.with_partitioning(bias_init, (names[1],)),
        precision=None,
        dot_general=linear_dot_general,
        rngs=rngs,
    )


# --------------------------------------------------------------------------------------------
# functional pieces
# --------------------------------------------------------------------------------------------
class SiLU(nnx.Module):
    """Parameterless, kept as a module so `nnx.List` indices match PyTorch's `nn.Sequential`."""

    def __call__(self, x):
        return jax.nn.silu(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def layer_norm(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """LayerNorm without affine parameters over the last axis; statistics in float32. x: [..., C].

    The backward is autodiff's formula written out, dx = rstd·(dy − mean(dy) − x̂·mean(dy·x̂)), with
    its two per-token sums over C taken as products (einsum over C) rather than reductions:
    XLA:CPU ran autodiff's sums of products as YNNPACK reductions at 9–11 ms each at bench/step.py's
    `240p` ([1, 5, 405, 768]), where the products take under 1 — a LayerNorm and modulation backward
    4 ms instead of 14. The saved residuals are x and the [..., 1] statistics (x̂ is recomputed)."""
    return _layer_norm_fwd(x, eps)[0]


def _layer_norm_fwd(x, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    return ((xf - mean) * rstd).astype(x.dtype), (x, mean, rstd)


def _layer_norm_bwd(eps, res, dy):
    x, mean, rstd = res
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    dyf = dy.astype(jnp.float32)
    c = dy.shape[-1]
    mean_dy = jnp.einsum("...c,c->...", dyf, jnp.full((c,), 1.0 / c, jnp.float32))[..., None]
    mean_dy_x_hat = jnp.einsum("...c,...c->...", dyf, x_hat)[..., None] / c
    return ((rstd * (dyf - mean_dy - x_hat * mean_dy_x_hat)).astype(x.dtype),)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """adaLN-single modulation `x·(1+scale)+shift` (reference `t2i_modulate`)."""
    return x * (1 + scale) + shift


def sinusoid(t: jax.Array, dim: int = FREQ_EMBED_DIM, max_period: float = SINUSOID_BASE):
    """Timestep/size sinusoid `[cos(t·f), sin(t·f)]` (cos first), f_k = max_period^(−k/half).

    t: [N] float → [N, dim] float32.
    """
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    if dim % 2:
        emb = jnp.concatenate([emb, jnp.zeros_like(emb[:, :1])], axis=-1)
    return emb


def pos_embed_2d(dim: int, h: int, w: int, scale: jax.Array, base_size: int) -> jax.Array:
    """Open-Sora `PositionEmbedding2D`: [1, h·w, dim] float32, tokens row-major over (h, w).

    Coordinates: row r → r/scale·base_size/h, column c → c/scale·base_size/w. The embedding is
    [sin(w·f), cos(w·f)] of the *width* coordinate, then the same of the height coordinate,
    f_j = 1/10000^(2j/(dim/2)). `scale` may be traced (it comes from the batch's pixel size).
    """
    half = dim // 2
    inv_freq = 1.0 / (SINUSOID_BASE ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    grid_h = jnp.arange(h, dtype=jnp.float32) / scale * (base_size / h)
    grid_w = jnp.arange(w, dtype=jnp.float32) / scale * (base_size / w)
    coord_w = jnp.broadcast_to(grid_w[None, :], (h, w)).reshape(-1)
    coord_h = jnp.broadcast_to(grid_h[:, None], (h, w)).reshape(-1)

    def sincos(c):
        out = c[:, None] * inv_freq[None]
        return jnp.concatenate([jnp.sin(out), jnp.cos(out)], axis=-1)

    return jnp.concatenate([sincos(coord_w), sincos(coord_h)], axis=-1)[None]


def rope_frequencies(head_dim: int) -> np.ndarray:
    """The RoPE frequencies [Dh/2] = 1/10000^(2j/Dh), float32 (rotary-embedding-torch, freqs_for='lang'):
    what the reference's `rope.freqs` holds — fixed by the architecture, never trained."""
    return (1.0 / (SINUSOID_BASE ** (np.arange(0, head_dim, 2)[: head_dim // 2].astype(np.float32) / head_dim))
            ).astype(np.float32)


def rope_tables(freqs, n: int):
    """cos and signed-sin tables [N, Dh] float32 of `rope_interleaved` for positions 0..N−1.

    Angle(pos, j) = pos·freqs_j, repeated as (j0, j0, j1, j1, ...). The sin table carries the sign of each pair's
    first element, so that rotate_half(x)·sin = swap(x)·sin_signed. With numpy `freqs` (`rope_frequencies`,
    as `Attention` passes them) the tables are numpy too: constants of the program. From a traced array, XLA:CPU
    computes them inside every fusion that rotates q or k, a cos and a sin for each of the [R, H, N, Dh] elements
    (2.5 ms instead of 0.2 for one temporal q at bench/step.py's `realistic` shape)."""
    xp = np if isinstance(freqs, np.ndarray) else jnp
    ang = xp.arange(n, dtype=np.float32)[:, None] * xp.asarray(freqs, np.float32)[None, :]  # [N, Dh/2]
    ang = xp.repeat(ang, 2, axis=-1)  # [N, Dh] interleaved
    sign = xp.tile(xp.asarray([-1.0, 1.0], np.float32), ang.shape[-1] // 2)
    return xp.cos(ang).astype(np.float32), (xp.sin(ang) * sign).astype(np.float32)


def rope_interleaved(x: jax.Array, freqs) -> jax.Array:
    """rotary-embedding-torch 0.5.3 `rotate_queries_or_keys` (GPT-J style, interleaved pairs).

    x: [..., N, Dh] with the sequence on axis −2, positions 0..N−1; freqs: [Dh/2] (numpy: see `rope_tables`).
    rotate_half maps each adjacent pair (a, b) → (−b, a): here a reversed view of each pair times the signed
    sin table, so everything fuses into one elementwise op. Computed in float32, returned in x.dtype.
    """
    cos, sin_signed = rope_tables(freqs, x.shape[-2])
    xf = x.astype(jnp.float32)
    swapped = xf.reshape(*xf.shape[:-1], -1, 2)[..., ::-1].reshape(xf.shape)  # (a, b) → (b, a)
    return (xf * cos + swapped * sin_signed).astype(x.dtype)


def resolve_attention_impl(impl: str, dtype, head_dim: int, platform: str | None = None) -> str | None:
    """Pick `jax.nn.dot_product_attention`'s implementation explicitly.

    "auto": cuDNN on GPU where it applies (bf16/fp16, head_dim a multiple of 8 and ≤ 128 —
    STDiT3-XL/2's 72 qualifies), XLA otherwise. "cudnn" raises where cuDNN cannot run.
    platform: "cpu", "gpu" or "tpu", the platform the model is compiled for (None: `jax.default_backend()`).
    Returns None for XLA (jax's spelling).
    """
    if impl == "xla":
        return None
    if impl == "cudnn":
        return "cudnn"
    if impl != "auto":
        raise ValueError(f"attention_impl must be 'auto', 'xla' or 'cudnn', got {impl!r}")
    on_gpu = (platform or jax.default_backend()) == "gpu"
    ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if (on_gpu and ok) else None


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    impl: str | None,
    kv_lengths: jax.Array | None = None,
) -> jax.Array:
    """softmax(q·kᵀ/√Dh)·v with the softmax in float32.

    q: [B, Nq, H, Dh], k/v: [B, Nk, H, Dh]; kv_lengths: [B] int, keys ≥ length are padding (the
    valid keys form a prefix, as T5 attention masks do). A row with no valid key returns 0,
    as the reference's packed block-diagonal attention does.
    """
    scale = q.shape[-1] ** -0.5
    if impl == "cudnn":
        out = _cudnn_attention(q, k, v, scale, kv_lengths)
    else:
        bias = None
        if kv_lengths is not None:
            # An additive key bias: padding keys get exactly zero weight, the backward needs no
            # mask, and a row without any valid key stays finite (uniform; zeroed below).
            valid = jnp.arange(k.shape[1])[None, :] < kv_lengths[:, None]  # [B, Nk]
            bias = jnp.where(valid, 0.0, MASKED_LOGIT)[:, None, None, :]  # [B, 1, 1, Nk]
        heads_major = [rearrange(a, "b n h d -> b h n d") for a in (q, k, v)]
        out = rearrange(_softmax_attention(*heads_major, bias), "b h n d -> b n h d")
    if kv_lengths is not None:
        out = jnp.where((kv_lengths > 0)[:, None, None, None], out, 0)
    return out


def even_padded(attn, q, k, v, kv_lengths):
    """Run `attn(q, k, v, kv_lengths)` on sequences padded to even lengths, and cut its output back.

    jax's cuDNN attention refuses to differentiate odd sequence lengths (jax 0.10–0.11:
    `check_is_flash_attention` treats the placeholder it passes for "no bias" as a bias, and a
    bias needs even lengths in training) — and STDiT3's are odd at every stage resolution
    (240p: 15×27 = 405 spatial tokens; 51 frames: 15 latent frames; captions cut to 75 tokens). One zero
    query row is appended (its output is dropped) and one zero key (masked by the key lengths),
    so the result is attention over the original sequences.
    q: [B, Nq, H, Dh], k/v: [B, Nk, H, Dh]; kv_lengths: [B] or None → [B, Nq, H, Dh]."""
    nq, nk = q.shape[1], k.shape[1]
    if nq % 2 == 0 and nk % 2 == 0:
        return attn(q, k, v, kv_lengths)

    def pad(a):
        return jnp.pad(a, [(0, 0), (0, a.shape[1] % 2), (0, 0), (0, 0)])

    if nk % 2 and kv_lengths is None:
        kv_lengths = jnp.full((k.shape[0],), nk, jnp.int32)
    return attn(pad(q), pad(k), pad(v), kv_lengths)[:, :nq]


def cudnn_token_pad(impl: str | None, n: int) -> int:
    """Tokens (0 or 1) to append to an odd sequence of n tokens before its projections when the attention is
    cuDNN's, which trains only even lengths (`even_padded`). Padded at the layer's input, the zero token
    rides through the projections (the pad fuses into the input's producer, the cut into the output's
    consumer) instead of a pass of its own over q, k and v and another over the attention's output: on an
    H200, STDiT3-XL/2 at 240p × 51 spent 27 ms of a 746 ms step in those pads and slices. The padded query's
    output is cut off after the output projection; as a key it is masked by the key lengths."""
    return int(impl == "cudnn" and n % 2 == 1)


def _cudnn_attention(q, k, v, scale, kv_lengths):
    if kv_lengths is not None:
        # cuDNN's backward returns garbage for a row with no valid key (seen on an H200, jax 0.11.2); such rows
        # are zeroed after the call, so one key changes nothing but keeps their gradient zero.
        kv_lengths = jnp.maximum(kv_lengths, 1)

    def attn(q, k, v, kv_lengths):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=kv_lengths,
                                            implementation="cudnn")

    return even_padded(attn, q, k, v, kv_lengths)


@jax.custom_vjp
def _softmax_attention(q, k, v, bias):
    """The XLA attention core on heads-major operands: q [B, H, Nq, Dh], k/v [B, H, Nk, Dh],
    bias [B, 1, 1, Nk] float32 or None → [B, H, Nq, Dh]. Reference manual path: q scaled first,
    logits and softmax in float32, probabilities cast back to v's dtype.

    The backward is written out so that each of its four matmuls contracts the last axis of its
    left operand: dK and dV take the transposed probabilities, materialized once, instead of
    contracting over the query axis in place — the form XLA's CPU backend runs as a slow generic
    loop (dK/dV were 2/3 of the backward's time at the `realistic` bench shape) and GPU BLAS runs
    at the same speed either way. The softmax backward's row sums Σₖ p·dp are taken as dO·O
    (FlashAttention's identity: Σₖ pₖ·(dO·vₖ) = dO·Σₖ pₖvₖ), a product over the head dim, not a
    reduction over the [Nq, Nk] scores: XLA:CPU fused that reduction with the dp matmul into one
    YNNPACK graph that ran 3–5× the matmul's own time (cross-attention at bench/step.py's `240p`:
    the attention's backward and forward 38 ms instead of 50, spatial 99 instead of 113)."""
    return _softmax_attention_fwd(q, k, v, bias)[0]


def _softmax_attention_fwd(q, k, v, bias):
    qs = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    logits = jnp.einsum("bhqd,bhkd->bhqk", qs, k, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    probs = jax.nn.softmax(logits, axis=-1)  # float32
    out = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v)
    return out, (qs, k, v, bias, probs, out)


def _softmax_attention_bwd(res, d_out):
    qs, k, v, bias, probs, out = res
    probs_t = rearrange(probs.astype(v.dtype), "b h q k -> b h k q")
    dv = jnp.einsum("bhkq,bhqd->bhkd", probs_t, d_out)
    dp = jnp.einsum("bhqd,bhkd->bhqk", d_out, v, preferred_element_type=jnp.float32)
    # softmax backward: dlogits = p ⊙ (dp − Σₖ dp·p), the row sums as dO·O (see the docstring)
    row = jnp.einsum("bhqd,bhqd->bhq", d_out, out, preferred_element_type=jnp.float32)[..., None]
    d_logits = probs * (dp - row)
    d_qs = jnp.einsum("bhqk,bhkd->bhqd", d_logits.astype(qs.dtype), k)
    dk = jnp.einsum("bhkq,bhqd->bhkd", rearrange(d_logits, "b h q k -> b h k q").astype(qs.dtype), qs)
    dq = d_qs * jnp.asarray(qs.shape[-1] ** -0.5, qs.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None if bias is None else jnp.zeros_like(bias)


_softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    """LlamaRMSNorm over the last axis (q/k norm): statistics in float32, `weight·x̂` in x.dtype."""

    def __init__(self, dim: int, *, eps: float = NORM_EPS):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


class RotaryEmbedding(nnx.Module):
    """Holds `rope.freqs` [Dh/2] (`rope_frequencies`).

    A state-dict entry in the reference (a Parameter with requires_grad=False), so a Buffer here. Its values are
    the architecture's constants: the temporal attention rotates with `rope_frequencies(head_dim)` itself, so
    that the rotation tables are constants of the compiled program; a state dict whose `rope.freqs` differs is
    refused at load (`jaxsora.convert.torch.load_torch_state_dict`).
    """

    def __init__(self, dim: int):
        self.freqs = Buffer(jnp.asarray(rope_frequencies(dim)))



class Mlp(nnx.Module):
    """timm `Mlp`: fc1 → GELU(tanh) → fc2."""

    def __init__(self, din, dhidden, dout, names_in, names_out, *, rngs, dtype):
        self.fc1 = dense(din, dhidden, names_in, rngs=rngs, dtype=dtype)
        self.fc2 = dense(dhidden, dout, names_out, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        # named for the remat policies that keep matmul outputs (models/config.py REMAT_SAVED_NAMES)
        hidden = checkpoint_name(self.fc1(x), "mlp_hidden")
        return checkpoint_name(self.fc2(jax.nn.gelu(hidden, approximate=True)), "mlp_out")


class TimestepEmbedder(nnx.Module):
    """sinusoid(t) → Linear(256→C) → SiLU → Linear(C→C). Also the fps `SizeEmbedder` (same math)."""

    def __init__(self, hidden: int, *, rngs, dtype, init_first=xavier_uniform, init_last=xavier_uniform):
        self.mlp = nnx.List([
            dense(FREQ_EMBED_DIM, hidden, (None, "embed"), rngs=rngs, dtype=dtype, kernel_init=init_first),
            SiLU(),
            dense(hidden, hidden, ("embed", None), rngs=rngs, dtype=dtype, kernel_init=init_last),
        ])
        self.dtype = dtype

    def __call__(self, t: jax.Array) -> jax.Array:
        """t: [B] → [B, C]."""
        h = sinusoid(t).astype(self.dtype)
        for layer in self.mlp:
            h = layer(h)
        return h


class PatchEmbed3D(nnx.Module):
    """Conv3d with kernel = stride = patch over [B, C, T, H, W], zero-padded at the end of T/H/W."""

    def __init__(self, patch, cin, hidden, *, rngs, dtype):
        fan_in = cin * int(np.prod(patch))
        self.patch = tuple(patch)
        self.proj = nnx.Conv(
            cin,
            hidden,
            kernel_size=self.patch,
            strides=self.patch,
            padding="VALID",
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=nnx.with_partitioning(torch_default_uniform(fan_in), (None, None, None, None, "embed")),
            bias_init=nnx.with_partitioning(torch_default_uniform(fan_in), ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, C, T, H, W] → [B, T', H', W', hidden] (channels last)."""
        pads = [(0, 0), (0, 0)] + [(0, (-n) % p) for n, p in zip(x.shape[2:], self.patch)]
        x = jnp.pad(x, pads)
        return self.proj(jnp.transpose(x, (0, 2, 3, 4, 1)))


def split_heads(fused: jax.Array, n: int) -> list[jax.Array]:
    """[R, N, n, H, Dh] (a fused projection's output: q | k | v) → n arrays [R, N, H, Dh].

    One `lax.split`, whose gradient is one concatenate: indexing the n parts instead gives n slices, whose
    gradients are n zero-padded copies of the fused shape summed (on XLA:CPU, pads and adds of the whole
    qkv activation in every attention layer's backward)."""
    return [a[:, :, 0] for a in jax.lax.split(fused, (1,) * n, axis=2)]


class Attention(nnx.Module):
    """Self-attention: fused qkv (rows q | k | v, each head-major), q/k RMSNorm, optional RoPE."""

    def __init__(self, dim, num_heads, *, qk_norm, use_rope: bool, rngs, dtype, attn_impl,
                 sequence_axis: str | None = None):
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = dense(dim, 3 * dim, ("embed", "heads"), rngs=rngs, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.proj = dense(dim, dim, ("heads", "embed"), rngs=rngs, dtype=dtype)
        self.use_rope = use_rope
        self.attn_impl = attn_impl
        self.sequence_axis = sequence_axis

    def __call__(self, x: jax.Array, kv_len: int | None = None) -> jax.Array:
        """x: [R, N, C] (R independent rows, N the attended sequence) → [R, N, C]. A RoPE layer (temporal blocks)
        rotates q and k over N by `rope_frequencies(head_dim)`; kv_len: only the first kv_len keys are attended
        (the rest is sequence-parallel padding)."""
        r, n, c = x.shape
        # cuDNN: an odd sequence gets its even-length token here, not around the attention (cudnn_token_pad);
        # under sequence parallelism the attention pads the gathered sequence itself (even_padded)
        extra = cudnn_token_pad(self.attn_impl, n) if self.sequence_axis is None else 0
        if extra:
            x = jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
            kv_len = n if kv_len is None else kv_len  # the appended token is no key
        # the matmul outputs carry checkpoint names for the remat policies (models/config.py REMAT_SAVED_NAMES)
        qkv = checkpoint_name(self.qkv(x), "qkv").reshape(r, n + extra, 3, self.num_heads, self.head_dim)
        q, k, v = split_heads(qkv, 3)  # each [R, N, H, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:  # rotation over the sequence axis (−2 after the swap)
            freqs = rope_frequencies(self.head_dim)
            q = jnp.swapaxes(rope_interleaved(jnp.swapaxes(q, 1, 2), freqs), 1, 2)
            k = jnp.swapaxes(rope_interleaved(jnp.swapaxes(k, 1, 2), freqs), 1, 2)
        def attn_fn(q_, k_, v_):
            lens = None if kv_len is None else jnp.full((q_.shape[0],), kv_len, jnp.int32)
            return attention(q_, k_, v_, impl=self.attn_impl, kv_lengths=lens)

        if self.sequence_axis is not None:
            from jaxsora.parallel.sequence import ulysses_attention

            out = ulysses_attention(q, k, v, mesh=None, axis_name=self.sequence_axis, attn_fn=attn_fn)
        else:
            out = attn_fn(q, k, v)
        out = checkpoint_name(out.reshape(r, n + extra, c), "attn_out")
        out = checkpoint_name(self.proj(out), "proj")
        return out[:, :n] if extra else out


class MultiHeadCrossAttention(nnx.Module):
    """Cross-attention of image tokens over the sample's own valid text tokens (no norm, no RoPE).

    The reference packs all valid tokens into one sequence with a block-diagonal mask; attending
    over the padded [B, L] text with a key mask is the same computation.
    """

    def __init__(self, dim, num_heads, *, rngs, dtype, attn_impl, proj_init=xavier_uniform):
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_linear = dense(dim, dim, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.kv_linear = dense(dim, 2 * dim, ("embed", "heads"), rngs=rngs, dtype=dtype)
        self.proj = dense(dim, dim, ("heads", "embed"), rngs=rngs, dtype=dtype, kernel_init=proj_init)
        self.attn_impl = attn_impl

    def __call__(self, x: jax.Array, y: jax.Array, y_lens: jax.Array | None) -> jax.Array:
        """x: [B, N, C]; y: [B, L, C] projected text; y_lens: [B] valid-token counts or None."""
        b, n, c = x.shape
        extra = cudnn_token_pad(self.attn_impl, n)  # one query more for cuDNN at odd n, its output cut off below
        if extra:
            x = jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
        q = checkpoint_name(self.q_linear(x), "qkv").reshape(b, n + extra, self.num_heads, self.head_dim)
        kv = checkpoint_name(self.kv_linear(y), "qkv").reshape(b, y.shape[1], 2, self.num_heads, self.head_dim)
        k, v = split_heads(kv, 2)
        out = attention(q, k, v, impl=self.attn_impl, kv_lengths=y_lens)
        out = checkpoint_name(out.reshape(b, n + extra, c), "attn_out")
        out = checkpoint_name(self.proj(out), "proj")
        return out[:, :n] if extra else out


def text_lengths(mask: jax.Array | None) -> jax.Array | None:
    """[B, L] 0/1 text mask → [B] int32 valid-token counts (None stays None)."""
    if mask is None:
        return None
    return jnp.sum(mask.astype(jnp.int32), axis=-1)


__all__ = [
    "Buffer", "SiLU", "RMSNorm", "RotaryEmbedding", "Mlp", "TimestepEmbedder", "PatchEmbed3D",
    "Attention", "MultiHeadCrossAttention", "attention", "layer_norm", "modulate", "sinusoid",
    "pos_embed_2d", "rope_frequencies", "rope_tables", "rope_interleaved", "resolve_attention_impl", "text_lengths",
    "constraints",
]
