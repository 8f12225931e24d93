"""Attention at STDiT3's odd sequence lengths.

jax's cuDNN attention cannot be differentiated at odd lengths, and STDiT3's are odd at every stage
resolution (240p: 405 spatial tokens, 51 frames: 15 latent frames, text buckets); `even_padded`
runs it on sequences padded to even lengths. On CPU its padding is checked around the XLA core
(the same function, so it must give the same numbers); on a GPU, cuDNN itself against XLA.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.diffusion import rflow
from jaxsora.models import layers as L
from jaxsora.models.presets import get_model_config
from tests.conftest import FIXTURES, rel_err

on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention runs on a GPU only")

# (query length, key length, key lengths per sample or None)
CASES = [(9, 9, None), (15, 8, None), (6, 7, [7, 3]), (9, 7, [0, 5]), (8, 8, [8, 2])]


def _qkv(nq, nk, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, nq, 2, 8))
    k, v = (rng.standard_normal((2, nk, 2, 8)) for _ in range(2))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


def _loss(fn, w):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)


@pytest.mark.parametrize("nq,nk,lengths", CASES)
def test_even_padded_is_attention_over_the_original_sequences(nq, nk, lengths):
    seen = []

    def core(q, k, v, kv_lengths):  # the XLA path, recording the lengths it is given
        seen.append((q.shape[1], k.shape[1]))
        return L.attention(q, k, v, impl=None, kv_lengths=kv_lengths)

    q, k, v = _qkv(nq, nk)
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    padded = lambda q, k, v: L.even_padded(core, q, k, v, lens)  # noqa: E731
    plain = lambda q, k, v: L.attention(q, k, v, impl=None, kv_lengths=lens)  # noqa: E731
    out = padded(q, k, v)
    assert out.shape == q.shape
    assert all(a % 2 == 0 and b % 2 == 0 for a, b in seen), seen
    assert rel_err(out, plain(q, k, v)) <= 1e-6
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    g_pad = jax.grad(_loss(padded, w), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(_loss(plain, w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_pad, g_ref):
        assert rel_err(a, b) <= 1e-6


def _autodiff_attention(q, k, v, kv_lengths):
    """softmax(q·kᵀ/√Dh)·v differentiated by autodiff's own rules: the reference for the XLA core's
    written-out backward (its row sums taken as dO·O)."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if kv_lengths is not None:
        valid = jnp.arange(k.shape[1])[None, :] < kv_lengths[:, None]
        logits = jnp.where(valid[:, None, None, :], logits, L.MASKED_LOGIT)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    if kv_lengths is not None:  # a sample without a valid key attends to nothing
        out = jnp.where((kv_lengths > 0)[:, None, None, None], out, 0)
    return out


@pytest.mark.parametrize("nq,nk,lengths", CASES)
def test_xla_attention_gradients_equal_autodiff(nq, nk, lengths):
    q, k, v = _qkv(nq, nk, seed=7 * nq + nk)
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
    ours = lambda q, k, v: L.attention(q, k, v, impl=None, kv_lengths=lens)  # noqa: E731
    assert rel_err(ours(q, k, v), _autodiff_attention(q, k, v, lens)) <= 1e-6
    g = jax.jit(jax.grad(_loss(ours, w), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(_loss(lambda q, k, v: _autodiff_attention(q, k, v, lens), w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) <= 1e-5
    if lengths is not None:  # keys past a sample's length get exactly zero gradient
        for i, n in enumerate(lengths):
            assert not np.any(np.asarray(g[1])[i, n:]) and not np.any(np.asarray(g[2])[i, n:])


@on_gpu
@pytest.mark.parametrize("nq,nk,lengths", CASES)
def test_cudnn_attention_and_its_gradients_at_odd_lengths(nq, nk, lengths):
    q, k, v = _qkv(nq, nk, jnp.bfloat16, seed=nq * 31 + nk)
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    cudnn = lambda q, k, v: L.attention(q, k, v, impl="cudnn", kv_lengths=lens)  # noqa: E731
    # the reference: the XLA path in float32 on the same (bf16-rounded) inputs
    xla32 = lambda q, k, v: L.attention(*(a.astype(jnp.float32) for a in (q, k, v)), impl=None,  # noqa: E731
                                        kv_lengths=lens)
    assert rel_err(jax.jit(cudnn)(q, k, v).astype(jnp.float32), xla32(q, k, v)) <= 1e-2
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    g = jax.jit(jax.grad(_loss(cudnn, w), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(_loss(xla32, w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        assert rel_err(a.astype(jnp.float32), b) <= 2e-2


@on_gpu
def test_bf16_stdit3_trains_with_cudnn_at_odd_lengths():
    """The tiny STDiT3 in bf16 with attention "auto" (cuDNN on a GPU): 3 latent frames, 3×3 spatial
    tokens and a 7-token caption, all odd — its loss and gradients against the XLA path's."""
    G = np.load(FIXTURES / "rflow_golden.npz")
    sd = read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors"))
    x0, noise = (G[k][:, :, :3, :6, :6] for k in ("loss_x0", "loss_noise"))
    cond = dict(y=G["loss_y"][:, :, :7], mask=G["loss_mask"][:, :7], fps=G["loss_fps"], height=G["loss_h"],
                width=G["loss_w"])

    def loss_and_grads(impl):
        model = from_torch_state_dict(sd, get_model_config("tiny", compute_dtype="bfloat16", attention_impl=impl))
        fn = lambda m: rflow.training_loss_explicit(m, x0, cond, noise, G["loss_t"]).mean()  # noqa: E731
        loss, grads = nnx.jit(nnx.value_and_grad(fn))(model)
        return float(loss), jax.tree.leaves(nnx.to_pure_dict(grads))

    assert L.resolve_attention_impl("auto", jnp.bfloat16, 16) == "cudnn"
    loss, grads = loss_and_grads("auto")
    loss_ref, grads_ref = loss_and_grads("xla")
    assert np.isfinite(loss) and abs(loss - loss_ref) <= 1e-2 * abs(loss_ref)
    assert rel_err(np.concatenate([np.ravel(g) for g in grads]),
                   np.concatenate([np.ravel(g) for g in grads_ref])) <= 5e-2


@pytest.mark.parametrize("layer,n,lengths", [("spatial", 9, None), ("spatial", 9, 7), ("temporal", 5, None),
                                             ("cross", 9, [7, 0]), ("cross", 8, [5, 3])])
def test_cudnn_layers_pad_an_odd_sequence_at_their_input(monkeypatch, layer, n, lengths):
    """With cuDNN, an odd sequence gets its even-length token at the layer's input (`cudnn_token_pad`): the
    attention is handed even queries and pads none itself. cuDNN's place is taken here by the XLA core, which
    records the lengths it is given; the layer's output and gradients must be those of the XLA layer."""
    seen = []

    def cudnn_stand_in(q, k, v, scale, kv_lengths):
        seen.append(q.shape[1])
        return L.even_padded(lambda *a: L.attention(*a[:3], impl=None, kv_lengths=a[3]), q, k, v, kv_lengths)

    monkeypatch.setattr(L, "_cudnn_attention", cudnn_stand_in)
    rngs = nnx.Rngs(0)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, n, 16)), jnp.float32)
    if layer == "cross":
        module = L.MultiHeadCrossAttention(16, 2, rngs=rngs, dtype=jnp.float32, attn_impl="cudnn")
        y = jnp.asarray(rng.standard_normal((2, 7, 16)), jnp.float32)
        args = (y, jnp.asarray(lengths, jnp.int32))
    else:
        module = L.Attention(16, 2, qk_norm=True, use_rope=layer == "temporal", rngs=rngs, dtype=jnp.float32,
                             attn_impl="cudnn")
        args = (lengths,)
    graphdef, params = nnx.split(module)
    w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def loss(params, x, impl):
        m = nnx.merge(graphdef, params)
        m.attn_impl = impl
        out = m(x, *args)
        assert out.shape == x.shape
        return jnp.sum(out * w)

    (v_cudnn, g_cudnn), (v_xla, g_xla) = (jax.value_and_grad(loss, argnums=(0, 1))(params, x, impl)
                                          for impl in ("cudnn", None))
    assert seen and all(nq == n + n % 2 for nq in seen), seen
    assert abs(float(v_cudnn) - float(v_xla)) <= 1e-5 * abs(float(v_xla))
    for a, b in zip(jax.tree.leaves(g_cudnn), jax.tree.leaves(g_xla)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("layer", ["self", "cross"])
def test_fused_projection_gradient_is_one_concatenate(layer):
    """q | k | v come out of one fused projection by one split (`split_heads`), so their gradients meet in one
    concatenate — indexing the parts out would give each a zero-padded copy of the fused activation, summed
    (a structural check: the numbers are the same either way)."""
    rngs = nnx.Rngs(0)
    x = jnp.ones((2, 6, 16), jnp.float32)
    if layer == "cross":  # k | v: the text's projection, differentiated by the text
        module = L.MultiHeadCrossAttention(16, 2, rngs=rngs, dtype=jnp.float32, attn_impl=None)
        queries, x = x, jnp.ones((2, 4, 16), jnp.float32)
        call = lambda m, y: m(queries, y, jnp.asarray([4, 2], jnp.int32))  # noqa: E731
    else:
        module = L.Attention(16, 2, qk_norm=True, use_rope=False, rngs=rngs, dtype=jnp.float32, attn_impl=None)
        call = lambda m, x: m(x)  # noqa: E731
    graphdef, params = nnx.split(module)
    grad = jax.grad(lambda x: jnp.sum(call(nnx.merge(graphdef, params), x)))
    text = str(jax.make_jaxpr(grad)(x))
    assert "concatenate[" in text
    assert " pad[" not in text, "a part of the fused projection was indexed out: its gradient is a pad"


@pytest.mark.parametrize("din,dout", [(6, 6), (6, 10), (10, 6)])
def test_dense_matmul_gradients_are_autodiffs(din, dout):
    """`dense_matmul` writes its backward out (dW from the narrower operand transposed, for XLA:CPU): both of its
    forms give autodiff's dx and dW, over 3-D inputs as the blocks call it."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, din)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((din, dout)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 3, 5, dout)), jnp.float32)
    ours = jax.grad(lambda x, w: jnp.sum(jnp.tanh(L.dense_matmul(x, w)) * g), argnums=(0, 1))(x, w)
    auto = jax.grad(lambda x, w: jnp.sum(jnp.tanh(jnp.einsum("btsk,kn->btsn", x, w)) * g), argnums=(0, 1))(x, w)
    for a, b in zip(ours, auto):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-6


def test_every_linear_layer_runs_dense_matmul():
    """A structural check (the numbers are autodiff's either way): the blocks' Linear layers, plain and LoRA-
    adapted, reach `dense_matmul` — the backward XLA:CPU runs without transposing a residual stream's gradient."""
    from jaxsora.models import lora
    from jaxsora.models.stdit3 import STDiT3

    cfg = get_model_config("tiny")
    model = STDiT3(cfg, rngs=nnx.Rngs(0))
    x = jnp.zeros((1, cfg.in_channels, 2, 8, 8))
    y = jnp.zeros((1, 1, 4, cfg.caption_channels))

    def n_dense(model):
        graphdef, params = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(x, jnp.ones((1,)), y))(params)
        return str(jaxpr).count("dense_matmul")

    n_linear = sum(1 for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear))
    assert n_dense(model) >= n_linear > 0
    lora.apply_lora(model, lora.LoRASpec(rank=2, alpha=2.0, targets=("attention",)))  # in place
    n_adapted = sum(1 for _, m in nnx.iter_modules(model) if isinstance(m, lora.LoRALinear))
    assert n_adapted > 0 and n_dense(model) >= n_linear + 2 * n_adapted  # each adapted layer: base, A and B


def test_temporal_rotation_tables_are_constants():
    """RoPE's cos/sin tables come from `rope_frequencies` in numpy — constants of the program; from a traced
    array XLA:CPU computed a cos and a sin per rotated element. The layer computes no sin or cos, and its tables
    equal those computed from the `rope.freqs` buffer."""
    module = L.Attention(16, 2, qk_norm=True, use_rope=True, rngs=nnx.Rngs(0), dtype=jnp.float32, attn_impl=None)
    x = jnp.ones((3, 5, 16), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda x: module(x))(x))
    assert " sin " not in jaxpr and " cos " not in jaxpr
    static = L.rope_tables(L.rope_frequencies(8), 5)
    traced = jax.jit(lambda f: L.rope_tables(f, 5))(L.RotaryEmbedding(8).freqs[...])
    assert all(isinstance(t, np.ndarray) for t in static)
    for a, b in zip(static, traced):
        np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=1e-6)
