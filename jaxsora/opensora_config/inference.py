"""Open-Sora 1.2 inference configs → `python -m jaxsora.sample`'s options
(`python -m jaxsora.sample configs/opensora-v1-2/inference/sample.py --ckpt-path CKPT --prompt ...`).

`INFERENCE_KEYS` is the map: every key Open-Sora 1.2's `scripts/inference.py` reads, with the sampler option it
sets (its argparse name), the VAE / text-encoder spec it makes, or — meaningless here — a note reported once.
As in Open-Sora, a flag given on the command line wins over the file (`merge_args`); a flag not given takes the
file's value; what neither gives is the sampler's default (Open-Sora's, see `jaxsora.infer.options`).
Imports no jax.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxsora.opensora_config.mapping import REQUIRED, Ctx, Row, apply_table
from jaxsora.opensora_config.reader import read_config
from jaxsora.opensora_config.train import DTYPES, OPEN_SORA_MODELS, _false_only, _fixed


@dataclasses.dataclass
class InferenceConfig:
    """An Open-Sora inference file in the sampler's terms."""
    path: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # sampler option (argparse dest) → value
    vae: dict | None = None            # a `--vae` spec (config group)
    text_encoder: dict | None = None   # a `--text-encoder` spec
    use_timestep_transform: bool = False  # RFLOW's default
    ckpt: str | None = None            # model.from_pretrained (used when the command line names no checkpoint)
    notes: list[str] = dataclasses.field(default_factory=list)
    flags: dict = dataclasses.field(default_factory=dict)  # (unused here; the train map's handlers may set it)

    def set(self, key: str, value, source: str) -> None:
        group, _, name = key.partition(".")
        if group == "args":
            self.args[name] = value
        elif group in ("vae", "text_encoder"):
            spec = getattr(self, group) or {}
            spec[name] = value
            setattr(self, group, spec)
        elif key == "scheduler.use_timestep_transform":
            self.use_timestep_transform = bool(value)
        elif key == "ckpt":
            self.ckpt = value
        else:  # pragma: no cover - a row of the map below with a target this class does not know
            raise KeyError(key)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _arg(dest, convert=None):
    """The sampler option `dest` (when the file sets the key)."""
    def handler(value, ctx, key, present):
        if present:
            ctx.out.set(f"args.{dest}", convert(value) if convert else value, key)
    return handler


def _list_of_str(value, ctx, key):
    items = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(v, str) for v in items):
        ctx.fail(f"{key} = {value!r}: expected a string or a list of strings")
    return items


def _strings(dest):
    def handler(value, ctx, key, present):
        if present and value is not None:
            ctx.out.set(f"args.{dest}", _list_of_str(value, ctx, key), key)
    return handler


def _image_size(value, ctx, key, present):
    if not present or value is None:
        return
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        ctx.fail(f"{key} = {value!r}: expected (height, width)")
    ctx.out.set("args.image_size", [int(v) for v in value], key)


def _num_frames(value, ctx, key, present):
    if present:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            ctx.fail(f"{key} = {value!r}: expected a frame count or a duration such as '4s'")
        ctx.out.set("args.num_frames", str(value), key)


def _save_fps(value, ctx, key, present):
    """save_fps, else Open-Sora's fps // frame_interval."""
    interval = ctx.get("frame_interval", 1)
    if present:
        ctx.out.set("args.save_fps", float(value), key)
    elif interval != 1 and ctx.get("fps") is not None:
        ctx.out.set("args.save_fps", float(ctx.get("fps") // interval), "fps // frame_interval")


def _dtype(value, ctx, key, present):
    if present:
        if value not in DTYPES:
            ctx.fail(f"{key} = {value!r}: expected bf16, fp32 or fp16")
        ctx.out.set("args.dtype", DTYPES[value], key)


def _multi_resolution(value, ctx, key, present):
    if present and value != "STDiT2":
        ctx.fail(f"{key} = {value!r}: STDiT3 is conditioned on size and fps ('STDiT2', as Open-Sora 1.2's config)")
    if present:
        ctx.out.note(f"{key} 'STDiT2': jaxsora always gives STDiT3 the height, width and fps")


def _seed(value, ctx, key, present):
    if present:
        ctx.out.set("args.seed", value, key)
        ctx.out.note(f"{key} {value}: Open-Sora draws every video's noise from torch seed 1024 whatever the seed; "
                     "jaxsora from (seed, the prompt, its repeat count), so a prompt gives the same video alone or "
                     "among others")


def _model_type(value, ctx, key, present):
    from jaxsora.models.presets import available

    if value not in OPEN_SORA_MODELS and value not in available():
        ctx.fail(f"{key} = {value!r}: jaxsora samples STDiT3 checkpoints ({', '.join(OPEN_SORA_MODELS)})")


def _model_weights(value, ctx, key, present):
    if value:  # the sampler uses it when no checkpoint is given on the command line (it must be a local one)
        ctx.out.set("ckpt", value, key)


def _vae(value, ctx, key, present):
    from jaxsora.opensora_config.train import VAE_KEYS

    apply_table(VAE_KEYS, value, ctx, prefix="vae.")
    if (ctx.out.vae or {}).get("kind") == "opensora":  # the VAE runs in the inference dtype (Open-Sora: .to(dtype))
        ctx.out.set("vae.dtype", DTYPES.get(ctx.get("dtype", "bf16"), "bfloat16"), "dtype")


def _text_encoder(value, ctx, key, present):
    from jaxsora.opensora_config.train import TEXT_KEYS

    apply_table(TEXT_KEYS, value, ctx, prefix="text_encoder.")


def _score(dest):
    def handler(value, ctx, key, present):
        if present:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                ctx.fail(f"{key} = {value!r}: expected a number or None")
            ctx.out.set(f"args.{dest}", None if value is None else float(value), key)
    return handler


def _scheduler(value, ctx, key, present):
    def scheduler_type(v, c, k, p):
        if v != "rflow":
            c.fail(f"{k} = {v!r}: jaxsora samples with rectified flow ('rflow') only")

    table = {
        "type": Row(scheduler_type, REQUIRED, "str"),
        "use_timestep_transform": Row("scheduler.use_timestep_transform", False, "bool"),
        "num_sampling_steps": Row(_arg("num_sampling_steps"), None, "int"),
        "cfg_scale": Row(_arg("cfg_scale", float), None, "number"),
        "num_timesteps": Row(_fixed(1000, "jaxsora's rectified flow runs t on Open-Sora's 0..1000 scale"), 1000, "int"),
        "use_discrete_timesteps": Row(_fixed(False, "jaxsora samples continuous timesteps"), False, "bool"),
        **{k: Row(None, None, note="training only") for k in ("sample_method", "loc", "scale", "transform_scale")},
    }
    apply_table(table, value, ctx, prefix="scheduler.")


# Open-Sora inference key → Row(sampler option / spec / handler, Open-Sora's value when absent, kind, note).
INFERENCE_KEYS: dict[str, Row] = {
    # what to sample
    "prompt": Row(_strings("prompt"), None, "any"),
    "prompt_path": Row(_arg("prompt_path"), None, "str|None"),
    "start_index": Row(_arg("start_index"), None, "int"),
    "end_index": Row(_arg("end_index"), None, "int|None"),
    "num_sample": Row(_arg("num_sample"), None, "int"),
    "aes": Row(_score("aes"), None, "any"),
    "flow": Row(_score("flow"), None, "any"),
    "camera_motion": Row(_arg("camera_motion"), None, "str|None"),
    "llm_refine": Row(_false_only("jaxsora has no GPT-4o prompt refinement (give the refined prompts)"), False, "bool"),
    "prompt_generator": Row(_false_only("jaxsora has no prompt generator (give --prompt or --prompt-path)"), None,
                            "str|None"),
    # size and length
    "resolution": Row(_arg("resolution"), None, "str|None"),
    "aspect_ratio": Row(_arg("aspect_ratio"), None, "str|None"),
    "image_size": Row(_image_size, None, "any"),
    "num_frames": Row(_num_frames, REQUIRED, "any"),
    "fps": Row(_arg("fps", float), REQUIRED, "number"),
    "save_fps": Row(_save_fps, None, "number"),
    "frame_interval": Row(None, None, "int"),  # read by save_fps's default (fps // frame_interval)
    "multi_resolution": Row(_multi_resolution, None, "str|None"),
    # sampling
    "seed": Row(_seed, None, "int"),
    "batch_size": Row(_arg("batch_size"), None, "int"),
    "dtype": Row(_dtype, None, "str"),
    "scheduler": Row(_scheduler, REQUIRED, "dict"),
    # conditioning
    "reference_path": Row(_strings("reference_path"), None, "any"),
    "mask_strategy": Row(_strings("mask_strategy"), None, "any"),
    "loop": Row(_arg("loop"), None, "int"),
    "condition_frame_length": Row(_arg("condition_frame_length"), None, "int"),
    "condition_frame_edit": Row(_arg("condition_frame_edit", float), None, "number"),
    "align": Row(_arg("align"), None, "int|None"),
    # output
    "save_dir": Row(_arg("save_dir"), REQUIRED, "str"),
    "sample_name": Row(_arg("sample_name"), None, "str|None"),
    "prompt_as_path": Row(_arg("prompt_as_path"), None, "bool"),
    "verbose": Row(_arg("verbose"), None, "int"),
    "watermark": Row(None, None, "bool", note="jaxsora writes no watermark"),
    # model and encoders
    "model": Row(lambda v, c, k, p: apply_table({
        "type": Row(_model_type, REQUIRED, "str"),
        "from_pretrained": Row(_model_weights, None, "str|None"),
        "qk_norm": Row(None, None, "bool", note="the checkpoint's model decides"),
        "enable_flash_attn": Row(None, None, "bool", note="jaxsora runs cuDNN flash attention on GPU in bf16, "
                                                          "XLA's otherwise"),
        "enable_layernorm_kernel": Row(None, None, "bool", note="XLA fuses the layer norms"),
        "force_huggingface": Row(None, None, "bool", note="jaxsora reads local checkpoints only (--ckpt-path)"),
    }, v, c, prefix="model."), REQUIRED, "dict"),
    "vae": Row(_vae, REQUIRED, "dict"),
    "text_encoder": Row(_text_encoder, REQUIRED, "dict"),
}


def read_inference(path: str) -> InferenceConfig:
    """Read the Open-Sora inference config `path` (ConfigError naming the first problem)."""
    raw = read_config(path)
    out = InferenceConfig(path=path)
    apply_table(INFERENCE_KEYS, raw, Ctx(path, raw, out))
    return out


def checkpoint_of(config: InferenceConfig) -> str:
    """The file's `model.from_pretrained` as the checkpoint to sample (BadInput unless a local path)."""
    from jaxsora.errors import BadInput

    if not config.ckpt:
        raise BadInput(f"{config.path} names no model.from_pretrained: give --ckpt-path (a jaxsora checkpoint or a "
                       "`python -m jaxsora.convert from-torch` output)")
    if not os.path.exists(config.ckpt):
        raise BadInput(f"{config.path}: model.from_pretrained {config.ckpt!r} is not a local checkpoint (jaxsora "
                       "downloads nothing): give --ckpt-path, a jaxsora checkpoint or a `python -m jaxsora.convert "
                       "from-torch` output")
    return config.ckpt
