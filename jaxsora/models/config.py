"""STDiT3's configuration: plain Python (no jax), so that a preset's name and fields are checked — and the
commands that take them answer a mistake — before jax is imported (`jaxsora.models.presets`)."""
from __future__ import annotations

import dataclasses

# The concrete gradient-checkpointing policies of the blocks (`stdit3.remat_policy`).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims", "offload", "save_matmuls",
                  "save_qkv_proj")
# `model.remat` also takes "auto": the train step's compile plan picks, per bucket, the first of
# `AUTO_REMAT_LADDER` that fits the device's memory (jaxsora.train.plan.memory).
REMAT_SETTINGS = REMAT_POLICIES + ("auto",)
# `model.attention_impl` (jaxsora.models.layers.resolve_attention_impl): "auto" picks per platform — cuDNN's
# flash attention on a GPU in bf16/fp16, the Pallas splash kernel on a TPU, XLA's attention otherwise; "xla",
# "cudnn" and "splash" force one ("splash" runs on a TPU only).
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
# What each named policy keeps of a block for the backward: `jax.ad_checkpoint.checkpoint_name`s the layers put
# on their matmul outputs (jaxsora/models/layers.py). Everything else of the block is recomputed.
REMAT_SAVED_NAMES = {
    # every matmul output: q/k/v (self: fused qkv; cross: q and the text's k/v), the attention's output before
    # its projection, the two output projections and both MLP layers. Recomputed: norms, modulation, q/k norm,
    # RoPE, GELU, and the attention's softmax (its probabilities, or cuDNN's statistics)
    "save_matmuls": ("qkv", "attn_out", "proj", "mlp_hidden", "mlp_out"),
    # q/k/v and the output projections (MaxText's "save_qkv_proj"): the attention and the MLP are recomputed,
    # the 4C-wide MLP hidden state is not kept
    "save_qkv_proj": ("qkv", "proj"),
}


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """A concrete remat setting of the blocks: `policy` (one of REMAT_POLICIES) on the first `blocks` block
    pairs (-1: all), the rest without remat — what "auto" resolves to per bucket."""

    policy: str
    blocks: int = -1

    def __post_init__(self):
        if self.policy not in REMAT_POLICIES:
            raise ValueError(f"remat policy must be one of {REMAT_POLICIES}, got {self.policy!r}")

    def pairs(self, depth: int) -> int:
        """How many of `depth` block pairs are rematerialized."""
        if self.policy == "none":
            return 0
        return depth if self.blocks < 0 else min(self.blocks, depth)

    def label(self, depth: int) -> str:
        n = self.pairs(depth)
        if n in (0, depth):
            return "none" if n == 0 else self.policy
        return f"{self.policy} {n}/{depth}"


# The rungs "auto" tries, cheapest first (least recomputation): no remat, the named policies that keep the
# matmul outputs (all of them, then q/k/v and the projections only), full remat. Between the last two the plan
# places partial remat — `full` on the first k pairs, the rest without — k from the measured memory of none and
# full (`jaxsora.train.plan.memory.choose_remat`).
AUTO_REMAT_LADDER = (RematChoice("none"), RematChoice("save_matmuls"), RematChoice("save_qkv_proj"),
                     RematChoice("full"))


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
    # "offload" (those, kept in pinned host memory), "save_matmuls" / "save_qkv_proj" (keep the named
    # matmul outputs of REMAT_SAVED_NAMES), "auto" (the train step's compile plan picks per bucket;
    # a model traced outside it runs "full"). True/False mean "full"/"none".
    remat: str = "none"
    # How many block pairs, from the first, are rematerialized (-1: all) — Open-Sora 2.0's
    # `grad_ckpt_settings`: checkpoint only as many blocks as memory requires.
    remat_blocks: int = -1
    # Run the (spatial, temporal) block pairs under one `lax.scan`: one pair is compiled instead
    # of `depth`. Parameters, checkpoints and conversion are unchanged (stacked on the fly).
    scan_blocks: bool = False
    attention_impl: str = "auto"  # one of ATTENTION_IMPLS
    sequence_parallel_axis: str | None = None  # mesh axis for Ulysses spatial attention
    # The reference modulates x_mask == False frames twice in the final layer (T2IFinalLayer). Keep
    # False to load/export Open-Sora checkpoints; True computes the intended single modulation.
    fix_final_layer_double_mod: bool = False

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if isinstance(self.remat, bool) or self.remat is None:  # checkpoints written before policies
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_SETTINGS:
            raise ValueError(f"remat must be one of {REMAT_SETTINGS}, got {self.remat!r}")
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
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
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
