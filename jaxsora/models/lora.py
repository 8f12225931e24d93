"""LoRA (low-rank adaptation) of STDiT3's Linear layers, in Flax NNX.

A targeted `nnx.Linear` (a module path matched by `lora.targets`) is replaced, after the model is
built — concretely or abstractly, inside `nnx.eval_shape` or a jitted init — by a `LoRALinear`
that computes

    y = x·W + b + scale·(dropout(x)·A)·B,      A: [din, r], B: [r, dout], scale = alpha / r

A is initialized as peft does (`kaiming`: U(−1/√din, 1/√din), torch's kaiming_uniform(a=√5) on
lora_A.weight; `gaussian`: N(0, 1/r²)), B with zeros, so a fresh adapter leaves the output exactly
the base model's. W and b are the base Linear's own `nnx.Param`s under their own names, so every
base parameter keeps its path (`spatial_blocks.0.attn.qkv.kernel`): `--ckpt-path` (Open-Sora,
PixArt or jaxsora weights) and the PyTorch name map apply unchanged. A and B are `LoRAParam`s
(`spatial_blocks.0.attn.qkv.lora_a`, `.lora_b`), their own Variable type so that filters select them; their
logical sharding names follow the base kernel's: A (in_axis, None), B (None, out_axis).

With LoRA on, the trainable parameters are the `LoRAParam`s alone (`trainable_filter`): the
optimizer state and the EMA hold adapters only (the EMA of A and of B; a merge of the EMA is
W + scale·EMA(A)·EMA(B)); the base Params and the Buffers are the frozen part of the train state.

Dropout (`lora.dropout`, on the adapter's input) is active only inside `dropout_rng(key)` — the
train step opens it; evaluation and sampling never do. Each adapter derives its mask key from that
key and a hash of its own module path, so masks do not depend on trace order (remat recomputes the
same masks) nor on the sharding; they do depend on the activation's shape, which sequence-parallel
padding of the image tokens changes. Not with `scan_blocks` (one traced body for every block).

Target patterns (`select`): a pattern is a dot-separated module path piece (`fnmatch` wildcards per
component) that must equal a contiguous run of a Linear's path components: "attn.qkv" selects
`spatial_blocks.N.attn.qkv` and `temporal_blocks.N.attn.qkv` (not `cross_attn.*`), "temporal_blocks"
every Linear of the temporal blocks, "spatial_blocks.*.mlp.fc1" those fc1s, "t_block.1" the
adaLN projection. Presets (`PRESETS`) expand first: "attention", "cross_attention", "mlp", "all"
(= the three: every Linear of the transformer blocks). A pattern that selects no Linear is an error
naming the available ones.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.errors import UserError
from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.models.layers import dense_matmul

PRESETS: dict[str, tuple[str, ...]] = {
    "attention": ("attn.qkv", "attn.proj"),  # self-attention (spatial and temporal blocks)
    "cross_attention": ("cross_attn.q_linear", "cross_attn.kv_linear", "cross_attn.proj"),
    "mlp": ("mlp.fc1", "mlp.fc2"),  # the blocks' MLPs
}
PRESETS["all"] = PRESETS["attention"] + PRESETS["cross_attention"] + PRESETS["mlp"]
INITS = ("kaiming", "gaussian")
# The adapters' names (PyTorch: peft's lora_A / lora_B, transposed: see `to_torch_adapters`).
A_NAME, B_NAME = "lora_a", "lora_b"
# Folded into the init key, so that the adapters' initialization is a stream of its own.
_INIT_STREAM = 0x4C6F5241


class LoRAError(UserError, ValueError):
    """A LoRA setting that cannot be applied (one line)."""


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: trained while every other variable of the model is frozen."""


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """The `lora` config group, resolved (rank > 0: LoRA is on)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = ("attention", "cross_attention")
    init: str = "kaiming"

    def __post_init__(self):
        object.__setattr__(self, "targets", normalize_targets(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise LoRAError(f"lora.rank must be a positive integer (0: LoRA off), got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise LoRAError(f"lora.alpha must be > 0 (scale = alpha / rank), got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise LoRAError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise LoRAError(f"lora.init must be one of {', '.join(INITS)}, got {self.init!r}")
        if not self.targets:
            raise LoRAError("lora.targets is empty: name the Linear layers to adapt (e.g. 'attention', 'all', "
                            "'attn.qkv')")

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)

    @classmethod
    def from_config(cls, group) -> LoRASpec | None:
        """The spec of a `lora` config group (ConfigDict or dict); None when absent or rank 0."""
        if group is None:
            return None
        g = dict(group.to_dict() if hasattr(group, "to_dict") else group)
        rank = g.get("rank", 0)
        if rank == 0 or rank is None:
            return None
        return cls(rank=rank, alpha=g.get("alpha", rank), dropout=g.get("dropout", 0.0),
                   targets=g.get("targets", cls.targets), init=g.get("init", "kaiming"))

    def to_dict(self) -> dict:
        return dict(rank=int(self.rank), alpha=float(self.alpha), dropout=float(self.dropout),
                    targets=list(self.targets), init=self.init)


def normalize_targets(targets) -> tuple:
    """Target patterns as a tuple of stripped strings; entries may hold several, comma-separated
    (`--config.lora.targets=attention,mlp` arrives as one entry)."""
    if isinstance(targets, str):
        targets = (targets,)
    out = []
    for t in targets or ():
        if not isinstance(t, str):
            raise LoRAError(f"lora.targets must be strings (module name patterns or presets), got {t!r}")
        out.extend(p.strip() for p in t.split(",") if p.strip())
    return tuple(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------
# the adapted layer
# --------------------------------------------------------------------------------------------
_DROPOUT: contextvars.ContextVar = contextvars.ContextVar("jaxsora_lora_dropout", default=None)


@contextlib.contextmanager
def dropout_rng(key: jax.Array):
    """Adapter dropout is active inside this context (the train step's forward), with masks
    derived from `key`; outside it (eval, sampling) adapters see their whole input. The context is
    read while the model is traced: open it inside the jitted function, with a traced key."""
    token = _DROPOUT.set(key)
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def _path_id(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class LoRALinear(nnx.Module):
    """`nnx.Linear` plus a low-rank update: y = x·W + b + scale·(dropout(x)·A)·B.

    `kernel`/`bias` are the base Linear's own Variables (same names, values and sharding names);
    the base term is computed exactly as `nnx.Linear` computes it (inputs and weights cast to the
    compute dtype, one dot_general, the bias added), so with B = 0 the output is the base output.
    """

    def __init__(self, base: nnx.Linear, *, rank: int, scale: float, dropout: float, init: str, key, name: str):
        if not isinstance(base, nnx.Linear):
            raise TypeError(f"LoRA wraps nnx.Linear layers, got {type(base).__name__} at {name}")
        din, dout = int(base.in_features), int(base.out_features)
        self.in_features, self.out_features = din, dout
        self.kernel = base.kernel
        self.bias = base.bias
        self.dtype = base.dtype
        self.precision = base.precision
        self.rank, self.scale, self.dropout = int(rank), float(scale), float(dropout)
        self.path_id = _path_id(name)
        names = tuple(base.kernel.get_metadata().get("out_sharding") or (None, None))
        in_name, out_name = (tuple(names) + (None, None))[:2]
        if init == "kaiming":  # peft default: kaiming_uniform_(lora_A.weight [r, din], a=√5) → U(±1/√din)
            bound = 1.0 / math.sqrt(din)
            a = jax.random.uniform(key, (din, rank), jnp.float32, -bound, bound)
        else:  # peft "gaussian": normal_(lora_A.weight, std=1/r)
            a = jax.random.normal(key, (din, rank), jnp.float32) / rank
        self.lora_a = LoRAParam(a, out_sharding=(in_name, None))
        self.lora_b = LoRAParam(jnp.zeros((rank, dout), jnp.float32), out_sharding=(None, out_name))

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype if self.dtype is not None else jnp.result_type(x, self.kernel[...])
        xc = x.astype(dt)
        y = dense_matmul(xc, self.kernel[...].astype(dt), self.precision)
        if self.bias is not None:
            y += jnp.reshape(self.bias[...].astype(dt), (1,) * (y.ndim - 1) + (-1,))
        h = xc
        key = _DROPOUT.get()
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.path_id), 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / jnp.asarray(1.0 - self.dropout, dt), jnp.zeros((), dt))
        low = dense_matmul(h, self.lora_a[...].astype(dt), self.precision)  # [..., r]
        low = low * jnp.asarray(self.scale, dt)
        return y + dense_matmul(low, self.lora_b[...].astype(dt), self.precision)


# --------------------------------------------------------------------------------------------
# selecting and wrapping the targets
# --------------------------------------------------------------------------------------------
def path_name(path: Sequence) -> str:
    return ".".join(str(p) for p in path)


def linear_paths(model: nnx.Module) -> list[tuple]:
    """Module paths of the model's Linear layers (plain or already adapted), in tree order."""
    return [tuple(p) for p, m in nnx.iter_modules(model) if isinstance(m, (nnx.Linear, LoRALinear))]


def expand_targets(targets: Iterable[str]) -> tuple:
    """Presets replaced by their patterns (order kept, duplicates dropped)."""
    out = []
    for t in normalize_targets(tuple(targets)):
        out.extend(PRESETS.get(t, (t,)))
    return tuple(dict.fromkeys(out))


def matches(pattern: str, path: Sequence) -> bool:
    """`pattern`'s components equal (fnmatch) a contiguous run of the path's components."""
    pat = pattern.split(".")
    parts = [str(p) for p in path]
    return any(all(fnmatch.fnmatchcase(parts[i + j], pat[j]) for j in range(len(pat)))
               for i in range(len(parts) - len(pat) + 1))


def _generic(path: Sequence) -> str:
    """A path with the block index as "*" (`spatial_blocks.*.attn.qkv`): the names an error lists."""
    parts = [str(p) for p in path]
    return ".".join("*" if i and parts[i - 1].endswith("_blocks") and p.isdigit() else p for i, p in enumerate(parts))


def available_names(paths: Iterable[Sequence]) -> list[str]:
    return list(dict.fromkeys(_generic(p) for p in paths))


def select(paths: Sequence[Sequence], targets: Iterable[str]) -> list[tuple]:
    """The paths (of Linear layers) that the target patterns select, in the given order. Raises
    LoRAError (one line, naming the available modules and presets) for a pattern selecting none."""
    paths = [tuple(p) for p in paths]
    chosen = set()
    for t in normalize_targets(tuple(targets)):
        hit = [p for p in paths for pat in PRESETS.get(t, (t,)) if matches(pat, p)]
        if not hit:
            raise LoRAError(f"lora.targets: {t!r} matches no Linear layer of the model; available: "
                            f"{', '.join(available_names(paths))} (presets: {', '.join(PRESETS)})")
        chosen.update(hit)
    return [p for p in paths if p in chosen]


def _check_scan(selected: Sequence[tuple], spec: LoRASpec, config) -> None:
    """`scan_blocks` stacks the blocks' parameters: every block of a kind needs the same adapters,
    and the scanned body would reuse one dropout mask for every block."""
    if not getattr(config, "scan_blocks", False):
        return
    if spec.dropout > 0:
        raise LoRAError("lora.dropout > 0 is not supported with model.scan_blocks (the scanned block body would "
                        "reuse one dropout mask for every block); set one of them off")
    for kind in ("spatial_blocks", "temporal_blocks"):
        per_block: dict = {i: set() for i in range(config.depth)}
        for p in selected:
            if len(p) > 2 and str(p[0]) == kind:
                per_block[int(p[1])].add(tuple(str(x) for x in p[2:]))
        if len({frozenset(v) for v in per_block.values()}) > 1:
            raise LoRAError(f"model.scan_blocks needs the same LoRA targets in every one of the {kind}; "
                            "the targets select different layers in different blocks (turn scan_blocks off "
                            "or target every block alike)")


def _init_key(seed: int, name: str) -> jax.Array:
    base = jax.random.fold_in(jax.random.key(seed), _INIT_STREAM)
    return jax.random.fold_in(base, _path_id(name))


def _child(parent, name):
    return parent[name] if isinstance(name, int) else getattr(parent, name)


def apply_lora(model: nnx.Module, spec: LoRASpec, *, seed: int = 0) -> list[str]:
    """Replace the targeted Linear layers of `model` (in place) by LoRALinear layers; returns
    their paths ("spatial_blocks.0.attn.qkv", ...). Each adapter's A is drawn from a key of
    (seed, its path), whatever else is targeted. Works on abstract models and inside traces."""
    paths = select(linear_paths(model), spec.targets)
    _check_scan(paths, spec, getattr(model, "config", None))
    names = []
    for path in paths:
        parent = model
        for p in path[:-1]:
            parent = _child(parent, p)
        base = _child(parent, path[-1])
        if isinstance(base, LoRALinear):
            raise LoRAError(f"{path_name(path)} already has a LoRA adapter")
        name = path_name(path)
        new = LoRALinear(base, rank=spec.rank, scale=spec.scale, dropout=spec.dropout, init=spec.init,
                         key=_init_key(seed, name), name=name)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
        names.append(name)
    return names


def has_adapters(model: nnx.Module) -> bool:
    return any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(model))


def trainable_filter(model: nnx.Module):
    """What the optimizer updates: the adapters when the model has any, else STDiT3's own rule."""
    if has_adapters(model):
        return LoRAParam
    from jaxsora.models.stdit3 import trainable_filter as base_filter

    return base_filter(model.config)


@functools.lru_cache(maxsize=16)
def _model_linear_paths(config) -> tuple:
    from jaxsora.models.stdit3 import STDiT3

    small = config.replace(hidden_size=8 * config.num_heads, caption_channels=8)  # the names do not depend on sizes
    model = nnx.eval_shape(lambda: STDiT3(small, rngs=nnx.Rngs(0)))
    return tuple(linear_paths(model))


def check_targets(spec: LoRASpec, config) -> list[str]:
    """The module paths `spec` adapts in an STDiT3 of `config` (no weights are built); raises
    LoRAError for a pattern selecting nothing or a combination the model cannot run."""
    paths = select(_model_linear_paths(config), spec.targets)
    _check_scan(paths, spec, config)
    return [path_name(p) for p in paths]


# --------------------------------------------------------------------------------------------
# flat weights: merging and exporting
# --------------------------------------------------------------------------------------------
def is_adapter_path(path: Sequence) -> bool:
    return len(path) > 0 and str(path[-1]) in (A_NAME, B_NAME)


def adapter_modules(flat: Mapping[tuple, Any]) -> dict[tuple, tuple]:
    """{module path: (A [din, r], B [r, dout])} of the adapters in a flat {path: array} mapping."""
    out = {}
    for p in flat:
        if str(p[-1]) == A_NAME:
            m = tuple(p[:-1])
            b = flat.get(m + (B_NAME,))
            if b is None:
                raise LoRAError(f"{path_name(p)} has no {B_NAME} beside it")
            out[m] = (flat[p], b)
    return out


def merge_flat(flat: Mapping[tuple, Any], scale: float) -> dict[tuple, np.ndarray]:
    """A flat {path: array} of a LoRA model → the plain model's: each adapted kernel becomes
    W + scale·A·B (computed in float64, stored in W's dtype); the adapters are dropped."""
    mods = adapter_modules(flat)
    out = {tuple(p): v for p, v in flat.items() if not is_adapter_path(p)}
    for m, (a, b) in mods.items():
        k = m + ("kernel",)
        if k not in out:
            raise LoRAError(f"the adapter {path_name(m)} has no base kernel {path_name(k)}")
        w = np.asarray(out[k])
        delta = np.asarray(a, np.float64) @ np.asarray(b, np.float64) * float(scale)
        if delta.shape != w.shape:
            raise LoRAError(f"{path_name(m)}: A·B is {delta.shape}, the kernel {w.shape}")
        out[k] = (w.astype(np.float64) + delta).astype(w.dtype)
    return out


def to_torch_adapters(flat: Mapping[tuple, Any], dtype=np.float32) -> dict[str, np.ndarray]:
    """The adapters in peft's PyTorch layout: `<module>.lora_A.weight` [r, din] (= Aᵀ) and
    `<module>.lora_B.weight` [dout, r] (= Bᵀ); module names are the PyTorch module paths."""
    sd = {}
    for m, (a, b) in sorted(adapter_modules(flat).items(), key=lambda kv: _sort_key(kv[0])):
        name = path_name(m)
        sd[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(a).T).astype(dtype)
        sd[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(b).T).astype(dtype)
    return sd


def _sort_key(path: Sequence) -> tuple:
    return tuple((0, int(p), "") if str(p).isdigit() else (1, 0, str(p)) for p in path)


__all__ = [
    "LoRAParam", "LoRALinear", "LoRASpec", "LoRAError", "PRESETS", "apply_lora", "select", "matches",
    "expand_targets", "check_targets", "trainable_filter", "has_adapters", "dropout_rng", "merge_flat",
    "adapter_modules", "to_torch_adapters", "is_adapter_path", "linear_paths", "available_names",
]
