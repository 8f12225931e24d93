"""jaxsora's native checkpoint format (orbax), as far as model weights are concerned.

    CKPT/                      an orbax CheckpointManager root (training outputs use the same)
      <step>/
        params/                StandardSave {"params": P}: the trainable params
        frozen/                StandardSave {"frozen": F}: frozen params and buffers
        ema/                   StandardSave {"ema": P}: the EMA (a converter writes the params again)
        opt_state/             training checkpoints only, never read here (see jaxsora.checkpoint)
        config/                JsonSave: {"model": STDiT3Config fields, ...}

P and F are the model's nnx state as nested dicts (training: nnx.State, each Variable stored as
{"value": array}; converter outputs: pure dicts). Older checkpoints have one `state/` item holding
{"params": W, "ema": W, ...} (and the optimizer state, for training checkpoints); they are read
the same way (only the weight arrays of it).

`save_weights` writes such a folder with one step; `load_weights` reads the model config and the
weights (EMA or not) from any such folder — a manager root (newest step) or one step folder — so
`to-torch` accepts converter outputs and training checkpoints alike, with or without their
`opt_state/` (a copy made with `rsync --exclude opt_state`).
"""
from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from jaxsora.checkpoint.layout import read_config, resolve_step_dir
from jaxsora.errors import WeightsError
from jaxsora.io.fill import fill_module
from jaxsora.models.config import STDiT3Config
from jaxsora.models.stdit3 import STDiT3


def save_weights(path: str, model: STDiT3, *, ema: dict | None = None, step: int = 0,
                 extra_config: dict | None = None) -> str:
    """Write `model` as a one-step checkpoint of the per-item layout: params (trainable), frozen,
    ema (`ema`: a nested dict like the trainable params' `nnx.to_pure_dict`; default the params
    again), config."""
    import orbax.checkpoint as ocp

    from jaxsora.models.stdit3 import trainable_filter

    path = os.path.abspath(path)
    _, trainable, frozen = nnx.split(model, trainable_filter(model.config), ...)
    params, frozen = nnx.to_pure_dict(trainable), nnx.to_pure_dict(frozen)
    config = {"model": model.config.to_dict(), **(extra_config or {})}
    items = dict(params={"params": params}, ema={"ema": ema if ema is not None else params})
    if jax.tree.leaves(frozen):
        items["frozen"] = {"frozen": frozen}
    with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)) as mngr:
        mngr.save(step, args=ocp.args.Composite(
            **{k: ocp.args.StandardSave(v) for k, v in items.items()},
            config=ocp.args.JsonSave(config),
        ))
        mngr.wait_until_finished()
    return path


def _flatten(tree, prefix=()):
    """Flatten nested dicts/nnx.State to {path of str: leaf}. An untargeted orbax restore of an
    nnx.State keeps each Variable as {"value": array}; that level is dropped."""
    if hasattr(tree, "items") and not hasattr(tree, "shape"):
        items = dict(tree.items())
        if set(items) == {"value"} and not hasattr(items["value"], "items"):
            yield prefix, items["value"]
            return
        for k, v in items.items():
            yield from _flatten(v, prefix + (str(k),))
    else:
        yield prefix, getattr(tree, "value", tree) if not hasattr(tree, "shape") else tree


def load_weights(path: str, *, ema: bool = False, step: int | None = None,
                 merge_lora: bool = True) -> tuple[STDiT3Config, dict]:
    """(model config, {nnx path as tuple of str: numpy array}) from a native checkpoint: the params
    (or the EMA) and the frozen variables; the optimizer state is never read. A LoRA run's
    checkpoint (config `lora.rank` > 0: adapters in params/ema, the base in frozen) comes back
    merged, W + scale·A·B, as the plain model's weights (merge_lora=False: base and adapters)."""
    from jaxsora import checkpoint as ck

    step_dir = resolve_step_dir(path, step)
    config = read_config(step_dir)
    if "model" not in config:
        raise ValueError(f"{step_dir}/config has no 'model' entry (STDiT3Config)")
    mcfg = config["model"]
    cfg = STDiT3Config(**{k: v for k, v in mcfg.items() if k in STDiT3Config.__dataclass_fields__})
    try:
        fields = [f for f, _, _ in ck.weight_fields(step_dir, ema)]
        state = ck.read_weights(step_dir, fields)  # verified against integrity.json when there is one
    except ck.CheckpointError as e:
        raise WeightsError(str(e)) from None
    flat = {p: np.asarray(jax.device_get(v)) for p, v in _flatten(state[fields[0]])}
    # Non-trainable model variables are stored beside the params ("frozen"; older: "buffers", ...).
    for extra in fields[1:]:
        flat.update({p: np.asarray(jax.device_get(v)) for p, v in _flatten(state[extra]) if p not in flat})
    if merge_lora:
        from jaxsora.models import lora

        spec = lora.LoRASpec.from_config(config.get("lora"))
        if spec is not None:
            flat = lora.merge_flat(flat, spec.scale)
    return cfg, flat


def apply_weights(model: STDiT3, flat: dict, *, source: str = "checkpoint") -> None:
    """Copy {path-of-str: array} into `model`; missing or mis-shaped entries raise, naming them."""
    fill_module(model, flat, source=source, key=lambda path: tuple(str(p) for p in path), unexpected="ignore")


def load_model(path: str, *, ema: bool = False, step: int | None = None,
               config: STDiT3Config | None = None) -> STDiT3:
    cfg, flat = load_weights(path, ema=ema, step=step)
    model = STDiT3(config or cfg, rngs=nnx.Rngs(0))
    apply_weights(model, flat, source=path)
    return model
