"""Ulysses sequence parallelism for the spatial self-attention (as DeepSpeed-Ulysses and Open-Sora 1.2's
`opensora/acceleration/communications.py`).

Image tokens are sharded over the `sequence` mesh axis. For attention, an all-to-all trades the
sequence shard for a head shard (every device then sees all S tokens of H/sp heads), attention
runs locally, and a second all-to-all trades back. Numerically the same as unsharded attention.
`jax.nn.dot_product_attention` itself must not be sharded over the sequence, hence shard_map.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxsora.parallel.mesh import BATCH_AXES


def ulysses_attention(q, k, v, *, mesh: jax.sharding.Mesh | None, axis_name: str,
                      attn_fn: Callable, batch_axes=BATCH_AXES):
    """q/k/v: [R, S, H, Dh] with S sharded over `axis_name` (R over the batch axes).

    mesh None → the mesh set by `jax.set_mesh`. Without a mesh, or without that axis (one-device
    inference of a model trained with sequence parallelism), attention runs as is. With the axis,
    the heads and S must divide its size (the model pads S; `parallel.mesh.check_sequence_parallel`
    checks the heads before a run starts) — anything else is an error, never a quiet fallback to
    replicated attention.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis_name not in mesh.axis_names or mesh.shape[axis_name] == 1:
        return attn_fn(q, k, v)
    sp = mesh.shape[axis_name]
    if q.shape[2] % sp:
        raise ValueError(f"Ulysses attention: {q.shape[2]} heads do not divide the '{axis_name}' axis ({sp})")
    if q.shape[1] % sp:
        raise ValueError(f"Ulysses attention: {q.shape[1]} tokens do not divide the '{axis_name}' axis ({sp}); "
                         "pad them to a multiple first")
    rows = tuple(a for a in batch_axes if a in mesh.axis_names and mesh.shape[a] > 1)
    rows_size = 1
    for a in rows:
        rows_size *= mesh.shape[a]
    row_spec = (rows if len(rows) > 1 else rows[0]) if rows and q.shape[0] % rows_size == 0 else None
    spec = P(row_spec, axis_name, None, None)

    def local(q, k, v):  # [r, S/sp, H, Dh] → all-to-all → [r, S, H/sp, Dh]
        gather = lambda x: jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)  # noqa: E731
        out = attn_fn(gather(q), gather(k), gather(v))
        return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
