"""The one reader of weights files: nothing is read until a slice of a tensor is asked for.

`open_state_dict(path)` → {key: LazyTensor} for `.safetensors` (the `safetensors` library,
memory-mapped, numpy framework: bfloat16 as ml_dtypes.bfloat16, no torch), `.pth/.pt/.bin/.ckpt`
(torch's `mmap=True` load, torch imported only then) and Hugging Face / diffusers folders
(`model.safetensors`, a sharded `*.index.json`, `pytorch_model.bin`,
`diffusion_pytorch_model.safetensors`, ...). Wrapper dicts (`ema`, `model`, `state_dict`,
`module`) and `module.` key prefixes (DDP, ColossalAI) are removed. A `LazyTensor[index]` reads
just that slice, so a sharded load holds one shard of one tensor at a time on the host.
`read_state_dict(path)` reads everything into numpy. A missing file is a MissingFile, an
unreadable one a WeightsError (one line each). Filling a module: `jaxsora.io.fill`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxsora.errors import MissingDependency, MissingFile, WeightsError, one_line

TORCH_EXTS = (".pth", ".pt", ".bin", ".ckpt")
WEIGHT_EXTS = (".safetensors",) + TORCH_EXTS
# Wrappers Open-Sora / PixArt / ColossalAI / DDP put around a state dict.
WRAPPER_KEYS = ("ema", "model", "state_dict", "module")

# safetensors dtype names → numpy (bfloat16 is ml_dtypes', as safetensors.numpy gives it).
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
# What a Hugging Face / diffusers folder holds, in the order looked for (an index before its shards).
HF_WEIGHT_FILES = (
    "model.safetensors.index.json", "model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors",
    "pytorch_model.bin.index.json", "pytorch_model.bin",
    "diffusion_pytorch_model.bin.index.json", "diffusion_pytorch_model.bin",
    "model.pth",
)


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
    """A memory-mapped `.safetensors` file as {key: LazyTensor}, read with the `safetensors` library
    (numpy framework: bfloat16 comes back as ml_dtypes.bfloat16). A file the library refuses (too
    short, a bad header, data not covering the header's tensors) is a one-line WeightsError."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(path, framework="numpy")
        except Exception as e:  # safetensors' SafetensorError (and OSError for unreadable files)
            raise WeightsError(f"{path}: not a readable safetensors file ({one_line(e)})") from e
        self.metadata = self._file.metadata() or {}
        keys = self._file.offset_keys() if hasattr(self._file, "offset_keys") else self._file.keys()
        self._keys = dict.fromkeys(keys)  # in file order, as the header lists them

    def __getitem__(self, key: str) -> LazyTensor:
        if key not in self._keys:
            raise KeyError(key)
        part = self._file.get_slice(key)
        name = part.get_dtype()
        if name not in _ST_DTYPES:
            raise WeightsError(f"{self.path}: tensor {key!r} has unsupported safetensors dtype {name}")

        def read(index):
            try:
                return part[index]
            except Exception:  # what get_slice cannot cut (empty tensors, steps, negative bounds): numpy does
                return self._file.get_tensor(key)[index]

        return LazyTensor(part.get_shape(), _ST_DTYPES[name], read, key)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class ShardedStateDict(Mapping[str, LazyTensor]):
    """A Hugging Face `*.index.json` (its `weight_map`: key → shard file) as {key: LazyTensor};
    each shard is opened the first time one of its keys is asked for."""

    def __init__(self, index_path: str):
        self.path, self.folder = index_path, os.path.dirname(index_path)
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise WeightsError(f"{index_path}: not a readable weights index ({one_line(e)})") from e
        if not weight_map or not isinstance(weight_map, dict):
            raise WeightsError(f"{index_path}: no 'weight_map'")
        for name in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(self.folder, name)):
                raise MissingFile(f"{index_path} names shard {name!r}, which is missing from {self.folder}")
        self.index: dict[str, str] = dict(weight_map)
        self._open: dict[str, Mapping[str, LazyTensor]] = {}

    def __getitem__(self, key: str) -> LazyTensor:
        name = self.index[key]
        if name not in self._open:
            self._open[name] = open_state_dict(os.path.join(self.folder, name))
        shard = self._open[name]
        if key not in shard:
            raise WeightsError(f"{self.path} puts {key!r} in {name}, which does not hold it")
        return shard[key]

    def __contains__(self, key) -> bool:
        return key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


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
            raise WeightsError(f"{path}: cannot read it as a weights-only torch checkpoint ({one_line(e)})") from e
    except Exception as e:
        raise WeightsError(f"{path}: cannot read it as a weights-only torch checkpoint ({one_line(e)})") from e


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


def weights_file(path: str) -> str:
    """The file `open_state_dict(path)` reads: `path` itself, or in a Hugging Face / diffusers folder the first of
    `HF_WEIGHT_FILES` it holds. MissingFile when there is none (nothing is read)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        name = next((n for n in HF_WEIGHT_FILES if os.path.isfile(os.path.join(path, n))), None)
        if name is None:
            raise MissingFile(f"{path}: no weights in the folder (looked for {', '.join(HF_WEIGHT_FILES)})")
        path = os.path.join(path, name)
    if not os.path.isfile(path):
        raise MissingFile(f"weights file not found: {path}")
    return path


def open_state_dict(path: str) -> Mapping[str, LazyTensor]:
    """{key: LazyTensor} of a weights file, unwrapped (see the module docstring), or of a Hugging
    Face / diffusers folder: the first of `HF_WEIGHT_FILES` it holds (a sharded `*.index.json` opens
    its shards as their keys are asked for)."""
    path = weights_file(path)
    if path.endswith(".index.json"):
        return ShardedStateDict(path)
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


def read_state_dict(path: str) -> dict[str, np.ndarray]:
    """`open_state_dict(path)` read whole into {key: numpy array}, float16/bfloat16 upcast to float32."""
    def full(t):
        a = np.asarray(t[...])
        return a.astype(np.float32) if a.dtype in (np.float16, ml_dtypes.bfloat16) else a

    return {k: full(v) for k, v in open_state_dict(path).items()}
