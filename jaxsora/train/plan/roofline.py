"""FLOPs of each bucket's compiled step, beside the model's, and a roofline lower bound of its step time.

- compiled FLOPs: the matmul FLOPs one device runs in the compiled step, counted from its optimized HLO
  (`plan.hlo.matmul_flops`): rematerialized recomputation, the frozen VAE and T5 and all;
- model FLOPs: `plan.mfu`'s formula (3 × the STDiT3 forward, what MFU is logged against), per device;
- full remat's extra: what `full` remat would add over no remat (the forward of every block pair once more,
  the formula's), where the chosen remat is lighter than full: what that choice saves per step;
- roofline: max(compiled FLOPs ÷ peak FLOP/s, bytes ÷ memory bandwidth) per device — the time the step cannot
  beat on the target's chip, an ESTIMATE from datasheet peaks, never a measurement. Bytes: the compiler's own
  count of the bytes its ops access where it gives one (`cost_analysis`, XLA:TPU and XLA:CPU), else the step's
  arguments and outputs, each touched at least once. Communication is not in it.
"""
from __future__ import annotations

import dataclasses

from jaxsora.train.plan import hlo, mfu

TFLOP = 1e12


@dataclasses.dataclass
class Speed:
    bucket: tuple
    compiled_flops: float  # per device
    model_flops: float  # per device, the formula's
    full_remat_extra: float | None  # per device, the formula's forward of the blocks; None: full remat chosen
    bytes: float  # per device, see the module docstring
    bytes_source: str  # "compiler" | "arguments+outputs"
    roofline_s: float | None  # None: the chip's peaks are unknown (this machine's CPU)


def _blocks_forward(cfg, latent, text_len) -> float:
    parts = mfu._forward_parts(cfg, latent, text_len)
    t, h, w = latent
    pt, ph, pw = cfg.patch_size
    n = -(-t // pt) * -(-h // ph) * -(-w // pw)
    final = 2 * n * cfg.hidden_size * pt * ph * pw * cfg.out_channels  # the final layer is not in a block
    text_kv = cfg.depth * 2 * 4 * text_len * cfg.hidden_size ** 2
    return parts["tokens"] - final + parts["self_attn"] + parts["cross_attn"] + text_kv


def rows(setup, buckets, target=None) -> list[Speed]:
    """One Speed per bucket row of `memory.compile_buckets` (its executable: the step's, adopted)."""
    from jaxsora.train.step.train_step import batch_key

    cfg = setup.model_config
    n = setup.mesh.size
    chip = target.chip if target is not None else None
    out = []
    for r in buckets:
        spec = setup.batch_spec(tuple(r.bucket[1:]), r.global_batch)
        compiled = r.info.matmul_flops
        if compiled is None:  # this machine's own compile: its executable is at hand
            exe = setup.step.executables.get(batch_key(spec))
            if exe is None:
                continue
            compiled = hlo.matmul_flops(exe.as_text())
        latent = setup.encoders.latent_size(tuple(r.bucket[1:]))
        model = mfu.train_flops_per_sample(cfg, latent) * r.global_batch / n
        choice = setup.step.remat_for(spec)
        pairs = cfg.depth if choice is None and cfg.remat == "full" else (choice.pairs(cfg.depth) if choice and
                                                                         choice.policy == "full" else 0)
        extra = None if pairs == cfg.depth else \
            _blocks_forward(cfg, latent, cfg.model_max_length) * r.global_batch / n * (cfg.depth - pairs) / cfg.depth
        accessed = r.info.bytes_accessed
        moved = accessed if accessed else float(r.info.argument_bytes + r.info.output_bytes)
        roof = None
        if chip is not None:
            peak = chip.peak_bf16 if "bfloat16" in cfg.compute_dtype else chip.peak_f32
            roof = max(compiled / peak, moved / chip.hbm_bytes_per_s)
        out.append(Speed(tuple(r.bucket), compiled, model, extra, moved,
                         "compiler" if accessed else "arguments+outputs", roof))
    return out


def format_rows(speed, target=None) -> str:
    head = (f"{'bucket (res, frames×H×W)':<30} {'compiled TFLOP':>14} {'model TFLOP':>11} {'ratio':>6} "
            f"{'full remat +TFLOP':>17} {'GB moved':>9} {'roofline s':>10}")
    lines = ["FLOPs per device and step: compiled (the HLO's matmuls: remat recompute, VAE and T5 included) and "
             "the model's (plan/mfu.py's formula)" + (f"; roofline on {target.chip.label}: max(FLOPs ÷ peak, bytes ÷ "
                                                       "bandwidth), an ESTIMATE, not a measurement" if target else ""),
             head, "-" * len(head)]
    for s in speed:
        res, t, h, w = s.bucket
        extra = "chosen" if s.full_remat_extra is None else f"{s.full_remat_extra / TFLOP:.1f}"
        roof = "-" if s.roofline_s is None else f"≥ {s.roofline_s:.3f}"
        lines.append(f"{f'{res} {t}×{h}×{w}':<30} {s.compiled_flops / TFLOP:>14.1f} {s.model_flops / TFLOP:>11.1f} "
                     f"{s.compiled_flops / max(s.model_flops, 1):>6.2f} {extra:>17} {s.bytes / 1e9:>9.1f} {roof:>10}")
    if speed and any(s.full_remat_extra for s in speed):
        lines.append("full remat +TFLOP: what full remat would recompute on top of the chosen remat (the blocks' "
                     "forward, formula) — the FLOPs a lighter choice saves")
    return "\n".join(lines)
