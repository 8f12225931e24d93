"""Model FLOPs per train step and the device's peak, for the MFU the loop logs.

MFU = model FLOPs of the interval's steps / (interval seconds × peak FLOP/s per device × devices).

Model FLOPs are counted from the STDiT3 shapes (the formula of `bench/step.py`), × 3 for forward
and backward (the PaLM convention; for a LoRA run, whose base gets no weight gradients, see
`train_flops_per_sample`): rematerialization, the optimizer, the loss and the frozen
VAE/T5 encoders are not counted. XLA's own count (`CompileInfo.flops`, the compiled step's cost
analysis) is not used: it counts remat's recomputation (a hardware, not a model, count), counts a
`lax.scan` body once (`model.scan_blocks=True` reports one block pair of 28) and gives no FLOPs for
custom calls (cuDNN attention). Per sample, matmuls 2·m·n·k with N = T·S image tokens, C width,
L text tokens (the padded caption length the model computes on), d depth (2d blocks):

    28·N·C²  qkv (6), self-attention proj (2), cross q (2) and proj (2), MLP (16)
  + 4·L·C²   cross-attention k/v of the text          + 4·N·L·C   cross-attention scores and sum
  + 4·T·S²·C (spatial blocks) or 4·S·T²·C (temporal)   self-attention scores and sum

plus the patch embedding, the final layer and the caption MLP.

Peak: dense bf16 tensor-core FLOP/s per device by `device_kind` (fp32 compute: the TF32 rate,
which XLA uses for fp32 matmuls at default precision); `train.peak_flops` overrides it (needed on
any device not in the table). CPU and unknown devices: None, and no MFU is logged.
"""
from __future__ import annotations

from collections.abc import Sequence

# (substring of the lower-cased jax device_kind, compute dtype) → dense peak FLOP/s per device.
# First match wins, so the more specific names come first.
PEAK_FLOPS = (
    (("h100 pcie", "bfloat16"), 756e12), (("h100 pcie", "float32"), 378e12),
    (("h100 nvl", "bfloat16"), 835e12), (("h100 nvl", "float32"), 418e12),
    (("h100", "bfloat16"), 989e12), (("h100", "float32"), 495e12),  # SXM (and GH200)
    (("h200", "bfloat16"), 989e12), (("h200", "float32"), 495e12),
    (("a100", "bfloat16"), 312e12), (("a100", "float32"), 156e12),
)


def _forward_parts(cfg, latent: Sequence[int], text_len: int) -> dict[str, float]:
    """Matmul FLOPs of one STDiT3 forward for one sample of latent size (T, H, W), by what the
    backward needs of them: `tokens` (weights applied to the image tokens: block Linears, final
    layer), `text` (weights applied to the caption only: caption MLP, cross-attention k/v),
    `patch` (the patch embedding of the input), `self_attn` (scores and sums) and `cross_attn`."""
    t, h, w = latent
    pt, ph, pw = cfg.patch_size
    tt, hh, ww = -(-t // pt), -(-h // ph), -(-w // pw)
    s, n, c, length, d = hh * ww, tt * hh * ww, cfg.hidden_size, text_len, cfg.depth
    p = pt * ph * pw
    return dict(
        tokens=d * 2 * 28 * n * c * c + 2 * n * c * p * cfg.out_channels,
        text=d * 2 * 4 * length * c * c + 2 * length * (cfg.caption_channels * c + c * c),
        patch=2 * n * p * cfg.in_channels * c,
        self_attn=d * (4 * tt * s * s * c + 4 * s * tt * tt * c),
        cross_attn=d * 2 * 4 * n * length * c)


def forward_flops(cfg, latent: Sequence[int], text_len: int) -> float:
    """Matmul FLOPs of one STDiT3 forward for one sample of latent size (T, H, W)."""
    return float(sum(_forward_parts(cfg, latent, text_len).values()))


def train_flops_per_sample(cfg, latent: Sequence[int], *, frozen_base: bool = False) -> float:
    """Forward + backward model FLOPs of one sample, caption of `model_max_length`.

    Trained base: 3 × forward (forward, input gradients, weight gradients).
    Frozen base (LoRA): XLA drops the matmuls whose results nothing trainable needs, so the patch
    embedding and the text path run forward only (1×), the token weights get input gradients but
    no weight gradients (2×), self-attention needs gradients of both operands (3×), and
    cross-attention of the queries and probabilities only (2×: the text's k/v are constants).
    The adapters' own FLOPs, rank·(in + out) against in·out per wrapped Linear (about 3 % of it at
    rank 16, width 1152), are not counted: a LoRA run's MFU is a slight underestimate.
    `tests/train/test_mfu.py` holds both counts against XLA's count of the compiled step."""
    parts = _forward_parts(cfg, latent, cfg.model_max_length)
    if not frozen_base:
        return 3.0 * sum(parts.values())
    return float(parts["patch"] + parts["text"] + 2 * parts["tokens"] + 3 * parts["self_attn"]
                 + 2 * parts["cross_attn"])


def device_peak_flops(device_kind: str, compute_dtype: str) -> float | None:
    kind = str(device_kind).lower()
    dtype = "bfloat16" if "bfloat16" in str(compute_dtype) or str(compute_dtype) in ("bf16",) else "float32"
    return next((v for (k, d), v in PEAK_FLOPS if k in kind and d == dtype), None)


def peak_flops(config, devices=None) -> float | None:
    """Peak FLOP/s of one device: `train.peak_flops` when > 0, else the table for the first local
    device and the model's compute dtype; None when unknown (CPU)."""
    override = float(config.train.get("peak_flops", 0.0) or 0.0)
    if override > 0:
        return override
    import jax

    devices = devices if devices is not None else jax.local_devices()
    if not devices or devices[0].platform == "cpu":
        return None
    return device_peak_flops(devices[0].device_kind, config.model.get("compute_dtype", "bfloat16"))
