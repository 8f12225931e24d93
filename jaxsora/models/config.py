"""STDiT3's configuration: plain Python (no jax), so that a preset's name and fields are checked — and the
commands that take them answer a mistake — before jax is imported (`jaxsora.models.presets`)."""
from __future__ import annotations

import dataclasses

REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims", "offload")


@dataclasses.dataclass(frozen=True)
class STDiT3Config:
    """Field names and defaults follow the reference `STDiT3Config`; the last group is ours."""

    depth: int = 28
    hidden_size: int = 1152
    num_heads: int = 16
    mlp_ratio: float = 4.0
    patch_size: tuple = (1, 2, 2)
    in_channels: int = 4
    pred_sigma: bool = True
    caption_channels: int = 4096
    model_max_length: int = 300
    qk_norm: bool = True
    class_dropout_prob: float = 0.1
    input_sq_size: int = 512
    drop_path: float = 0.0
    freeze_y_embedder: bool = False
    # --- jaxsora ---
    compute_dtype: str = "float32"  # "bfloat16" on GPU; parameters are always float32
    # Gradient checkpointing of the blocks: "none", "full" (recompute everything), "dots_saveable"
    # (keep matmul outputs), "dots_with_no_batch_dims" (keep weight matmuls, recompute attention),
    # "offload" (those, kept in pinned host memory). True/False mean "full"/"none".
    remat: str = "none"
    # How many block pairs, from the first, are rematerialized (-1: all) — Open-Sora 2.0's
    # `grad_ckpt_settings`: checkpoint only as many blocks as memory requires.
    remat_blocks: int = -1
    # Run the (spatial, temporal) block pairs under one `lax.scan`: one pair is compiled instead
    # of `depth`. Parameters, checkpoints and conversion are unchanged (stacked on the fly).
    scan_blocks: bool = False
    attention_impl: str = "auto"  # "auto" | "xla" | "cudnn"
    sequence_parallel_axis: str | None = None  # mesh axis for Ulysses spatial attention
    # The reference modulates x_mask == False frames twice in the final layer (T2IFinalLayer). Keep
    # False to load/export Open-Sora checkpoints; True computes the intended single modulation.
    fix_final_layer_double_mod: bool = False

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if isinstance(self.remat, bool) or self.remat is None:  # checkpoints written before policies
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if not (self.remat_blocks == -1 or 0 <= self.remat_blocks <= self.depth):
            raise ValueError(f"remat_blocks must be -1 (all) or 0..depth={self.depth}, got {self.remat_blocks}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_size % 4:
            raise ValueError("hidden_size must be divisible by 4 (2D sin/cos position embedding)")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        if self.drop_path != 0.0:
            raise ValueError("drop_path > 0 is not supported (every Open-Sora 1.2 config uses 0.0)")
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {self.compute_dtype!r}")

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.pred_sigma else self.in_channels

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **kw) -> STDiT3Config:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["patch_size"] = list(self.patch_size)
        return d
