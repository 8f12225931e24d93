"""Loading a checkpoint for sampling: the VAE and text encoder its run config names (or that `--vae` /
`--text-encoder` name), and the model's weights; which step folder and which specs, from the files alone, is
`jaxsora.infer.locate`.

Weights only: the params (or the EMA) and the frozen variables — the checkpoint's `params/` (or
`ema/`) and `frozen/` items, or those arrays of an older checkpoint's single `state/` item — are
restored with orbax partial restore straight into their shards (`convert.sharded`) and checked
against its integrity.json; the optimizer state is never read (a copy without `opt_state/` works).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping

import jax
from flax import nnx

from jaxsora.errors import BadInput, WeightsError
from jaxsora.infer.locate import PipelineError, text_encoder_spec, vae_spec


def model_config(stored_model: Mapping, dtype: str | None = None):
    """The STDiT3Config of a checkpoint's `model` entry, for sampling: no remat; `dtype` the compute
    dtype (default the checkpoint's; "bfloat16"/"float32"; "bf16"/"fp32" accepted)."""
    from jaxsora.models.config import STDiT3Config

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
