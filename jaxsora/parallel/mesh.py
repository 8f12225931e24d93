"""The device mesh of a run and its logical-axis rules.

Mesh axes `(data, fsdp, sequence)`:
- `data`: plain data parallelism (parameters replicated);
- `fsdp`: data parallelism with parameters, gradients, EMA and Adam moments sharded (ZeRO-3);
- `sequence`: Ulysses sequence parallelism — each sample's image tokens are split over this axis;
  spatial self-attention trades the token shard for a head shard with an all-to-all
  (`jaxsora.parallel.sequence`), everything else is token-local.

The batch is split over `data × fsdp`; every step is one bucket for the whole mesh.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax

from jaxsora.errors import UserError

MESH_AXES = ("data", "fsdp", "sequence")
BATCH_AXES = ("data", "fsdp")


class MeshError(UserError, ValueError):
    """A mesh the config asks for cannot be built or used (a user error: message, no traceback)."""


def mesh_shape(mesh_cfg: Mapping, num_devices: int) -> dict[str, int]:
    """{axis: size} from the config; at most one axis may be -1 (the remaining devices).

    Without a -1 the mesh may use fewer devices than there are (the first ones).
    """
    shape = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
    bad = {a: s for a, s in shape.items() if s < 1 and s != -1}
    if bad:
        raise MeshError(f"mesh sizes must be positive or -1, got {bad}")
    free = [a for a, s in shape.items() if s == -1]
    if len(free) > 1:
        raise MeshError(f"mesh: at most one axis may be -1, got {shape}")
    known = math.prod(s for s in shape.values() if s != -1)
    if free:
        if num_devices % known:
            raise MeshError(f"mesh {shape}: the fixed axes ({known} devices) do not divide the {num_devices} devices")
        shape[free[0]] = num_devices // known
    need = math.prod(shape.values())
    if need > num_devices:
        raise MeshError(f"mesh {shape} needs {need} devices, there are {num_devices}")
    return shape


def make_mesh(mesh_cfg: Mapping, devices: list | None = None) -> jax.sharding.Mesh:
    """The run's mesh, with Auto axis types (logical-rule sharding; see design.md)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    n = math.prod(shape.values())
    return jax.make_mesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=devices[:n] if n < len(devices) else devices)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def sequence_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return int(mesh.shape.get("sequence", 1))


def logical_rules(mesh: jax.sharding.Mesh) -> tuple:
    """Logical axis name → mesh axes, for parameters and activations alike.

    Parameters' `embed` dim is FSDP-sharded (params, grads, EMA and Adam moments all sharded);
    activations' `batch` goes over data × fsdp and image tokens (`seq`) over `sequence`. A mesh
    axis is used at most once per array (the first name that claims it wins), and a dim that does
    not divide its axes stays replicated (`constraints.fit_spec`).
    """
    seq = "sequence" if sequence_parallel_size(mesh) > 1 else None
    return (("batch", BATCH_AXES), ("embed", "fsdp"), ("seq", seq), ("frames", None), ("heads", None),
            ("mlp", None), ("adaln", None), ("caption", None), ("vocab", None))


def check_sequence_parallel(num_heads: int, mesh: jax.sharding.Mesh) -> None:
    """Ulysses shards attention heads over the `sequence` axis: the head count must divide."""
    sp = sequence_parallel_size(mesh)
    if sp > 1 and num_heads % sp:
        ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise MeshError(f"mesh.sequence={sp} does not divide the model's {num_heads} attention heads "
                        f"(Ulysses shards heads over the sequence axis); use one of {ok}")
