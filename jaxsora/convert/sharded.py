"""STDiT3 weights read straight into their shards (`--ckpt-path`, restore of weights only).

Every parameter is built with `jax.make_array_from_callback`: each device's shard is read from the
file on its own (a memory-mapped slice of a safetensors/.pth tensor, or an orbax read of the
shard), so peak host memory is about one shard of one tensor and no device ever holds a full
copy of the model. Sources:

- a jaxsora checkpoint (a run's `checkpoints/`, one `<step>/`, or a converter output): params (or
  `ema=True`: the EMA) and the frozen variables, restored with orbax into the target shardings from
  the weight items alone (never the optimizer's), and checked against the step's integrity.json;
- an Open-Sora STDiT3 or PixArt-Σ `.safetensors`/`.pth`: keys and layouts as `convert.torch` maps
  them (PixArt's `blocks.*` → `spatial_blocks.*`, its 2-D patch kernel gets a time axis, `pos_embed`
  dropped, `y_embedding` padded/truncated to `model_max_length`). What the file lacks keeps the
  fresh initialization it is given (reported as initialized).
"""
from __future__ import annotations

import jax

from jaxsora.convert.torch import LoadReport, from_torch_layout, reparameterize, torch_key, torch_shape
from jaxsora.errors import WeightsError
from jaxsora.io.weights import open_state_dict


def _torch_index(path: tuple, index: tuple) -> tuple:
    """A JAX-layout shard index → the same block in the PyTorch layout (kernels are transposed)."""
    if path[-1] != "kernel":
        return index
    if len(index) == 2:  # Linear [in, out] ↔ weight [out, in]
        return (index[1], index[0])
    return (index[4], index[3], index[0], index[1], index[2])  # Conv3d [kt, kh, kw, in, out] ↔ [out, in, kt, kh, kw]


def _from_lazy(path: tuple, tensor, target: jax.ShapeDtypeStruct) -> jax.Array:
    """tensor: a lazy tensor or numpy array in the PyTorch layout; each device's block is read alone."""
    def shard(index):
        index = tuple(index) + (slice(None),) * (len(target.shape) - len(index))
        block = tensor[_torch_index(path, index)]
        return from_torch_layout(path, block).astype(target.dtype)

    return jax.make_array_from_callback(target.shape, target.sharding, shard)


def read_torch_weights(path: str, targets: dict, model_max_length: int) -> tuple[dict, LoadReport]:
    """{NNX path: sharded jax.Array} of the `targets` an Open-Sora / PixArt-Σ file holds, each
    read shard by shard, and the report (mapped / initialized = absent from the file / ignored)."""
    sd = reparameterize(open_state_dict(path), model_max_length)
    out, initialized = {}, []
    for p, target in targets.items():
        key = torch_key(p)
        if key not in sd:
            initialized.append(key)
            continue
        tensor = sd[key]
        if tuple(tensor.shape) != torch_shape(p, target.shape):
            raise WeightsError(f"{path}: shape mismatch for {key}: the file has {tuple(tensor.shape)}, "
                             f"the model expects {torch_shape(p, target.shape)}")
        out[p] = _from_lazy(p, tensor, target)
    mapped = [torch_key(p) for p in out]
    return out, LoadReport(mapped, initialized, sorted(set(sd) - set(mapped)))


def read_native_weights(path: str, targets: dict, *, ema: bool = False, step: int | None = None,
                        verify: bool = True) -> dict:
    """{NNX path: sharded jax.Array} for every target, from a jaxsora checkpoint folder: orbax
    reads each shard into its sharding. Every model variable must be there (a jaxsora checkpoint
    is complete). Only the weight items are opened (params or ema, and frozen; the older layout's
    single `state` item: only those arrays of it) — never the optimizer state, so a copy without
    `opt_state/` works. verify: the arrays read are checked against the step's integrity.json."""
    import orbax.checkpoint as ocp

    from jaxsora import checkpoint as ck
    from jaxsora.checkpoint.layout import resolve_step_dir

    step_dir = resolve_step_dir(path, step)
    try:
        sources = ck.weight_fields(step_dir, ema)
    except ck.CheckpointError as e:
        raise WeightsError(str(e)) from None

    def find(names):
        """(item folder, stored path, leaf metadata): an nnx.State stores each Variable as
        {"value": array} (training checkpoints), a pure dict as the array (converter outputs)."""
        for field, item_dir, tree in sources:
            node = tree
            for part in names:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and "value" in node:
                return item_dir, (field,) + names + ("value",), node["value"]
            if node is not None and not isinstance(node, dict):
                return item_dir, (field,) + names, node
        return None, None, None

    items, restore_args, where, missing = {}, {}, {}, []
    for p, target in targets.items():
        names = tuple(str(x) for x in p)
        item_dir, keys, leaf = find(names)
        if leaf is None:
            missing.append(".".join(names))
            continue
        if tuple(leaf.shape) != tuple(target.shape):
            raise WeightsError(f"{step_dir}: shape mismatch for {'.'.join(names)}: stored {tuple(leaf.shape)}, "
                             f"the model expects {tuple(target.shape)}")
        node_i, node_a = items.setdefault(item_dir, {}), restore_args.setdefault(item_dir, {})
        for part in keys[:-1]:
            node_i, node_a = node_i.setdefault(part, {}), node_a.setdefault(part, {})
        node_i[keys[-1]] = target
        node_a[keys[-1]] = ocp.ArrayRestoreArgs(sharding=target.sharding, dtype=target.dtype)
        where[p] = (item_dir, keys)
    if missing:
        raise WeightsError(f"{step_dir}: missing {len(missing)} model weights, e.g. {missing[:5]}")
    restored = {}
    with ocp.PyTreeCheckpointer() as ckptr:
        for item_dir, item in items.items():
            restored[item_dir] = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args[item_dir], partial_restore=True))
    out, by_name = {}, {}
    for p, (item_dir, keys) in where.items():
        node = restored[item_dir]
        for k in keys:
            node = node[k]
        out[p] = by_name[".".join(keys)] = node
    if verify:
        # the stored dtype is what the record describes: compare only arrays read without a cast
        same = {n: x for n, x in by_name.items() if _stored_dtype(sources, n) in (None, str(x.dtype))}
        ck.verify_arrays(step_dir, same)
    return out


def _stored_dtype(sources, name: str) -> str | None:
    field, *parts = name.split(".")
    for f, _, tree in sources:
        if f != field:
            continue
        node = tree
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
        return str(getattr(node, "dtype", None)) if node is not None and not isinstance(node, dict) else None
    return None
