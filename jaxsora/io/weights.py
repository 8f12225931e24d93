"""Lazy readers of weights files: nothing is read until a slice of a tensor is asked for.

`open_state_dict(path)` → {key: LazyTensor} for `.safetensors` (memory-mapped; bfloat16 through
ml_dtypes, which `safetensors.numpy` cannot represent) and `.pth/.pt/.bin/.ckpt` (torch's
`mmap=True` load, torch imported only then). Wrapper dicts (`ema`, `model`, `state_dict`,
`module`) and `module.` key prefixes (DDP, ColossalAI) are removed. A `LazyTensor[index]` reads
just that slice, so a sharded load holds one shard of one tensor at a time on the host.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np

from jaxsora.errors import MissingDependency, MissingFile, WeightsError

TORCH_EXTS = (".pth", ".pt", ".bin", ".ckpt")
WEIGHT_EXTS = (".safetensors",) + TORCH_EXTS
# Wrappers Open-Sora / PixArt / ColossalAI / DDP put around a state dict.
WRAPPER_KEYS = ("ema", "model", "state_dict", "module")

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class LazyTensor:
    """A tensor in a file: `.shape`, `.dtype` (numpy), `[index]` → numpy (only that slice is read)."""

    def __init__(self, shape, dtype, read, name: str = ""):
        self.shape, self.dtype, self._read = tuple(int(d) for d in shape), np.dtype(dtype), read
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self._read(index))

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out.astype(dtype) if dtype is not None else out


class SafetensorsFile(Mapping[str, LazyTensor]):
    """A memory-mapped `.safetensors` file as {key: LazyTensor}."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", head)
            if n > os.path.getsize(path):
                raise WeightsError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise WeightsError(f"{path}: not a safetensors file (unreadable header)") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self.offset = 8 + n

    def __getitem__(self, key: str) -> LazyTensor:
        info = self.header[key]
        if info["dtype"] not in _ST_DTYPES:
            raise WeightsError(f"{self.path}: tensor {key!r} has unsupported safetensors dtype {info['dtype']}")
        dt = np.dtype(_ST_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        start, end = info["data_offsets"]

        def read(index):
            if end == start:  # an empty tensor
                return np.zeros(shape, dt)[index]
            if not shape:  # a scalar (np.memmap wants at least one dim)
                return np.frombuffer(self._bytes(start, end), dt).reshape(())[index]
            arr = np.memmap(self.path, dtype=dt, mode="r", offset=self.offset + start, shape=shape)
            return np.array(arr[index])  # copies just the slice out of the map

        return LazyTensor(shape, dt, read, key)

    def _bytes(self, start, end) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset + start)
            return f.read(end - start)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header)

    def __len__(self) -> int:
        return len(self.header)


def _torch_lazy(t, name: str) -> LazyTensor:
    import torch

    def read(index):
        part = t[index]
        if part.dtype == torch.bfloat16:
            return part.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return part.contiguous().numpy()

    dtype = ml_dtypes.bfloat16 if t.dtype == torch.bfloat16 else t.new_empty(()).numpy().dtype
    return LazyTensor(tuple(t.shape), dtype, read, name)


def _load_torch(path: str):
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the install
        raise MissingDependency(f"reading {path} needs torch: pip install 'jaxsora[torch]'") from e
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise WeightsError(f"{path}: cannot read it as a weights-only torch checkpoint ({e})") from e
    except Exception as e:
        raise WeightsError(f"{path}: cannot read it as a weights-only torch checkpoint ({e})") from e


def unwrap(tree: Mapping[str, Any], is_tensor) -> dict:
    """Strip `{ema|model|state_dict|module: ...}` wrappers and `module.` key prefixes."""
    for _ in range(4):
        if any(is_tensor(v) for v in tree.values()):
            break
        inner = next((tree[w] for w in WRAPPER_KEYS if isinstance(tree.get(w), Mapping)), None)
        if inner is None:
            break
        tree = inner
    out = {}
    for k, v in tree.items():
        if not is_tensor(v):
            continue
        while k.startswith("module."):
            k = k[len("module."):]
        out[k] = v
    return out


def open_state_dict(path: str) -> dict[str, LazyTensor]:
    """{key: LazyTensor} of a weights file, unwrapped (see the module docstring)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MissingFile(f"weights file not found: {path}")
    if path.endswith(".safetensors"):
        f = SafetensorsFile(path)
        return unwrap({k: f[k] for k in f}, lambda v: isinstance(v, LazyTensor))
    if path.endswith(TORCH_EXTS):
        import torch

        obj = _load_torch(path)
        if not isinstance(obj, Mapping):
            raise WeightsError(f"{path}: expected a state dict, found a {type(obj).__name__}")
        flat = unwrap(obj, lambda v: isinstance(v, torch.Tensor))
        return {k: _torch_lazy(v, k) for k, v in flat.items()}
    raise WeightsError(f"{path}: unknown weights format (expected .safetensors, .pth, .pt, .bin or .ckpt)")
