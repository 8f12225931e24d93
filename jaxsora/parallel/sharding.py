"""Shardings of the train state and of batches, from the logical names the model declares.

Every parameter is created with logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`,
stored as the Variable's `out_sharding` metadata). The optimizer moments and the EMA are
params-shaped `nnx.State`s whose Variables keep that metadata, so one rule covers the whole train
state: a Variable gets `fit_spec(logical_to_spec(names, rules))` on the mesh, anything else
(step counters, the RNG key) is replicated.
"""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxsora.parallel.constraints import fit_spec, logical_to_spec
from jaxsora.parallel.mesh import BATCH_AXES


def logical_sharding(names, shape, mesh: jax.sharding.Mesh, rules) -> NamedSharding:
    """The NamedSharding of an array of `shape` whose dims are called `names` (None = unnamed)."""
    if not names:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, fit_spec(logical_to_spec(tuple(names), rules), shape, mesh))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree: Any, mesh: jax.sharding.Mesh, rules) -> Any:
    """A NamedSharding per leaf of `tree` (abstract or concrete): an nnx Variable by its logical
    names (flax's `nnx.get_partition_spec` reads them), any other array replicated.

    The result has the structure of `tree` with each Variable's value replaced by its sharding,
    which is what `jax.jit(out_shardings=...)` and orbax restore targets take.
    """
    def one(x):
        if _is_var(x):
            shape = x.get_value().shape
            names = tuple(nnx.get_partition_spec(x).get_value())  # the raw logical names (no rules context)
            return x.replace(logical_sharding(names, shape, mesh, rules))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_var)


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying the target shardings (restore targets)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_of(tree: Any) -> Any:
    """ShapeDtypeStructs with the shardings of a tree of concrete arrays (what a compile needs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def constrain_tree(tree: Any, shardings: Any) -> Any:
    """`with_sharding_constraint` on every leaf (inside jit: initialize straight into the shards)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) dim over data × fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def host_to_global(local: dict, mesh: jax.sharding.Mesh) -> dict:
    """This host's rows of a global batch (numpy) → global jax Arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v) for k, v in local.items()}


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of abstract or concrete arrays with NamedShardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        n = 1
        for d in shape:
            n *= d
        total += n * x.dtype.itemsize
    return total
