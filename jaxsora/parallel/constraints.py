"""Logical axis names → mesh shardings: the one mapping used for parameters and activations.

The model annotates activations with logical names (`constrain(x, ("batch", "seq", "embed"))`).
Outside `with logical_rules(rules):` (or without a mesh set by `jax.set_mesh`) this is a no-op,
so the model runs unchanged on one device. `jaxsora.parallel.mesh` owns the rules tables;
`jaxsora.parallel.sharding` applies the same mapping to parameters and the train state.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import PartitionSpec

Rules = Sequence[tuple[str, object]]  # (logical name, mesh axis | tuple of axes | None)
_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("jaxsora_rules", default=None)


@contextlib.contextmanager
def logical_rules(rules: Rules) -> Iterator[None]:
    token = _RULES.set(tuple(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    table = dict(rules)
    used: set = set()
    out = []
    for name in names:
        axes = table.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        axes_t = tuple(a for a in axes_t if a not in used)
        used.update(axes_t)
        out.append(axes_t if len(axes_t) > 1 else (axes_t[0] if axes_t else None))
    return PartitionSpec(*out)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh) -> PartitionSpec:
    """`spec` with every dim whose size does not divide its mesh axes left replicated (odd bucket
    shapes, a 4-wide bias on an 8-way fsdp axis). `mesh` is a Mesh or an AbstractMesh."""
    fixed = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            fixed.append(None)
            continue
        size = 1
        for a in ((axes,) if isinstance(axes, str) else axes):
            size *= mesh.shape[a]
        fixed.append(axes if dim % size == 0 else None)
    while fixed and fixed[-1] is None:  # canonical form (what XLA reports back): no trailing Nones
        fixed.pop()
    return PartitionSpec(*fixed)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    rules = _RULES.get()
    if rules is None:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(logical_to_spec(names, rules), x.shape, mesh))
