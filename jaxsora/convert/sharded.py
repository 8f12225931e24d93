"""STDiT3 weights read straight into their shards (`--ckpt-path`, restore of weights only).

Every parameter is built with `jax.make_array_from_callback`: each device's shard is read from the
file on its own (a memory-mapped slice of a safetensors/.pth tensor, or an orbax read of the
shard), so peak host memory is about one shard of one tensor and no device ever holds a full
copy of the model. Sources:

- a jaxsora checkpoint (a run's `checkpoints/`, one `<step>/`, or a converter output): params (or
  `ema=True`: the EMA) and the frozen variables, restored with orbax into the target shardings;
- an Open-Sora STDiT3 or PixArt-Σ `.safetensors`/`.pth`: keys and layouts as `convert.torch` maps
  them (PixArt's `blocks.*` → `spatial_blocks.*`, its 2-D patch kernel gets a time axis, `pos_embed`
  dropped, `y_embedding` padded/truncated to `model_max_length`). What the file lacks keeps the
  fresh initialization it is given (reported as initialized).
"""
from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from flax import nnx

from jaxsora.convert.torch import LoadReport, from_torch_layout, torch_key, torch_shape
from jaxsora.io.weights import LazyTensor, open_state_dict


def _flat(state) -> dict[tuple, nnx.Variable]:
    return {tuple(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


def _reparameterized(sd: dict[str, LazyTensor], model_max_length: int) -> dict[str, LazyTensor]:
    """The reference loader's renames and fixes (spec §1.11), lazily: only the two small tensors
    whose values change are read here."""
    pixart = any(k.startswith("blocks.") for k in sd) and not any(k.startswith("spatial_blocks.") for k in sd)
    out = {}
    for k, v in sd.items():
        if k in ("pos_embed", "pos_embed_temporal"):
            continue
        out[("spatial_" + k) if pixart and k.startswith("blocks.") else k] = v
    w = out.get("x_embedder.proj.weight")
    if w is not None and w.ndim == 4:  # PixArt's Conv2d patch kernel → Conv3d with a time axis of 1
        arr = np.asarray(w[...])[:, :, None]
        out["x_embedder.proj.weight"] = LazyTensor(arr.shape, arr.dtype, arr.__getitem__)
    y = out.get("y_embedder.y_embedding")
    if y is not None and y.shape[0] != model_max_length:  # repeat the last row, or truncate
        arr = np.asarray(y[...])
        n = model_max_length
        arr = arr[:n] if arr.shape[0] > n else np.concatenate([arr, np.repeat(arr[-1:], n - arr.shape[0], 0)])
        out["y_embedder.y_embedding"] = LazyTensor(arr.shape, arr.dtype, arr.__getitem__)
    return out


def _torch_index(path: tuple, index: tuple) -> tuple:
    """A JAX-layout shard index → the same block in the PyTorch layout (kernels are transposed)."""
    if path[-1] != "kernel":
        return index
    if len(index) == 2:  # Linear [in, out] ↔ weight [out, in]
        return (index[1], index[0])
    return (index[4], index[3], index[0], index[1], index[2])  # Conv3d [kt, kh, kw, in, out] ↔ [out, in, kt, kh, kw]


def _from_lazy(path: tuple, tensor: LazyTensor, var_sharding, shape, dtype) -> jax.Array:
    def shard(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        block = tensor[_torch_index(path, index)]
        return from_torch_layout(path, block).astype(dtype)

    return jax.make_array_from_callback(shape, var_sharding, shard)


def load_torch_weights(path: str, state, shardings, config) -> tuple[object, LoadReport]:
    """Fill `state` (an nnx.State of every model Variable, sharded; the fresh initialization) from
    an Open-Sora / PixArt-Σ file, shard by shard. Returns (new state, report)."""
    sd = _reparameterized(open_state_dict(path), config.model_max_length)
    flat, flat_sh = _flat(state), _flat(shardings)
    mapped, initialized, new = [], [], {}
    for p, var in flat.items():
        key = torch_key(p)
        if key not in sd:
            initialized.append(key)
            continue
        tensor, want = sd[key], tuple(var.get_value().shape)
        if tuple(tensor.shape) != torch_shape(p, want):
            raise ValueError(f"{path}: shape mismatch for {key}: the file has {tuple(tensor.shape)}, "
                             f"the model expects {torch_shape(p, want)}")
        new[p] = _from_lazy(p, tensor, flat_sh[p].get_value(), want, var.get_value().dtype)
        mapped.append(key)
    used = {torch_key(p) for p in new}
    report = LoadReport(mapped, initialized, sorted(set(sd) - used))
    return _replace(state, new), report


def _replace(state, new: dict):
    pairs = []
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(p) for p in path)
        pairs.append((path, var.replace(new[key]) if key in new else var))
    return nnx.from_flat_state(pairs)


def _checkpoint_subtrees(meta_tree: dict, ema: bool) -> list[str]:
    """Which subtrees of a stored `state` hold the model variables, in lookup order."""
    first = "ema" if ema else "params"
    if first not in meta_tree:
        raise ValueError(f"the checkpoint's state has no {first!r} entry (it has {sorted(meta_tree)})")
    return [first] + [k for k in ("frozen", "buffers", "model_state") if k in meta_tree]


def load_native_weights(path: str, state, shardings, *, ema: bool = False, step: Optional[int] = None):
    """Fill `state` from a jaxsora checkpoint folder, each array restored into its sharding.
    Every model variable must be present (a jaxsora checkpoint is complete)."""
    import orbax.checkpoint as ocp

    from jaxsora.convert.native import resolve_step_dir

    step_dir = resolve_step_dir(path, step)
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(os.path.join(step_dir, "state"))
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None) or dict(meta)
    subtrees = _checkpoint_subtrees(tree, ema)

    def find(p):
        for sub in subtrees:
            node = tree[sub]
            for part in p + ("value",):
                if not isinstance(node, dict) or part not in node:
                    node = None
                    break
                node = node[part]
            if node is not None:
                return sub, node
        return None, None

    flat, flat_sh = _flat(state), _flat(shardings)
    item, restore_args, where, missing = {}, {}, {}, []
    for p, var in flat.items():
        sub, leaf = find(p)
        if leaf is None:
            missing.append(".".join(p))
            continue
        want = tuple(var.get_value().shape)
        if tuple(leaf.shape) != want:
            raise ValueError(f"{step_dir}: shape mismatch for {'.'.join(p)}: stored {tuple(leaf.shape)}, "
                             f"the model expects {want}")
        node_i, node_a = item.setdefault(sub, {}), restore_args.setdefault(sub, {})
        for part in p:
            node_i, node_a = node_i.setdefault(part, {}), node_a.setdefault(part, {})
        dtype = var.get_value().dtype
        node_i["value"] = jax.ShapeDtypeStruct(want, dtype, sharding=flat_sh[p].get_value())
        node_a["value"] = ocp.ArrayRestoreArgs(sharding=flat_sh[p].get_value(), dtype=dtype)
        where[p] = (sub,) + p + ("value",)
    if missing:
        raise ValueError(f"{step_dir}: missing {len(missing)} model weights, e.g. {missing[:5]}")
    restored = ckptr.restore(os.path.join(step_dir, "state"),
                             args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    new = {}
    for p, keys in where.items():
        node = restored
        for k in keys:
            node = node[k]
        new[p] = node
    return _replace(state, new)
