"""Loading a checkpoint for sampling: the step folder, its run config, the VAE and text encoder
it names (or that `--vae` / `--text-encoder` name), and the model's weights.

Weights only: the params (or the EMA) and the frozen variables — the checkpoint's `params/` (or
`ema/`) and `frozen/` items, or those arrays of an older checkpoint's single `state/` item — are
restored with orbax partial restore straight into their shards (`convert.sharded`) and checked
against its integrity.json; the optimizer state is never read (a copy without `opt_state/` works).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping

import jax
from flax import nnx

from jaxsora.errors import BadInput, MissingFile, WeightsError

CONVERTED_HINT = "pass --vae PATH|identity and --text-encoder PATH|tiny"


class PipelineError(BadInput):
    """A checkpoint / VAE / text encoder combination that cannot sample."""


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def find_step_dir(ckpt: str, step: int | None = None) -> str:
    """A step folder (with weights: `params/`/`ema/`, or the older `state/`) from a run folder, its
    `checkpoints/`, one step folder, or a converter output. Without `step`: the newest step whose
    save finished (a new-format step without integrity.json is skipped with a note on stderr)."""
    from jaxsora.checkpoint import INTEGRITY_FILE, checkpoint_steps, has_weights, resolve_checkpoint

    root, chosen = resolve_checkpoint(ckpt, step)
    steps = [chosen] if chosen is not None else list(reversed(checkpoint_steps(root)))
    for s in steps:
        d = os.path.join(root, str(s))
        if not has_weights(d):
            if chosen is not None:
                raise MissingFile(f"{d} holds no weights: no params/ or state/ folder (not a jaxsora checkpoint)")
            continue
        if not os.path.exists(os.path.join(d, INTEGRITY_FILE)) and _checkpoint_format(d) is not None:
            if chosen is not None:
                raise PipelineError(f"{d}: the save did not finish (no {INTEGRITY_FILE})")
            print(f"[jaxsora.sample] skipping step {s}: the save did not finish (no {INTEGRITY_FILE})",
                  file=sys.stderr, flush=True)
            continue
        return d
    raise MissingFile(f"{root} holds no usable checkpoint (no <step>/params or <step>/state folder)")


def _checkpoint_format(step_dir: str):
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            return json.load(f).get("checkpoint_format")
    except (OSError, ValueError, AttributeError):
        return None


def _read_config(step_dir: str) -> dict:
    from jaxsora.convert import native

    cfg = native.read_config(step_dir)
    return cfg.get("config", cfg) if isinstance(cfg, dict) and "model" not in cfg else cfg


def read_run_config(step_dir: str) -> dict | None:
    """The run config stored with a checkpoint, or None for a converter output (model only)."""
    stored = _read_config(step_dir)
    return stored if isinstance(stored, dict) and ("vae" in stored or "text_encoder" in stored) else None


def model_config(stored_model: Mapping, dtype: str | None = None):
    """The STDiT3Config of a checkpoint's `model` entry, for sampling: no remat; `dtype` the compute
    dtype (default the checkpoint's; "bfloat16"/"float32"; "bf16"/"fp32" accepted)."""
    from jaxsora.models.stdit3 import STDiT3Config

    fields = STDiT3Config.__dataclass_fields__
    mcfg = STDiT3Config(**{k: v for k, v in stored_model.items() if k in fields})
    mcfg = dataclasses.replace(mcfg, remat="none")
    if dtype is not None:
        dt = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
        if dt not in ("bfloat16", "float32", "float16"):
            raise BadInput(f"--dtype must be bf16, fp32 or fp16, got {dtype!r}")
        mcfg = dataclasses.replace(mcfg, compute_dtype=dt)
    return mcfg


# --------------------------------------------------------------------------------------------
# component specs: --vae PATH|identity[:t,h,w]|JSON, --text-encoder PATH|tiny|JSON
# --------------------------------------------------------------------------------------------
def _json_spec(spec: str, flag: str) -> dict:
    try:
        d = json.loads(spec)
    except ValueError as e:
        raise BadInput(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or "kind" not in d:
        raise BadInput(f"{flag}: a JSON spec must be an object with a 'kind'")
    return d


def _given_spec(spec: None | str | Mapping, own: dict, what: str, flag: str) -> dict | None:
    """The config group when `spec` gives one outright: None = the run config's (`own`), a
    mapping, a JSON object; None when `spec` is a string for the caller to read."""
    if spec is None:
        if not own:
            raise PipelineError(f"the checkpoint has no run config naming {what} (converted from PyTorch?): "
                                f"{CONVERTED_HINT}")
        return own
    if isinstance(spec, Mapping):
        return dict(spec)
    if str(spec).startswith("{"):
        return _json_spec(str(spec), flag)
    return None


def vae_spec(spec: None | str | Mapping, run_cfg: Mapping | None) -> dict:
    """The VAE config group: None = the run config's; "identity" = pixel space (the run config's
    identity settings when it has them, else no down-sampling), "identity:1,2,2" = with that
    down-sampling; a JSON object = a config group (`{"kind": "opensora", "path": ..., "config":
    "tiny"}` picks a VAE architecture preset); anything else = the OpenSora VAE v1.2 weights path."""
    own = dict(run_cfg.get("vae") or {}) if run_cfg else {}
    given = _given_spec(spec, own, "a VAE", "--vae")
    if given is not None:
        return given
    spec = str(spec)
    if spec == "identity" or spec.startswith("identity:"):
        if spec == "identity":
            return own if own.get("kind") == "identity" else {"kind": "identity", "downsample": [1, 1, 1]}
        try:
            ds = [int(v) for v in spec.split(":", 1)[1].split(",")]
        except ValueError:
            ds = []
        if len(ds) != 3 or min(ds) < 1:
            raise BadInput(f"--vae {spec!r}: expected identity:T,H,W (down-sampling factors, e.g. identity:1,2,2)")
        return {"kind": "identity", "downsample": ds}
    if not os.path.exists(spec):
        raise MissingFile(f"--vae: no such file or folder {spec!r} (give the OpenSora VAE weights, identity or JSON)")
    return {"kind": "opensora", "path": spec, "dtype": own.get("dtype", "bfloat16") if own else "bfloat16"}


def text_encoder_spec(spec: None | str | Mapping, run_cfg: Mapping | None, model_cfg) -> dict:
    """The text-encoder config group: None = the run config's; "tiny" = the random byte-level
    encoder (the run config's when it has one, else sized to the model: d_model = its
    caption_channels, model_max_length = its token count); JSON = a config group; anything else =
    a Hugging Face T5 folder."""
    own = dict(run_cfg.get("text_encoder") or {}) if run_cfg else {}
    given = _given_spec(spec, own, "a text encoder", "--text-encoder")
    if given is not None:
        return given
    spec = str(spec)
    if spec == "tiny":
        if own.get("kind") == "tiny":
            return own
        return {"kind": "tiny", "d_model": int(model_cfg.caption_channels), "num_heads": 2, "num_layers": 2,
                "d_ff": 2 * int(model_cfg.caption_channels), "model_max_length": int(model_cfg.model_max_length),
                "seed": 0}
    if not os.path.isdir(spec):
        raise MissingFile(f"--text-encoder: no such folder {spec!r} (give a T5 folder, tiny or JSON)")
    return {"kind": "t5", "path": spec, "model_max_length": int(model_cfg.model_max_length)}


# --------------------------------------------------------------------------------------------
# components
# --------------------------------------------------------------------------------------------
def build_vae(cfg: Mapping):
    """IdentityVAE or OpenSoraVAE from a config group; `config` (a preset name) picks the
    OpenSora VAE architecture (default the real one)."""
    from jaxsora.models import vae as vae_lib
    from jaxsora.models.from_config import build_vae_from_config

    cfg = dict(cfg)
    try:
        if cfg.get("kind") == "opensora" and cfg.get("config"):
            if not cfg.get("path"):
                raise ValueError("vae kind 'opensora' needs 'path' (the OpenSora-VAE-v1.2 weights)")
            return vae_lib.load_opensora_vae(cfg["path"], dtype=cfg.get("dtype", "float32"), config=cfg["config"])
        return build_vae_from_config(cfg)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise PipelineError(f"VAE {cfg}: {e}") from None


def _build_text_encoder(cfg: Mapping, mesh, rules):
    from jaxsora.models.from_config import build_text_encoder_from_config

    try:
        return build_text_encoder_from_config(cfg, mesh=mesh, rules=rules)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise PipelineError(f"text encoder {dict(cfg)}: {e}") from None


def build_components(vae, text_encoder, run_cfg: Mapping | None, mcfg, mesh, rules):
    """(VAE config group, text-encoder config group, VAE, text encoder) for the model `mcfg`, from
    the specs (see `vae_spec`, `text_encoder_spec`); a VAE or text encoder whose sizes do not fit
    the model is a PipelineError."""
    vcfg = vae_spec(vae, run_cfg)
    tcfg = text_encoder_spec(text_encoder, run_cfg, mcfg)
    vae_obj = build_vae(vcfg)
    if int(vae_obj.out_channels) != int(mcfg.in_channels):
        raise PipelineError(f"the VAE gives {vae_obj.out_channels} latent channels but the model takes "
                            f"{mcfg.in_channels} (--vae {vcfg.get('kind')}); use the VAE the model was trained "
                            "with")
    te = _build_text_encoder(tcfg, mesh, rules)
    if te.caption_channels != mcfg.caption_channels or te.model_max_length != mcfg.model_max_length:
        raise PipelineError(f"the text encoder gives {te.model_max_length}×{te.caption_channels} states, the model "
                            f"takes {mcfg.model_max_length}×{mcfg.caption_channels} (--text-encoder)")
    return vcfg, tcfg, vae_obj, te


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
def restore_model(step_dir: str, mcfg, run_cfg: Mapping | None, mesh, rules, *, ema: bool = True):
    """(STDiT3 with the checkpoint's weights in their shards, "ema" or "params"). Without EMA
    weights in the checkpoint, `ema` falls back to the params (said on stderr). A LoRA run's
    checkpoint gives the model with its adapters (the base frozen, the adapters params / ema)."""
    from jaxsora.checkpoint.orbax_errors import quiet_orbax
    from jaxsora.convert import sharded
    from jaxsora.models import lora
    from jaxsora.models.stdit3 import STDiT3
    from jaxsora.parallel.sharding import tree_shardings

    # The model's structure and each variable's sharding, from a trace of its initialization
    # (as train.step.state.plan_state; nothing is allocated).
    box: dict = {}
    lora_spec = lora.LoRASpec.from_config((run_cfg or {}).get("lora"))

    def init():
        m = STDiT3(mcfg, rngs=nnx.Rngs(0))
        if lora_spec is not None:
            lora.apply_lora(m, lora_spec)
        box["graphdef"], st = nnx.split(m)
        box["shardings"] = tree_shardings(st, mesh, rules)
        return st

    with jax.set_mesh(mesh):
        traced = jax.jit(init).trace()
    graphdef, shardings = box["graphdef"], box["shardings"]
    abs_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), traced.out_info)
    flat_abs = nnx.to_flat_state(abs_state)
    flat_sh = dict(nnx.to_flat_state(shardings))
    targets = {}
    for path, v in flat_abs:
        value = v.get_value()
        sh = flat_sh[path]
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        targets[tuple(path)] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sh)
    weights = "ema" if ema else "params"
    with quiet_orbax(logging.ERROR):  # e.g. no _CHECKPOINT_METADATA in a converter output
        try:
            loaded = sharded.read_native_weights(step_dir, targets, ema=ema)
        except WeightsError as e:
            if not (ema and "no 'ema' entry" in str(e)):
                raise
            print(f"[jaxsora.sample] {step_dir} has no EMA weights; using the params", file=sys.stderr, flush=True)
            loaded, weights = sharded.read_native_weights(step_dir, targets, ema=False), "params"
    state = nnx.from_flat_state([(path, v.replace(loaded[tuple(path)])) for path, v in flat_abs])
    return nnx.merge(graphdef, state), weights
