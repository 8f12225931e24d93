"""STDiT3 weights ⇄ PyTorch state dicts (Open-Sora 1.2 and PixArt-Σ).

The NNX module tree mirrors the PyTorch one, so the name map is one rule: join the NNX path with
"." and call a Linear/Conv `kernel` a `weight`. Layouts differ only for kernels:

| NNX leaf                        | PyTorch                                  |
| ------------------------------- | ---------------------------------------- |
| Linear `kernel` [in, out]       | `weight` [out, in] (transpose)           |
| Conv3d `kernel` [kt, kh, kw, in, out] | `weight` [out, in, kt, kh, kw]     |
| everything else (`bias`, norm `weight`, `scale_shift_table`,  | same name, same array |
| `rope.freqs`, `y_embedder.y_embedding`) |                                          |

safetensors files are read and written with numpy (no torch); `.pth`/`.pt`/`.bin` need torch,
imported only then. bfloat16 goes through a uint16 view (torch's `from_numpy` has no bf16).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable

import ml_dtypes
import numpy as np
from flax import nnx

from jaxsora.errors import WeightsError
from jaxsora.io.fill import fill_module
from jaxsora.io.weights import TORCH_EXTS, read_state_dict, unwrap  # noqa: F401  (read_state_dict: re-exported)
from jaxsora.models.config import STDiT3Config
from jaxsora.models.layers import rope_frequencies
from jaxsora.models.stdit3 import STDiT3


# --------------------------------------------------------------------------------------------
# names and layouts
# --------------------------------------------------------------------------------------------
def torch_key(path: tuple) -> str:
    parts = [str(p) for p in path]
    if parts[-1] == "kernel":
        parts[-1] = "weight"
    return ".".join(parts)


def torch_shape(path: tuple, shape: tuple) -> tuple:
    """The PyTorch shape of an NNX leaf of `shape` (kernels are transposed, see the table above)."""
    shape = tuple(shape)
    if path[-1] != "kernel":
        return shape
    return shape[::-1] if len(shape) == 2 else (shape[4], shape[3], *shape[:3])


def to_torch_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] != "kernel":
        return value
    if value.ndim == 2:
        return value.T
    if value.ndim == 5:
        return np.transpose(value, (4, 3, 0, 1, 2))
    raise ValueError(f"unexpected kernel rank {value.ndim} at {'.'.join(map(str, path))}")


def from_torch_layout(path: tuple, value: np.ndarray) -> np.ndarray:
    if path[-1] != "kernel":
        return value
    if value.ndim == 2:
        return value.T
    if value.ndim == 5:
        return np.transpose(value, (2, 3, 4, 1, 0))
    raise ValueError(f"unexpected weight rank {value.ndim} for {torch_key(path)}")


def _flat_variables(model: nnx.Module):
    return nnx.to_flat_state(nnx.state(model, nnx.Variable))


def torch_shapes(config_or_model) -> list[tuple[str, tuple]]:
    """(key, PyTorch shape) in the reference's registration order, without building weights
    (give a config, or a model from `nnx.eval_shape`)."""
    if isinstance(config_or_model, STDiT3Config):
        model = nnx.eval_shape(lambda: STDiT3(config_or_model, rngs=nnx.Rngs(0)))
    else:
        model = config_or_model
    config = model.config
    out = {}
    for path, var in _flat_variables(model):
        out[torch_key(path)] = torch_shape(path, var.shape if hasattr(var, "shape") else var[...].shape)
    return sorted(out.items(), key=lambda kv: _registration_rank(kv[0], config.depth))


_TOP_ORDER = ["rope", "x_embedder", "t_embedder", "fps_embedder", "t_block", "y_embedder",
              "spatial_blocks", "temporal_blocks", "final_layer"]
_BLOCK_ORDER = ["scale_shift_table", "attn.qkv.weight", "attn.qkv.bias", "attn.q_norm", "attn.k_norm",
                "attn.proj.weight", "attn.proj.bias", "cross_attn.q_linear.weight", "cross_attn.q_linear.bias",
                "cross_attn.kv_linear.weight", "cross_attn.kv_linear.bias", "cross_attn.proj.weight",
                "cross_attn.proj.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]


def _registration_rank(key: str, depth: int):
    """Sort key reproducing PyTorch's registration order of STDiT3's state dict."""
    top = key.split(".")[0]
    rank = [_TOP_ORDER.index(top)]
    if top in ("spatial_blocks", "temporal_blocks"):
        _, idx, rest = key.split(".", 2)
        rank += [int(idx), next(i for i, p in enumerate(_BLOCK_ORDER) if rest.startswith(p))]
    else:
        rest = key[len(top) + 1:]
        # y_embedding (buffer) before y_proj; weight before bias; lower Sequential index first.
        rank += [0 if "y_embedding" in rest else 1, [int(n) for n in re.findall(r"\d+", rest)],
                 "fc2" in rest, "linear" in rest, rest.endswith("bias")]
    return rank


# --------------------------------------------------------------------------------------------
# JAX → PyTorch
# --------------------------------------------------------------------------------------------
def to_torch_state_dict(model_or_state, dtype=np.float32,
                        config: STDiT3Config | None = None) -> dict[str, np.ndarray]:
    """The reference STDiT3 state dict (all 973 keys for XL/2, registration order) as numpy.

    `model_or_state` is an STDiT3 or a flat {nnx path tuple: array} mapping (e.g. EMA weights);
    `dtype` float32 (default) or bfloat16 (ml_dtypes).
    """
    if isinstance(model_or_state, nnx.Module):
        depth = model_or_state.config.depth
        flat = [(p, np.asarray(v[...])) for p, v in _flat_variables(model_or_state)]
    else:
        depth = config.depth if config is not None else 1_000_000
        flat = [(tuple(p), np.asarray(v)) for p, v in model_or_state.items()]
    sd = {torch_key(p): np.ascontiguousarray(to_torch_layout(p, v)).astype(dtype) for p, v in flat}
    return dict(sorted(sd.items(), key=lambda kv: _registration_rank(kv[0], depth)))


def save_torch_state_dict(sd: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """Write `.safetensors` (numpy, no torch) or `.pth`/`.pt` (torch.save of a flat dict)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    if path.endswith(".safetensors"):
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, path, metadata=metadata)
    elif path.endswith(TORCH_EXTS):
        torch = _import_torch(path)
        out = {}
        for k, v in sd.items():
            if v.dtype == ml_dtypes.bfloat16:
                out[k] = torch.from_numpy(np.ascontiguousarray(v).view(np.uint16)).view(torch.bfloat16)
            else:
                out[k] = torch.from_numpy(np.ascontiguousarray(v))
        torch.save(out, path)
    else:
        raise ValueError(f"{path}: choose a .safetensors or .pth/.pt output")


# --------------------------------------------------------------------------------------------
# PyTorch → JAX
# --------------------------------------------------------------------------------------------
def _import_torch(path):
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(f"reading/writing {path} needs torch: pip install 'jaxsora[torch]'") from e
    return torch


def unwrap_state_dict(sd: dict) -> dict[str, np.ndarray]:
    """Strip `{ema|model|state_dict|module: ...}` wrappers and `module.` key prefixes."""
    return unwrap(sd, lambda v: isinstance(v, np.ndarray))


def is_pixart(sd: dict[str, np.ndarray]) -> bool:
    return any(k.startswith("blocks.") for k in sd) and not any(k.startswith("spatial_blocks.") for k in sd)


def reparameterize(sd: dict, model_max_length: int) -> dict:
    """What the reference's `load_checkpoint` does before loading (`opensora/utils/ckpt_utils.py`):

    PixArt-Σ: `blocks.i.*` → `spatial_blocks.i.*`; a 4-D `x_embedder.proj.weight` gets a time axis;
    every file: `pos_embed`/`pos_embed_temporal` dropped; `y_embedder.y_embedding` padded by
    repeating its last row, or truncated, to `model_max_length` rows.

    Values may be numpy arrays or lazy tensors (`jaxsora.io.weights`): only the two tensors whose
    values change are read (they come back as numpy), everything else is passed through.
    """
    sd = dict(sd)
    if is_pixart(sd):
        sd = {("spatial_" + k if k.startswith("blocks.") else k): v for k, v in sd.items()}
    w = sd.get("x_embedder.proj.weight")
    if w is not None and w.ndim == 4:
        sd["x_embedder.proj.weight"] = np.asarray(w[...])[:, :, None]
    for k in ("pos_embed", "pos_embed_temporal"):
        sd.pop(k, None)
    y = sd.get("y_embedder.y_embedding")
    n = model_max_length
    if y is not None and y.shape[0] != n:
        y = np.asarray(y[...])
        pad = np.repeat(y[-1:], max(0, n - y.shape[0]), 0)
        sd["y_embedder.y_embedding"] = y[:n] if y.shape[0] > n else np.concatenate([y, pad])
    return sd


@dataclasses.dataclass
class LoadReport:
    mapped: list[str]
    initialized: list[str]
    ignored: list[str]

    def summary(self) -> str:
        lines = [f"mapped {len(self.mapped)}, initialized {len(self.initialized)}, ignored {len(self.ignored)}"]
        if self.initialized:
            lines.append("initialized as the reference does (not in the file): " + _abbrev(self.initialized))
        if self.ignored:
            lines.append("ignored (no such parameter): " + _abbrev(self.ignored))
        return "\n".join(lines)


def _abbrev(keys: Iterable[str], n: int = 12) -> str:
    keys = list(keys)
    # Fold block indices so that 476 temporal-block keys read as one line.
    folded = sorted({re.sub(r"(_blocks)\.\d+\.", r"\1.*.", k) for k in keys})
    more = f" … (+{len(folded) - n} more)" if len(folded) > n else ""
    return ", ".join(folded[:n]) + more


def load_torch_state_dict(model: STDiT3, sd: dict[str, np.ndarray], *, strict: bool = False) -> LoadReport:
    """Copy reference-named weights into `model` in place. Keys absent from `sd` keep the model's
    (reference-style) initialization; a wrong shape is a ValueError naming the key; `strict`: a
    missing or unexpected key is an error (a ValueError and KeyError naming them)."""
    sd = reparameterize(unwrap_state_dict(sd), model.config.model_max_length)
    if "rope.freqs" in sd:  # the architecture's constants, which the model rotates by (`layers.RotaryEmbedding`)
        want = rope_frequencies(model.config.head_dim)
        got = np.asarray(sd["rope.freqs"]).astype(np.float32)
        # 1%: a bf16 export (`to-torch --dtype bf16`) holds them rounded (≤ 0.4%); another base or head_dim
        # is off by far more
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-2, atol=0):
            raise WeightsError(f"rope.freqs {got.shape} is not STDiT3's RoPE frequencies 1/10000^(2j/{2 * want.size})"
                               f" (head_dim {model.config.head_dim}): this model rotates by those")
    _, rep = fill_module(model, sd, source="", key=torch_key, file_shape=torch_shape, to_model=from_torch_layout,
                         missing="raise" if strict else "keep", unexpected="raise" if strict else "ignore")
    return LoadReport(rep.mapped, rep.missing, rep.unexpected)


def from_torch_state_dict(state_dict: dict, config: STDiT3Config, *, seed: int = 0,
                          return_report: bool = False):
    """Build an STDiT3 from a reference (Open-Sora STDiT3 or PixArt-Σ) state dict.

    Parameters the dict lacks are initialized as the reference initializes them (seeded).
    """
    model = STDiT3(config, rngs=nnx.Rngs(seed))
    report = load_torch_state_dict(model, state_dict)
    return (model, report) if return_report else model
