"""The documented range of every numeric knob of a run config, and its check (`check_ranges`): a value out of
its range is one line naming the knob, its range and what the ends mean. Needs nothing but the config, so the
trainer's command line runs it before importing jax (`validate.check_before_jax`)."""
from __future__ import annotations

from jaxsora.errors import ConfigError

# The documented range of every numeric knob: key → (low, high, note). `low`/`high` are
# inclusive bounds (None: unbounded); the note says what the ends mean. Checked before any work.
RANGES = {
    "train.max_steps": (0, None, "optimizer steps of the run; 0 writes the initial checkpoint only"),
    "train.ckpt_every": (1, None, "steps between checkpoints"),
    "train.epochs": (0, None, "epochs of the run (steps per epoch from the bucket plan), max_steps a cap; "
                              "0: max_steps only"),
    "train.log_every": (1, None, "steps between console/metrics lines"),
    "train.keep_ckpts": (0, None, "newest checkpoints kept; 0 keeps all"),
    "train.max_nonfinite_steps": (1, None, "non-finite steps in a row before the run stops"),
    "train.max_param_norm_growth": (1.0, None, "an update growing the parameter norm by more is rejected; "
                                              "0 turns the check off"),
    "train.watchdog_factor": (1.0, None, "a step or batch wait this many times the median is a stall"),
    "train.watchdog_min_seconds": (1.0, None, "never report a stall shorter than this"),
    "train.device_memory_gib": (0.0, None, "0: the device's own limit"),
    "train.compile_threads": (0, None, "0: min(8, CPUs)"),
    "train.remat_memory_fraction": (0.0, 1.0, "the share of the device's memory model.remat=auto plans a bucket "
                                              "into; must be > 0"),
    "train.seed": (0, None, ""),
    "optim.lr": (0.0, None, "must be > 0"),
    "optim.warmup_steps": (0, None, ""),
    "optim.cooldown_steps": (0, None, ""),
    "optim.min_lr": (0.0, None, ""),
    "optim.max_lr": (0.0, None, ""),
    "optim.eps": (0.0, None, "must be > 0"),
    "optim.weight_decay": (0.0, None, ""),
    "optim.grad_clip": (0.0, None, "0: no clipping"),
    "optim.ema_decay": (0.0, 1.0, ""),
    "data.num_workers": (0, None, "0: decode in the training process"),
    "data.decode_threads": (1, None, ""),
    "data.codec_threads": (0, 64, "0: host cores ÷ (workers × read threads), clamped to 1-4"),
    "data.prefetch": (1, None, ""),
    "data.frame_interval": (1, None, ""),
    "data.batch_size_override": (0, None, "0: the bucket config's batch sizes"),
    "data.seed": (0, None, ""),
    "model.class_dropout_prob": (0.0, 1.0, ""),
    "model.remat_blocks": (-1, None, "-1: all block pairs"),
    "eval.every": (0, None, "steps between validation losses; 0: none during training"),
    "eval.num_timesteps": (1, None, "fixed timesteps of the validation loss"),
    "eval.max_batches_per_bucket": (0, None, "0: every row of the eval table"),
    "eval.seed": (0, 2**31 - 1, ""),
    "eval.decode_threads": (1, None, ""),
    "train.peak_flops": (0.0, None, "peak FLOP/s per device for MFU; 0: the device table"),
    "scheduler.scale": (0.0, None, "must be > 0"),
    "scheduler.transform_scale": (0.0, None, "must be > 0"),
    "lora.rank": (0, None, "0: LoRA off"),
    "lora.alpha": (0.0, None, "must be > 0; scale = alpha / rank"),
    "lora.dropout": (0.0, 1.0, "on the adapters' input, training only; must be < 1"),
}
# Knobs where the low end itself is meaningless (a zero learning rate, eps or scale).
_EXCLUSIVE_LOW = {"optim.lr", "optim.eps", "scheduler.scale", "scheduler.transform_scale", "lora.alpha",
                  "train.remat_memory_fraction"}
# 0 is allowed besides the range (an "off" switch).
_ZERO_MEANS_OFF = {"train.max_param_norm_growth"}


def _get(config, key):
    node = config
    for part in key.split("."):
        if part not in node:
            return None
        node = node[part]
    return node


def check_ranges(config) -> None:
    """Every numeric knob of RANGES that the config has: a number within its range."""
    for key, (low, high, note) in RANGES.items():
        value = _get(config, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if key in _ZERO_MEANS_OFF and value == 0:
            continue
        too_low = low is not None and (value <= low if key in _EXCLUSIVE_LOW else value < low)
        too_high = high is not None and value > high
        if too_low or too_high or value != value:  # value != value: NaN
            lo = "" if low is None else (f"> {low}" if key in _EXCLUSIVE_LOW else f">= {low}")
            hi = "" if high is None else f"<= {high}"
            rng = " and ".join(x for x in (lo, hi) if x)
            raise ConfigError(f"{key} = {value!r} is out of range: it must be {rng}" + (f" ({note})" if note else ""))
