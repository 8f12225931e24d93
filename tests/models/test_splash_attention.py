"""Attention on TPU: the Pallas splash kernel (`model.attention_impl="splash"`, what "auto" picks for a TPU).

Its numbers are checked against our XLA attention in Pallas' interpret mode on the CPU (`layers.splash_interpret`):
outputs and gradients in float32 and bfloat16, odd lengths (padded to the kernel's 128-lane blocks), key padding
by lengths, a row without any valid key, one key block (the fused backward) and several; then a small STDiT3's
forward. Where libtpu is installed (`pip install '.[tpu]'`), the layers are also compiled for a TPU topology
without a TPU, and the compiled HLO must hold the kernel and no [N, N] score tensor (a kernel choice is invisible
in the numbers).
"""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.errors import ConfigError
from jaxsora.models import layers as L
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3
from tests.conftest import rel_err


def test_auto_picks_the_kernel_of_the_platform():
    bf16, f32, f16 = jnp.bfloat16, jnp.float32, jnp.float16
    assert L.resolve_attention_impl("auto", bf16, 72, platform="tpu") == "splash"
    assert L.resolve_attention_impl("auto", f32, 72, platform="tpu") == "splash"
    assert L.resolve_attention_impl("auto", f16, 72, platform="tpu") is None  # no float16 arithmetic on a TPU
    assert L.resolve_attention_impl("auto", bf16, 36, platform="tpu") is None  # not a multiple of 8
    assert L.resolve_attention_impl("auto", bf16, 72, platform="gpu") == "cudnn"
    assert L.resolve_attention_impl("auto", f32, 72, platform="gpu") is None
    assert L.resolve_attention_impl("auto", bf16, 72, platform="cpu") is None
    assert L.resolve_attention_impl("auto", bf16, 72) is None  # this machine: a CPU
    assert L.resolve_attention_impl("xla", bf16, 72, platform="tpu") is None
    with pytest.raises(ValueError, match="platform"):
        L.resolve_attention_impl("auto", bf16, 72, platform="metal")


def test_splash_where_it_cannot_run_is_one_config_error():
    for platform in (None, "cpu", "gpu"):
        with pytest.raises(ConfigError, match="runs on a TPU only") as e:
            L.resolve_attention_impl("splash", jnp.bfloat16, 72, platform=platform)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="head_dim"):
        L.resolve_attention_impl("splash", jnp.bfloat16, 36, platform="tpu")
    with pytest.raises(ConfigError, match="runs on a TPU only"):  # what a model built here meets
        STDiT3(get_model_config("tiny", attention_impl="splash"), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="attention_impl must be one of"):
        get_model_config("tiny", attention_impl="flash")
    with L.splash_interpret():
        assert L.resolve_attention_impl("splash", jnp.float32, 16) == "splash_interpret"


@pytest.mark.parametrize("n,expected", [(405, (512, 512)), (300, (384, 384)), (15, (128, 128)),
                                        (6075, (6144, 512)), (3600, (3712, 128)), (640, (640, 128))])
def test_splash_blocks_pad_to_lanes(n, expected):
    """240p's 405 spatial tokens, 300 caption tokens, 15 latent frames, 240p × 51's 6,075 cross-attention
    queries, 720p's 3,600 spatial tokens: padded to a multiple of 128, in the largest block up to 512."""
    assert L.splash_blocks(n) == expected


def _qkv(nq, nk, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, nq, 2, 8))
    k, v = (rng.standard_normal((2, nk, 2, 8)) for _ in range(2))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


# (dtype, query length, key length, key lengths per row or None): odd lengths padded by the kernel's own pad;
# key padding by lengths with a row of none (a cross-attention row without a caption); one key block (the fused
# backward) and five (640 keys: separate dq and dk/dv kernels); bf16 at lengths the kernel takes unpadded.
CASES = [(jnp.float32, 131, 131, None), (jnp.float32, 9, 640, [640, 0]), (jnp.bfloat16, 200, 150, [7, 150]),
         (jnp.bfloat16, 128, 128, None)]


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("dtype,nq,nk,lengths", CASES, ids=["f32-odd", "f32-empty-row-5-blocks",
                                                            "bf16-key-lengths", "bf16-unpadded"])
def test_splash_attention_equals_xla_attention(dtype, nq, nk, lengths):
    q, k, v = _qkv(nq, nk, dtype, seed=nq + nk)
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    with L.splash_interpret():
        impl = L.resolve_attention_impl("splash", dtype, q.shape[-1])

    def loss(impl, upcast):
        def f(q, k, v):
            if upcast:  # the reference: XLA's attention in float32 on the same (rounded) inputs
                q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
            out = L.attention(q, k, v, impl=impl, kv_lengths=lens).astype(jnp.float32)
            return jnp.sum(out * w), out
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    (_, out), grads = jax.jit(loss(impl, False))(q, k, v)
    (_, out_ref), grads_ref = jax.jit(loss(None, True))(q, k, v)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert out.shape == (2, nq, 2, 8) and rel_err(out, out_ref) <= tol
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == dtype and rel_err(g.astype(jnp.float32), g_ref) <= tol
    if lengths is not None:
        for i, n in enumerate(lengths):  # keys past a row's length: no gradient; a row without keys: output 0
            assert not np.any(np.asarray(grads[1][i, n:], np.float32))
            assert not np.any(np.asarray(grads[2][i, n:], np.float32))
            if n == 0:
                assert not np.any(np.asarray(out[i])) and not np.any(np.asarray(grads[0][i], np.float32))


def test_splash_gradients_under_remat_in_a_scan():
    """The blocks' remat (jax.checkpoint) and `scan_blocks` (lax.scan) trace the kernel inside transformations
    whose backward is traced later: the kernel's block tables must be constants then, not tracers of the
    forward's trace (they leaked as an UnexpectedTracerError)."""
    q, k, v = _qkv(131, 131, jnp.float32, seed=3)
    with L.splash_interpret():
        impl = L.resolve_attention_impl("splash", jnp.float32, 8)

    def loss(impl):
        one = jax.checkpoint(lambda q, k, v: jnp.sum(L.attention(q, k, v, impl=impl) ** 2))
        return lambda q, k, v: jax.lax.scan(lambda c, _: (c + one(q, k, v), None), 0.0, None, length=2)[0]

    grads = jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
    for g, g_ref in zip(grads, jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(g, g_ref) <= 1e-5


@pytest.mark.slow(seconds=20)
def test_stdit3_forward_with_splash_equals_xla():
    """A small STDiT3 (the tiny preset's widths, one block pair) at lengths the kernel takes: 13 × 13 = 169 spatial
    tokens and 131 caption tokens, both odd, one caption cut to 40 — spatial and cross-attention run the kernel,
    the temporal attention's 2 frames XLA's (`SPLASH_MIN_KEYS`)."""
    cfg = get_model_config("tiny", depth=1, model_max_length=131)
    with L.splash_interpret():
        model = STDiT3(cfg.replace(attention_impl="splash"), rngs=nnx.Rngs(0))
    reference = STDiT3(cfg.replace(attention_impl="xla"), rngs=nnx.Rngs(0))
    assert model.spatial_blocks[0].attn.attn_impl == "splash_interpret"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, cfg.in_channels, 2, 26, 26)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, 1, 131, cfg.caption_channels)), jnp.float32)
    mask = jnp.asarray(np.arange(131)[None, :] < np.array([[131], [40]]), jnp.int32)
    t = jnp.asarray([100.0, 900.0])
    out, out_ref = (nnx.jit(lambda m: m(x, t, y, mask))(m) for m in (model, reference))
    assert out.shape == out_ref.shape and rel_err(out, out_ref) <= 1e-5


# --------------------------------------------------------------------------------------------
# the compiled program for a TPU, on this machine (libtpu compiles for a topology without one)
# --------------------------------------------------------------------------------------------
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install '.[tpu]'): no TPU compiler here")
# STDiT3-XL/2's head_dim (1152 / 16) on 2 heads; 240p's 405 spatial tokens; 300 caption tokens, lengths per row
HEAD_DIM, HEADS, TOKENS, CAPTION = 72, 2, 405, 300


def _tpu_attention_hlo(impl: str) -> tuple[str | None, str]:
    """Self-attention over 405 tokens, then cross-attention to 300 caption tokens with key lengths, forward and
    backward in bf16, compiled for a TPU v5p 2x2x1 topology (4 chips: fsdp=4, a row per chip) → (the
    resolved implementation, the optimized HLO)."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsora.parallel import mesh as mesh_lib
    from jaxsora.parallel.constraints import logical_rules

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 4, "sequence": 1}, devices)
    c = HEADS * HEAD_DIM
    with jax.set_mesh(mesh):  # the mesh's platform: "auto" resolves for the TPU, not for this CPU
        resolved = L.resolve_attention_impl(impl, jnp.bfloat16, HEAD_DIM)
    layers = nnx.eval_shape(lambda: nnx.List([
        L.Attention(c, HEADS, qk_norm=True, use_rope=False, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attn_impl=resolved),
        L.MultiHeadCrossAttention(c, HEADS, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attn_impl=resolved)]))
    graphdef, params = nnx.split(layers)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
    rows = NamedSharding(mesh, P(mesh_lib.BATCH_AXES))
    x = jax.ShapeDtypeStruct((4, TOKENS, c), jnp.bfloat16, sharding=rows)
    y = jax.ShapeDtypeStruct((4, CAPTION, c), jnp.bfloat16, sharding=rows)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=rows)

    def loss(params, x, y, lengths):
        with logical_rules(mesh_lib.logical_rules(mesh)):
            self_attn, cross_attn = nnx.merge(graphdef, params)
            return jnp.sum(cross_attn(self_attn(x), y, lengths).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(params, x, y, lengths).compile()
    return resolved, compiled.as_text()


def _score_tensors(hlo: str) -> set[str]:
    """Arrays of the HLO whose last two dims are a query × key length, as given or padded (an [N, N] score)."""
    n = "|".join(str(d) for d in (TOKENS, 512, CAPTION, 384))
    return set(re.findall(rf"\b[a-z0-9]+\[[0-9,]*\b(?:{n}),(?:{n})\]", hlo))


@needs_libtpu
@pytest.mark.slow(seconds=40)
def test_auto_attention_compiles_to_the_splash_kernel_for_a_tpu():
    resolved, hlo = _tpu_attention_hlo("auto")
    assert resolved == "splash"
    calls = re.findall(r'custom_call_target="tpu_custom_call"', hlo)
    # forward and fused backward, of each of the two layers
    assert len(calls) == 4, len(calls)
    assert "splash_mha_fwd" in hlo and "splash_mha_dkv" in hlo
    assert not _score_tensors(hlo), _score_tensors(hlo)
    # the kernel runs on each chip's own row (a shard_map): nothing gathers q, k or v onto every chip
    assert not re.search(r"all-gather(-start)?\(", hlo)
    # the control: XLA's attention materializes the [405, 405] scores this test looks for
    resolved, hlo = _tpu_attention_hlo("xla")
    assert resolved is None and "tpu_custom_call" not in hlo
    assert any(s.endswith(f"{TOKENS},{TOKENS}]") for s in _score_tensors(hlo)), _score_tensors(hlo)
