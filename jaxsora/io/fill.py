"""The one function that puts a state dict into an NNX module: `fill_module`.

Each model family gives its name map as three small functions of the NNX path (a tuple):
`key` (the state-dict key), `file_shape` (the shape the file holds for a variable of that
shape) and `to_model` (the file's array → the module's layout). Defaults: the '.'-joined path,
the same shape, the same array — the reference layout of the VAE. T5's table is
`models.t5.hf_key_map`, STDiT3's `convert.torch.torch_key/torch_shape/from_torch_layout`.

Values may be LazyTensors (`jaxsora.io.weights`), numpy or jax arrays; each is read once, checked
against the model's shape before it is read, cast to the variable's dtype (or `dtype`) and placed
(`place`, default `jnp.asarray`; e.g. a `jax.device_put` onto a sharding).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.errors import WeightsError


class StateDictMismatch(WeightsError, KeyError):
    """The state dict lacks keys the model needs, or holds keys it has no place for."""

    def __str__(self):  # KeyError quotes its message
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass
class FillReport:
    mapped: list  # state-dict keys copied into the module, in the module's order
    missing: list  # keys the module has and the state dict lacks (kept as they were)
    unexpected: list  # keys of the state dict the module has no place for (sorted)


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _name(k) -> str:
    return k if isinstance(k, str) else ".".join(map(str, k))


def _show(keys, n: int = 10) -> str:
    names = [_name(k) for k in keys]
    return f"{len(names)} {names[:n]}{' ...' if len(names) > n else ''}"


def fill_module(
    model: nnx.Module,
    tensors: Mapping[Any, Any],
    *,
    source: str = "state dict",
    key: Callable[[tuple], Any] = dotted,
    file_shape: Callable[[tuple, tuple], tuple] | None = None,
    to_model: Callable[[tuple, np.ndarray], np.ndarray] | None = None,
    dtype=None,
    missing: str = "raise",
    unexpected: str = "raise",
    place: Callable[[tuple, Any, np.ndarray], Any] | None = None,
    progress: str | None = None,
) -> tuple[nnx.Module, FillReport]:
    """Copy `tensors` into `model`'s variables in place (an abstract model from `nnx.eval_shape`
    becomes a real one) and return it with a report.

    `missing="raise"` (or "keep": those variables keep their values) and `unexpected="raise"` (or
    "ignore") are checked before anything is read: a StateDictMismatch (a KeyError and a
    ValueError) naming the keys. A wrong shape is a WeightsError naming the key. `progress`: a tqdm
    description, shown for models of 50 variables or more.
    """
    if missing not in ("raise", "keep") or unexpected not in ("raise", "ignore"):
        raise ValueError(f"fill_module: missing={missing!r}, unexpected={unexpected!r}")
    prefix = f"{source}: " if source else ""
    flat = list(nnx.to_flat_state(nnx.state(model)))
    keys = [key(path) for path, _ in flat]
    absent = [k for k in keys if k not in tensors]
    extra = sorted(set(tensors) - set(keys), key=str)
    problems = ([f"{_show(absent)} missing keys"] if absent and missing == "raise" else []) + (
        [f"{_show(extra)} unexpected keys"] if extra and unexpected == "raise" else [])
    if problems:
        raise StateDictMismatch(f"{prefix}state dict does not match the model: {'; '.join(problems)}")
    todo = [(k, path, var) for k, (path, var) in zip(keys, flat) if k in tensors]
    if progress is not None:
        from tqdm import tqdm

        todo = tqdm(todo, desc=progress, unit="tensor", disable=len(flat) < 50)
    mapped = []
    for k, path, var in todo:
        value = tensors[k]
        want = tuple(var.shape) if file_shape is None else tuple(file_shape(path, tuple(var.shape)))
        if tuple(value.shape) != want:
            raise WeightsError(f"{prefix}tensor {_name(k)!r} has shape {tuple(value.shape)}, "
                               f"the model expects {want}")
        arr = np.asarray(value)  # a LazyTensor is read here
        if to_model is not None:
            arr = to_model(path, arr)
        arr = arr.astype(np.dtype(dtype if dtype is not None else var.dtype), copy=False)
        var.set_value(jnp.asarray(arr) if place is None else place(path, var, arr))
        mapped.append(k)
    return model, FillReport(mapped, absent, extra)
