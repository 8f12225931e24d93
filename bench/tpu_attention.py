"""STDiT3's attention layers compiled for a TPU on any machine (libtpu compiles for a topology without one):
XLA's attention against the Pallas splash kernel (`model.attention_impl="splash"`, what "auto" picks on a TPU),
per layer of one bucket — forward and backward in bf16, at STDiT3-XL/2's widths.

    pip install '.[tpu]'
    python bench/tpu_attention.py                                  # 240p × 51 frames (15×30×53), 1 sample a chip
    python bench/tpu_attention.py --latent 15x60x106 --layers spatial --topology v5e:2x2

Nothing runs: each layer is lowered and compiled for the topology's chips, and the table gives per chip the
compiled program's temporary memory (`memory_analysis`), XLA's estimate of the HBM bytes it moves
(`cost_analysis`; a Pallas kernel's own traffic is XLA's guess from its operands), and the attention's FLOPs,
counted here because XLA's cost analysis does not see inside a kernel: 2·Nq·Nk·Dh per matmul of a row and head —
XLA's attention runs 6 such matmuls forward and backward (QKᵀ, PV; dV, dP, dQ, dK), splash 7 with its fused
backward (one key block: QKᵀ is recomputed) and 9 with separate dq and dk/dv kernels, on sequences padded to its
128-lane blocks. "useful" is the share of those FLOPs on real tokens and real matmuls, the rest being padding
and recomputation. Both implementations lay head_dim 72 out in 128 lanes (the TPU's HBM tiling), which no
count here shows. Compiles take minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compiler for the TPU is libtpu's; nothing runs here


def attention_flops(impl: str, rows: int, heads: int, nq: int, nk: int, head_dim: int) -> tuple[float, float]:
    """(FLOPs forward and backward, the share on real tokens and matmuls) of one attention layer."""
    from jaxsora.models import layers as L

    useful = 6 * 2.0 * rows * heads * nq * nk * head_dim
    if impl == "xla" or nk < L.SPLASH_MIN_KEYS:
        return useful, 1.0
    (nq_pad, _), (nk_pad, bkv) = L.splash_blocks(nq), L.splash_blocks(nk)
    matmuls = 7 if nk_pad == bkv else 9
    flops = matmuls * 2.0 * rows * heads * nq_pad * nk_pad * head_dim
    return flops, useful / flops


def compile_layer(layer: str, impl: str, mesh, batch: int, latent, caption: int, hidden: int, heads: int):
    """Compile one layer's forward and backward for the mesh → (seconds, compiled, (rows, nq, nk))."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsora.models import layers as L
    from jaxsora.parallel import mesh as mesh_lib
    from jaxsora.parallel.constraints import logical_rules

    t, h, w = latent
    s = -(-h // 2) * -(-w // 2)  # patch 2×2 (zero-padded at the end, as PatchEmbed3D)
    chips = mesh.size
    with jax.set_mesh(mesh):
        resolved = L.resolve_attention_impl(impl, jnp.bfloat16, hidden // heads)
    kw = dict(dtype=jnp.bfloat16, attn_impl=resolved)
    if layer == "cross":
        module = nnx.eval_shape(lambda: L.MultiHeadCrossAttention(hidden, heads, rngs=nnx.Rngs(0), **kw))
        x_shape, dims = (batch * chips, t * s, hidden), (batch, t * s, caption)
    else:
        temporal = layer == "temporal"
        module = nnx.eval_shape(lambda: L.Attention(hidden, heads, qk_norm=True, use_rope=temporal, rngs=nnx.Rngs(0),
                                                    **kw))
        x_shape, dims = ((batch * chips * s, t, hidden), (batch * s, t, t)) if temporal else \
            ((batch * chips * t, s, hidden), (batch * t, s, s))
    graphdef, params = nnx.split(module)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh_lib.BATCH_AXES))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), params)
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16, sharding=rows)
    y = jax.ShapeDtypeStruct((batch * chips, caption, hidden), jnp.bfloat16, sharding=rows)
    lengths = jax.ShapeDtypeStruct((batch * chips,), jnp.int32, sharding=rows)

    def loss(params, x, y, lengths):
        with logical_rules(mesh_lib.logical_rules(mesh)):
            m = nnx.merge(graphdef, params)
            out = m(x, y, lengths) if layer == "cross" else m(x)
            return jnp.sum(out.astype(jnp.float32) ** 2)

    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, y, lengths).compile()
    return time.perf_counter() - start, compiled, dims


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1", help="a TPU topology name (version:shape)")
    p.add_argument("--latent", default="15x30x53", help="latent T×H×W (240p × 51 frames: 15x30x53)")
    p.add_argument("--batch", type=int, default=1, help="samples per chip")
    p.add_argument("--caption", type=int, default=300, help="caption tokens (keys of the cross-attention)")
    p.add_argument("--hidden", type=int, default=1152, help="width (STDiT3-XL/2: 1152)")
    p.add_argument("--heads", type=int, default=16, help="heads (STDiT3-XL/2: 16, head_dim 72)")
    p.add_argument("--layers", default="spatial,temporal,cross")
    p.add_argument("--impls", default="xla,splash")
    args = p.parse_args(argv)

    import importlib.util

    if importlib.util.find_spec("libtpu") is None:  # a missing extra: one line, exit code 2 (jaxsora/errors.py)
        print("tpu_attention: libtpu is not installed: pip install '.[tpu]'", file=sys.stderr)
        sys.exit(2)
    from jax.experimental import topologies

    from jaxsora.parallel import mesh as mesh_lib

    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": -1, "sequence": 1}, devices)
    latent = tuple(int(v) for v in args.latent.split("x"))
    head_dim = args.hidden // args.heads
    table = []
    for layer in args.layers.split(","):
        for impl in args.impls.split(","):
            seconds, compiled, (rows, nq, nk) = compile_layer(layer, impl, mesh, args.batch, latent, args.caption,
                                                              args.hidden, args.heads)
            hlo = compiled.as_text()
            flops, useful = attention_flops(impl, rows, args.heads, nq, nk, head_dim)
            table.append((layer, impl, f"{nq}×{nk}", hlo.count('custom_call_target="tpu_custom_call"'),
                          compiled.memory_analysis().temp_size_in_bytes / 2**20,
                          compiled.cost_analysis()["bytes accessed"] / 2**30, flops / 1e9, useful, seconds))
            print(f"  compiled {layer} {impl}: {seconds:.0f} s", flush=True)
    print(f"\n{devices[0].device_kind} {args.topology} ({len(devices)} chips), latents {args.latent}, "
          f"{args.batch} sample a chip, caption {args.caption}, hidden {args.hidden}, {args.heads} heads of "
          f"{head_dim}, bf16; per chip")
    head = (f"{'layer':<9} {'impl':<7} {'Nq×Nk':>10} {'kernels':>7} {'temp MiB':>9} {'HBM GiB':>8} "
            f"{'attn GFLOP':>10} {'useful':>6} {'compile s':>9}")
    print(head)
    print("-" * len(head))
    for layer, impl, dims, kernels, temp, hbm, gflop, useful, seconds in table:
        print(f"{layer:<9} {impl:<7} {dims:>10} {kernels:>7} {temp:>9.1f} {hbm:>8.2f} {gflop:>10.1f} "
              f"{useful:>6.0%} {seconds:>9.0f}")


if __name__ == "__main__":
    main()
