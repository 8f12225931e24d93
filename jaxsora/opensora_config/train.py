"""Open-Sora 1.2 train configs → the jaxsora run config (`python -m jaxsora.train OPEN_SORA_FILE.py`).

`TRAIN_KEYS` is the map: every key Open-Sora 1.2's `scripts/train.py` reads (and the LambdaLabs fork's
one-cycle schedule keys) with, for each, where it goes in the jaxsora config, the value Open-Sora uses
when the file leaves it out (`cfg.get(key, default)` in train.py and the constructors' defaults), and
what the value may be. A key is either

* mapped: the jaxsora key(s) it sets (its value checked, converted where the names differ);
* meaningless here: a note saying what jaxsora does instead, reported once when the run starts
  (e.g. "plugin zero2: parameters, gradients and optimizer state are sharded over the mesh's fsdp axis");
* refused: a value jaxsora cannot run as Open-Sora would (one line, exit code 2), as is a key that is in
  no table (a misspelt `ema_decey` would silently keep a default in Open-Sora; here it stops the run).

Open-Sora's own defaults apply to a key the file leaves out (no `ema_decay`: 0.9999; no `adam_eps`: 1e-8;
no `warmup_steps`: a constant lr), so a file runs as it runs under Open-Sora. The starting point is
jaxsora's `configs/base.py` for everything Open-Sora has no key for (mesh, checkpoints kept, watchdog, ...);
`jaxsora = dict(group=dict(key=value))` in the file sets those (applied last; the command line's
`--config.group.key=value` still goes on top). Imports no jax.
"""
from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxsora.errors import ConfigError
from jaxsora.opensora_config.mapping import REQUIRED, Ctx, Row, Translation, apply_table, fmt, is_int, is_num
from jaxsora.opensora_config.reader import plain, read_config

# The model types jaxsora builds: Open-Sora's registered STDiT3 builders (and jaxsora's small presets).
OPEN_SORA_MODELS = ("STDiT3-XL/2", "STDiT3-3B/2")
# Open-Sora 1.2's dtype names (`to_torch_dtype`).
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16",
          "bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}
# Hugging Face ids have this shape; jaxsora downloads nothing and reads `pretrained_models/<name>` instead,
# the folder the Open-Sora docs (and jaxsora's configs/base.py) download them to.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")



# --------------------------------------------------------------------------------------------------------
# handlers (keys whose mapping is more than a copy)
# --------------------------------------------------------------------------------------------------------
def local_weights(value: str, what: str, ctx: Ctx) -> str:
    """A `from_pretrained`: a local file/folder as it is; a Hugging Face id (not a local path) becomes
    `pretrained_models/<name>`, with a note (jaxsora downloads nothing)."""
    if os.path.exists(value) or not _HUB_ID.match(value) or os.path.isdir(value.split("/")[0]):
        return value
    local = os.path.join("pretrained_models", value.split("/")[1])
    ctx.out.note(f"{what} {value!r} is a Hugging Face id and jaxsora downloads nothing: it reads the local folder "
                 f"{local} (huggingface-cli download {value} --local-dir {local})")
    return local


def _dtype(value, ctx, key, present):
    name = DTYPES.get(value)
    if name is None:
        ctx.fail(f"{key} = {value!r}: expected bf16 (or fp32)")
    if name == "float16":
        ctx.fail(f"{key} = 'fp16': jaxsora trains in bf16 or fp32 (no fp16 loss scaling as ColossalAI's); use bf16")
    src = f"{key} = {fmt(value)}" if present else f"{key} absent: Open-Sora's 'bf16'"
    for target in ("model.compute_dtype", "vae.dtype", "text_encoder.dtype", "text_encoder.param_dtype"):
        ctx.out.set(target, name, src)
    if name == "float32":
        ctx.out.note(f"{key} 'fp32': Open-Sora's train.py takes bf16 or fp16 only; jaxsora computes in float32")


def _remat(value, ctx, key, present):
    """Open-Sora checkpoints every block to fit the device: jaxsora's "auto" picks, per bucket, the cheapest remat
    that fits (full where only full does; the numbers are the same with any remat)."""
    ctx.out.set("model.remat", "auto" if value else "none",
                f"{key} = {value}" if present else f"{key} absent: Open-Sora's False")
    if present and value:
        ctx.out.note(f"{key} True: model.remat 'auto': per bucket the cheapest remat whose step fits the device's "
                     "memory (full where only full fits; --config.model.remat=full for Open-Sora's every block)")


def _plugin(value, ctx, key, present):
    sp = ctx.get("sp_size", 1)
    if value == "zero2":
        if sp != 1:
            ctx.fail(f"plugin 'zero2' with sp_size {sp}: Open-Sora's zero2 plugin has no sequence parallelism "
                     "(use plugin = 'zero2-seq')")
        if present:
            ctx.out.note("plugin 'zero2': parameters, gradients and optimizer state are sharded over the mesh's fsdp "
                         "axis (mesh.fsdp = -1: every device), as ZeRO-2 shards them over the ranks")
    elif value == "zero2-seq":
        if not (is_int(sp) and sp > 1):
            ctx.fail("plugin 'zero2-seq' needs sp_size > 1 (as Open-Sora's)")
        ctx.out.note(f"plugin 'zero2-seq': the mesh's sequence axis has sp_size = {sp} devices (Ulysses attention); "
                     "parameters and optimizer state are sharded over its fsdp axis")
    else:
        ctx.fail(f"plugin = {value!r}: Open-Sora 1.2 has 'zero2' and 'zero2-seq'")


def _sp_size(value, ctx, key, present):
    if value < 1:
        ctx.fail(f"{key} = {value}: must be ≥ 1")
    if value != 1 or present:
        ctx.out.set("mesh.sequence", value, f"{key} = {value}")


def _ckpt_every(value, ctx, key, present):
    if value < 0:
        ctx.fail(f"{key} = {value}: must be ≥ 0")
    if value == 0:
        ctx.out.note(f"{key} {value if present else 'absent'}: Open-Sora then saves no checkpoint during the run; "
                     "jaxsora saves every train.ckpt_every = 200 steps and at the end "
                     "(--config.train.ckpt_every=N)")
        return
    ctx.out.set("train.ckpt_every", value, f"{key} = {value}")


def _epochs(value, ctx, key, present):
    if value < 1:
        ctx.fail(f"{key} = {value}: must be ≥ 1")
    ctx.out.set("train.epochs", value, f"{key} = {value}" if present else f"{key} absent: Open-Sora's 1000")
    ctx.out.note(f"{key} {value}: the run stops after {value} epochs or train.max_steps steps, whichever comes first "
                 "(Open-Sora has no step cap; --config.train.max_steps=N)")


def _wandb(value, ctx, key, present):
    ctx.out.set("wandb.enabled", value, f"{key} = {value}" if present else f"{key} absent: Open-Sora's False")
    if value:
        ctx.out.note("wandb True: logs to the wandb project 'jaxsora' (Open-Sora's train.py names it 'Open-Sora', "
                     "the LambdaLabs fork 'sora_speedrun'; --config.wandb.project=NAME), the run named after its "
                     "folder")


def _flag(name):
    def handler(value, ctx, key, present):
        if value not in (None, False):
            ctx.out.flags[name] = value
    return handler


def _prefetch(value, ctx, key, present):
    value = 2 if value is None else value  # torch DataLoader's prefetch_factor default
    if value < 1:
        ctx.fail(f"{key} = {value}: must be ≥ 1")
    ctx.out.set("data.prefetch", value, f"{key} = {value}" if present else f"{key} absent: torch's 2")


def _mask_ratios(value, ctx, key, present):
    # The ratios themselves (types, sum) are checked with the run config (validate_config: MaskGenerator).
    if value and not all(isinstance(k, str) and is_num(v) for k, v in value.items()):
        ctx.fail(f"{key} = {value!r}: expected {{mask type: probability}}")
    ctx.out.set("mask_ratios", dict(value or {}),
                f"{key} (the file's)" if present else f"{key} absent: Open-Sora passes no frame mask")


def _bucket_config(value, ctx, key, present):
    if value is None:
        if ctx.get("dataset.type") == "BatchFeatureDataset":
            ctx.out.note("bucket_config absent: Open-Sora's BatchFeatureDataset holds ready-made batches; jaxsora's "
                         "feature cache is batched by data.bucket_config (configs/base.py's stage-1 table)")
            return
        ctx.fail(f"{key} is not set: jaxsora trains from buckets (bucket_config = {{res: {{frames: (keep_prob, "
                 "batch)}}})")
    ctx.out.set("data.bucket_config", {str(r): {int(f): tuple(v) for f, v in fr.items()} for r, fr in value.items()},
                f"{key} (the file's table)")


def _schedule(value, ctx, key, present):
    """warmup_steps with the LambdaLabs fork's lr_schedule / min_lr / max_lr / cooldown_steps / anneal_strategy:
    no warmup_steps → no scheduler (constant lr, also with lr_schedule set); lr_schedule '1cycle' → the fork's
    OneCycleScheduler (min → max over warmup, max → lr over cooldown, then lr); otherwise LinearWarmupLR."""
    warmup = ctx.get("warmup_steps")
    kind = ctx.get("lr_schedule")
    if warmup is not None and (not is_int(warmup) or warmup < 0):
        ctx.fail(f"warmup_steps = {warmup!r}: expected an integer ≥ 0 or None")
    if kind is not None and kind != "1cycle":
        ctx.fail(f"lr_schedule = {kind!r}: the LambdaLabs fork knows only '1cycle' (without lr_schedule: "
                 "LinearWarmupLR over warmup_steps)")
    one_cycle = ("min_lr", "max_lr", "cooldown_steps", "anneal_strategy")
    if warmup is None:
        ctx.out.set("optim.lr_schedule", "constant", "warmup_steps absent: no lr scheduler")
        ctx.out.set("optim.warmup_steps", 0, "warmup_steps absent: no lr scheduler")
        if kind is not None:
            ctx.out.note("lr_schedule '1cycle' without warmup_steps: the LambdaLabs fork then builds no lr scheduler; "
                         "the lr is constant")
    elif kind == "1cycle":
        missing = [k for k in one_cycle if ctx.get(k) is None]
        if missing:
            ctx.fail(f"lr_schedule '1cycle' needs {', '.join(missing)} (the LambdaLabs fork reads them)")
        ctx.out.set("optim.lr_schedule", "1cycle", "lr_schedule = '1cycle'")
        ctx.out.set("optim.warmup_steps", warmup, f"warmup_steps = {warmup}")
    else:
        ctx.out.set("optim.lr_schedule", "linear_warmup", f"warmup_steps = {warmup}: LinearWarmupLR")
        ctx.out.set("optim.warmup_steps", warmup, f"warmup_steps = {warmup}")
    for k in one_cycle:
        v = ctx.get(k)
        if v is None:
            continue
        if k == "anneal_strategy":
            if v not in ("cos", "linear"):
                ctx.fail(f"anneal_strategy = {v!r}: expected 'cos' or 'linear'")
        elif not is_num(v) or v < 0 or (k == "cooldown_steps" and not is_int(v)):
            ctx.fail(f"{k} = {v!r}: expected a{'n integer' if k == 'cooldown_steps' else ' number'} ≥ 0")
        ctx.out.set(f"optim.{k}", float(v) if k in ("min_lr", "max_lr") else v, f"{k} = {fmt(v)}")
        if kind != "1cycle" or warmup is None:
            ctx.out.note(f"{k} {fmt(v)}: read only with lr_schedule = '1cycle' and warmup_steps (unused here too)")


def _number(target):
    def handler(value, ctx, key, present):
        if value < 0:
            ctx.fail(f"{key} = {value}: must be ≥ 0")
        ctx.out.set(target, float(value), f"{key} = {fmt(value)}" if present else f"{key} absent: Open-Sora's {value}")
    return handler


# ---- dataset ----
def _dataset_type(value, ctx, key, present):
    if value == "VariableVideoTextDataset":
        if ctx.get("dataset.transform_name") != "resize_crop":
            ctx.fail(f"dataset.transform_name = {ctx.get('dataset.transform_name')!r}: jaxsora's loader resizes "
                     "and centre-crops each clip to its bucket (Open-Sora's 'resize_crop'); set it to 'resize_crop'")
    elif value == "BatchFeatureDataset":
        ctx.out.data_path_key = "data.features"
        ctx.out.note("dataset BatchFeatureDataset: jaxsora trains from its own feature cache (python -m "
                     "data_tools.precompute --latents), not Open-Sora's extracted .bin files; --data-path names "
                     "that folder (data.features)")
    elif value == "VideoTextDataset":
        ctx.fail("dataset.type 'VideoTextDataset' (one fixed size): jaxsora trains from buckets; use "
                 "VariableVideoTextDataset with bucket_config = {res: {frames: (1.0, batch)}}")
    else:
        ctx.fail(f"dataset.type = {value!r}: jaxsora reads VariableVideoTextDataset (a video table) or "
                 "BatchFeatureDataset (a feature cache)")


def _data_path(value, ctx, key, present):
    if value:
        target = "data.features" if ctx.get("dataset.type") == "BatchFeatureDataset" else "data.table"
        ctx.out.set(target, value, f"{key} = {value!r}")


def _transform(value, ctx, key, present):
    if present and value != "resize_crop":
        ctx.fail(f"{key} = {value!r}: jaxsora's loader resizes and centre-crops (Open-Sora's 'resize_crop')")


def _false_only(what):
    def handler(value, ctx, key, present):
        if value:
            ctx.fail(f"{key} = {value!r}: {what}")
    return handler


DATASET_KEYS = {
    "type": Row(_dataset_type, REQUIRED, "str"),
    "data_path": Row(_data_path, None, "str|None"),
    "frame_interval": Row("data.frame_interval", 1, "int"),
    "transform_name": Row(_transform, None, "str|None"),
    "num_frames": Row(None, None, note="the bucket_config decides each clip's frames (Open-Sora's variable dataset "
                                       "ignores it too)"),
    "image_size": Row(None, None, note="the bucket_config decides each clip's size (Open-Sora's variable dataset "
                                       "ignores it too)"),
    "dummy_text_feature": Row(_false_only("jaxsora encodes the captions (or reads them from a feature cache)"),
                              False, "bool"),
}


# ---- model ----
def _model_type(value, ctx, key, present):
    from jaxsora.models.presets import available

    if value not in OPEN_SORA_MODELS and value not in available():
        ctx.fail(f"{key} = {value!r}: jaxsora builds STDiT3 ({', '.join(OPEN_SORA_MODELS)}; its own presets: "
                 f"{', '.join(p for p in available() if p not in OPEN_SORA_MODELS)})")
    ctx.out.set("model.name", value, f"{key} = {value!r}")


def _model_field(name, default, kind_check=None):
    """An STDiT3Config field: set when it differs from jaxsora's default (configs/base.py has no key for it)."""
    def handler(value, ctx, key, present):
        if present and value != default:
            ctx.out.set(f"model.{name}", float(value) if isinstance(default, float) else value, f"{key} = {value!r}")
    return handler


def _drop_path(value, ctx, key, present):
    if value != 0:
        ctx.fail(f"{key} = {value!r}: jaxsora's STDiT3 has no drop path (every Open-Sora 1.2 config uses 0.0)")


def _shape_from(what):
    def handler(value, ctx, key, present):
        if present:
            ctx.fail(f"{key}: {what}")
    return handler


def _skip_y(value, ctx, key, present):
    if not value:
        return
    if ctx.get("dataset.type") != "BatchFeatureDataset":
        ctx.fail(f"{key} = True needs pre-extracted text features (dataset BatchFeatureDataset)")
    ctx.out.note(f"{key} True: jaxsora's feature cache holds the T5 states; the (frozen) y_embedder and the caption "
                 "dropout run in the step")


MODEL_KEYS = {
    "type": Row(_model_type, REQUIRED, "str"),
    "from_pretrained": Row(_flag("ckpt_path"), None, "str|None"),
    "qk_norm": Row(_model_field("qk_norm", True), True, "bool"),
    "freeze_y_embedder": Row("model.freeze_y_embedder", False, "bool"),
    "class_dropout_prob": Row("model.class_dropout_prob", 0.1, "number", convert=float),
    "input_sq_size": Row("model.input_sq_size", 512, "int"),
    "mlp_ratio": Row(_model_field("mlp_ratio", 4.0), 4.0, "number"),
    "pred_sigma": Row(_model_field("pred_sigma", True), True, "bool"),
    "drop_path": Row(_drop_path, 0.0, "number"),
    "only_train_temporal": Row(_false_only("jaxsora trains every block (LoRA: the lora group)"), False, "bool"),
    "skip_y_embedder": Row(_skip_y, False, "bool"),
    "enable_flash_attn": Row(None, None, "bool", note="jaxsora's model.attention_impl 'auto' runs cuDNN flash "
                                                      "attention on GPU in bf16, XLA's otherwise"),
    "enable_layernorm_kernel": Row(None, None, "bool", note="XLA fuses the layer norms (the same math as apex's "
                                                            "kernel)"),
    "force_huggingface": Row(None, None, "bool", note="jaxsora reads local weights only (--ckpt-path)"),
    # Set by the type (Open-Sora's builder passes them: a second value is a TypeError there) or by train.py.
    "depth": Row(_shape_from("set by the model type (jaxsora: jaxsora = dict(model=dict(depth=N)))"), None),
    "hidden_size": Row(_shape_from("set by the model type (jaxsora: jaxsora = dict(model=dict(hidden_size=N)))"),
                       None),
    "num_heads": Row(_shape_from("set by the model type (jaxsora: jaxsora = dict(model=dict(num_heads=N)))"), None),
    "patch_size": Row(_shape_from("set by the model type"), None),
    "in_channels": Row(_shape_from("set by train.py from the VAE"), None),
    "caption_channels": Row(_shape_from("set by train.py from the text encoder"), None),
    "model_max_length": Row(_shape_from("set by train.py from the text encoder (text_encoder.model_max_length)"),
                            None),
    "input_size": Row(_shape_from("set by train.py from the VAE's latent size"), None),
    "enable_sequence_parallelism": Row(_shape_from("set by train.py from sp_size"), None),
}


# ---- VAE / text encoder ----
def _vae_type(value, ctx, key, present):
    if value == "OpenSoraVAE_V1_2":
        ctx.out.set("vae.kind", "opensora", f"{key} = {value!r}")
    elif value == "identity":  # jaxsora's pixel-space "VAE" (the CPU demo)
        ctx.out.set("vae.kind", "identity", f"{key} = 'identity' (jaxsora's pixel space)")
    else:
        ctx.fail(f"{key} = {value!r}: jaxsora has OpenSoraVAE_V1_2 (and 'identity', pixel space)")


def _vae_path(value, ctx, key, present):
    if value:
        ctx.out.set("vae.path", local_weights(value, key, ctx), f"{key} = {value!r}")


def _micro_frame(value, ctx, key, present):
    if value != 17:  # the OpenSora VAE v1.2's temporal chunk (its `micro_frame_size`); the latents depend on it
        ctx.fail(f"{key} = {value!r}: jaxsora's OpenSora VAE encodes 17-frame chunks (the latents depend on it)")


def _micro_batch(value, ctx, key, present):
    if value != 4:
        ctx.out.note(f"{key} {value}: jaxsora's VAE decodes 4 frames per spatial call (memory only: the latents do "
                     "not depend on it)")


VAE_KEYS = {
    "type": Row(_vae_type, REQUIRED, "str"),
    "from_pretrained": Row(_vae_path, None, "str|None"),
    "micro_frame_size": Row(_micro_frame, 17, "int"),
    "micro_batch_size": Row(_micro_batch, 4, "int"),
    "local_files_only": Row(None, None, "bool", note="jaxsora reads local folders only; it downloads nothing"),
    "force_huggingface": Row(None, None, "bool", note="jaxsora reads the weights from a local folder"),
    "freeze_vae_2d": Row(_false_only("VAE training is not part of jaxsora"), False, "bool"),
    "cal_loss": Row(_false_only("VAE training is not part of jaxsora"), False, "bool"),
    # jaxsora's identity kind
    "downsample": Row(lambda v, c, k, p: p and c.out.set("vae.downsample", tuple(v), f"{k} = {v!r}"), None),
    "scale": Row(lambda v, c, k, p: p and c.out.set("vae.scale", v, f"{k} = {v!r}"), None),
}


def _text_type(value, ctx, key, present):
    if value == "t5":
        ctx.out.set("text_encoder.kind", "t5", f"{key} = 't5'")
    elif value == "tiny":  # jaxsora's random byte-level encoder (the CPU demo)
        ctx.out.set("text_encoder.kind", "tiny", f"{key} = 'tiny' (jaxsora's random byte-level encoder)")
    else:
        ctx.fail(f"{key} = {value!r}: jaxsora has the T5 encoder ('t5'; and 'tiny', random, for tests)")


def _text_path(value, ctx, key, present):
    if value:
        ctx.out.set("text_encoder.path", local_weights(value, key, ctx), f"{key} = {value!r}")


def _tiny(name):
    return Row(lambda v, c, k, p: p and c.out.set(f"text_encoder.{name}", v, f"{k} = {v!r}"), None, "int")


TEXT_KEYS = {
    "type": Row(_text_type, REQUIRED, "str"),
    "from_pretrained": Row(_text_path, None, "str|None"),
    "model_max_length": Row("text_encoder.model_max_length", 120, "int"),  # Open-Sora's T5Encoder default: 120
    "shardformer": Row(None, None, "bool", note="ColossalAI's T5 kernels; XLA compiles the encoder into the step "
                                                "(the same math)"),
    "local_files_only": Row(None, None, "bool", note="jaxsora reads local folders only; it downloads nothing"),
    "cache_dir": Row(None, None, "str|None", note="jaxsora reads text_encoder.from_pretrained as a local folder"),
    # jaxsora's tiny kind
    **{k: _tiny(k) for k in ("d_model", "num_layers", "num_heads", "d_ff", "d_kv", "seed")},
}


# ---- scheduler ----
def _scheduler_type(value, ctx, key, present):
    if value != "rflow":
        ctx.fail(f"{key} = {value!r}: jaxsora trains with rectified flow ('rflow') only")


def _fixed(expected, what):
    def handler(value, ctx, key, present):
        if value != expected:
            ctx.fail(f"{key} = {value!r}: {what}")
    return handler


def _sample_method(value, ctx, key, present):
    if value not in ("uniform", "logit-normal"):
        ctx.fail(f"{key} = {value!r}: expected 'uniform' or 'logit-normal'")
    ctx.out.set("scheduler.sample_method", value, f"{key} = {value!r}" if present else f"{key} absent: Open-Sora's "
                                                                                      "'uniform'")


SCHEDULER_KEYS = {
    "type": Row(_scheduler_type, REQUIRED, "str"),
    "use_timestep_transform": Row("scheduler.use_timestep_transform", False, "bool"),
    "sample_method": Row(_sample_method, "uniform", "str"),
    "loc": Row("scheduler.loc", 0.0, "number", convert=float),
    "scale": Row("scheduler.scale", 1.0, "number", convert=float),
    "transform_scale": Row("scheduler.transform_scale", 1.0, "number", convert=float),
    "num_timesteps": Row(_fixed(1000, "jaxsora's rectified flow runs t on Open-Sora's 0..1000 scale"), 1000, "int"),
    "use_discrete_timesteps": Row(_fixed(False, "jaxsora samples continuous timesteps (every 1.2 config does)"),
                                  False, "bool"),
    "num_sampling_steps": Row(None, None, "int", note="sampling only: python -m jaxsora.sample --num-sampling-steps"),
    "cfg_scale": Row(None, None, "number", note="sampling only: python -m jaxsora.sample --cfg-scale (the run's "
                                                "sample.cfg_scale)"),
}


def _group(table, name):
    def handler(value, ctx, key, present):
        if value is None:
            value = {}
        apply_table(table, value, ctx, prefix=f"{name}.")
    return handler


def _optional_group(table, name, absent_note):
    def handler(value, ctx, key, present):
        if value is None:
            if ctx.get("dataset.type") != "BatchFeatureDataset":
                ctx.fail(f"{name} is not set (Open-Sora's train.py needs it to encode the videos and captions)")
            ctx.out.note(absent_note)
            return
        apply_table(table, value, ctx, prefix=f"{name}.")
    return handler


# --------------------------------------------------------------------------------------------------------
# the map
# --------------------------------------------------------------------------------------------------------
# Open-Sora key → Row(jaxsora key(s) or handler, Open-Sora's value when absent, accepted kind, note).
# Order matters only for the translated file's layout.
TRAIN_KEYS: dict[str, Row] = {
    # data
    "dataset": Row(_group(DATASET_KEYS, "dataset"), REQUIRED, "dict"),
    "bucket_config": Row(_bucket_config, None, "dict|None"),
    "num_workers": Row("data.num_workers", 4, "int"),
    "prefetch_factor": Row(_prefetch, None, "int|None"),
    "num_bucket_build_workers": Row(None, None, "int", note="jaxsora assigns buckets with vectorised numpy in "
                                                            "the train process (the table index is reused)"),
    "batch_size": Row(None, None, "int|None", note="the bucket_config's per-bucket batch sizes apply (Open-Sora's "
                                                   "bucket sampler ignores it too); data.batch_size_override sets "
                                                   "every bucket's"),
    # model and encoders
    "model": Row(_group(MODEL_KEYS, "model"), REQUIRED, "dict"),
    "vae": Row(_optional_group(VAE_KEYS, "vae", "vae absent: the feature cache holds the latents; jaxsora keeps "
                                                "configs/base.py's VAE settings (checked against the cache's record)"),
               None, "dict|None"),
    "text_encoder": Row(_optional_group(TEXT_KEYS, "text_encoder",
                                        "text_encoder absent: the feature cache holds the text states; jaxsora "
                                        "keeps configs/base.py's T5 settings (checked against the cache's record)"),
                        None, "dict|None"),
    "scheduler": Row(_group(SCHEDULER_KEYS, "scheduler"), REQUIRED, "dict"),
    "mask_ratios": Row(_mask_ratios, None, "dict|None"),
    "grad_checkpoint": Row(_remat, False, "bool"),
    "dtype": Row(_dtype, "bf16", "str"),
    # parallelism
    "plugin": Row(_plugin, "zero2", "str"),
    "sp_size": Row(_sp_size, 1, "int"),
    "reduce_bucket_size_in_m": Row(None, None, "int", note="XLA schedules the gradient reduce-scatter itself"),
    # optimization
    "lr": Row(_number("optim.lr"), 1e-4, "number"),
    "weight_decay": Row(_number("optim.weight_decay"), 0.0, "number"),
    "adam_eps": Row(_number("optim.eps"), 1e-8, "number"),
    "grad_clip": Row(_number("optim.grad_clip"), 0.0, "number"),
    "ema_decay": Row(_number("optim.ema_decay"), 0.9999, "number"),
    "warmup_steps": Row(_schedule, None, "int|None"),
    "lr_schedule": Row(None, None, "str|None"),       # with warmup_steps (LambdaLabs fork)
    "min_lr": Row(None, None, "number"),               # "
    "max_lr": Row(None, None, "number"),               # "
    "cooldown_steps": Row(None, None, "int"),          # "
    "anneal_strategy": Row(None, None, "str"),         # "
    # the run
    "seed": Row(("train.seed", "data.seed"), 1024, "int"),
    "outputs": Row("train.outputs", None, "str"),
    "epochs": Row(_epochs, 1000, "int"),
    "log_every": Row("train.log_every", 1, "int"),
    "ckpt_every": Row(_ckpt_every, 0, "int"),
    "wandb": Row(_wandb, False, "bool"),
    "load": Row(_flag("load"), None, "str|None"),
    "start_from_scratch": Row(_flag("start_from_scratch"), False, "bool"),
    "record_time": Row(None, None, "bool", note="jaxsora logs each step's time per bucket (time/<bucket>) always"),
    # feature training (stage1_feat.py): what the features are, read from the feature cache here
    "load_video_features": Row(None, None, "bool", note="a data.features run reads the latents from the cache"),
    "load_text_features": Row(None, None, "bool", note="a data.features run reads the text states from the cache"),
    "vae_out_channels": Row(None, None, "int", note="the latent channels come from the feature cache's VAE"),
    "text_encoder_output_dim": Row(None, None, "int", note="the text width comes from the feature cache's encoder"),
    "text_encoder_model_max_length": Row(None, None, "int", note="the token count comes from the feature cache's "
                                                                 "encoder"),
    "model_max_length": Row(None, None, "int", note="not read by Open-Sora's train.py (it reads "
                                                    "text_encoder.model_max_length)"),
}
# The block of jaxsora-only settings: jaxsora = dict(group=dict(key=value)).
JAXSORA_BLOCK = "jaxsora"


def _jaxsora_block(block, ctx: Ctx, base) -> None:
    from jaxsora.infer.options import SampleSettings
    from jaxsora.models.config import STDiT3Config

    if not isinstance(block, Mapping):
        ctx.fail(f"{JAXSORA_BLOCK} = {block!r}: expected dict(group=dict(key=value))")
    for group, values in block.items():
        if group not in base or not hasattr(base[group], "keys"):
            ctx.fail(f"{JAXSORA_BLOCK}: jaxsora's config has no group {group!r} (groups: {', '.join(base.keys())})")
        if not isinstance(values, Mapping):
            ctx.fail(f"{JAXSORA_BLOCK}[{group!r}] = {values!r}: expected dict(key=value)")
        for key, value in values.items():
            known = key in base[group] or (group == "model" and key in STDiT3Config.__dataclass_fields__) or (
                group == "sample" and key in SampleSettings.__dataclass_fields__)
            if not known:
                near = difflib.get_close_matches(str(key), list(base[group].keys()), n=1)
                ctx.fail(f"{JAXSORA_BLOCK}: unknown jaxsora config key {group}.{key}"
                         + (f" (did you mean {group}.{near[0]}?)" if near else ""))
            ctx.out.set(f"{group}.{key}", plain(value), f"{JAXSORA_BLOCK}: {group}.{key}")


def _str2bool(text: str) -> bool:
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError("expected true or false")


# Open-Sora 1.2's training flags (`opensora/utils/config_utils.py`, parse_args(training=True)) that jaxsora.train
# has no flag of its own for: flag → (the config key it sets, as Open-Sora's merge_args sets it; its value's type).
# --ckpt-path, --data-path, --outputs, --load and --start-from-scratch are jaxsora.train's own flags.
OPEN_SORA_TRAIN_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--lr": ("lr", float),
    "--warmup-steps": ("warmup_steps", int),
    "--batch-size": ("batch_size", int),
    "--seed": ("seed", int),
    "--dtype": ("dtype", str),
    "--wandb": ("wandb", _str2bool),  # Open-Sora's type=bool takes any text as True; here false/0/no is False
    "--flash-attn": ("model.enable_flash_attn", _str2bool),
    "--layernorm-kernel": ("model.enable_layernorm_kernel", _str2bool),
    "--record-time": ("record_time", None),  # store_true
}


def split_opensora_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(argv less Open-Sora's training flags, {config key: value} of those given), as Open-Sora's merge_args
    puts them into the file's config; a bad value is a ConfigError naming the flag."""
    rest, values, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, text = arg.partition("=")
        if name not in OPEN_SORA_TRAIN_FLAGS:
            rest.append(arg)
            i += 1
            continue
        key, kind = OPEN_SORA_TRAIN_FLAGS[name]
        if kind is None:
            if eq:
                raise ConfigError(f"{name} takes no value")
            values[key] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} needs a value")
            text, i = argv[i + 1], i + 1
        try:
            values[key] = kind(text)
        except ValueError as e:
            raise ConfigError(f"{name} {text}: {e}") from None
        i += 1
    return rest, values


def translate_train(path: str, flags: Mapping[str, Any] | None = None) -> Translation:
    """Read the Open-Sora train config `path` into a `Translation` (ConfigError naming the first problem).
    `flags`: Open-Sora's training flags given on the command line (`split_opensora_flags`), set into the file's
    config first, as Open-Sora's merge_args does."""
    raw = read_config(path)
    for key, value in (flags or {}).items():
        node, *parents = raw, *key.split(".")[:-1]
        for p in parents:
            node = node.setdefault(p, {})
        node[key.split(".")[-1]] = value
    out = Translation(path=path)
    ctx = Ctx(path, raw, out)
    out.set("train.experiment", os.path.splitext(os.path.basename(path))[0], "the file's name")
    block = raw.pop(JAXSORA_BLOCK, None)
    apply_table(TRAIN_KEYS, raw, ctx)
    c = out.config()
    if block is not None:
        _jaxsora_block(block, ctx, c)
        c = out.config()
    from jaxsora.data.buckets import validate_bucket_config

    try:
        extra = plain(c.data.resolutions) or None
        validate_bucket_config(plain(c.data.bucket_config), extra)
    except ValueError as e:
        ctx.fail(f"bucket_config: {e}")
    return out
