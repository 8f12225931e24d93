"""Which checkpoint to sample and with which VAE and text encoder, from the files alone: the step folder, its
stored config, the `--vae` / `--text-encoder` specs. Imports no jax (nor the package's heavy modules), so that
`python -m jaxsora.sample` answers a wrong path, step or spec before it imports jax; `loading` builds on these."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

from jaxsora.errors import BadInput, MissingFile

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


def read_stored_config(step_dir: str) -> dict:
    """A step folder's config item: a run's config (with its "model" entry), or a converter output's model
    config."""
    from jaxsora.checkpoint.layout import read_config

    cfg = read_config(step_dir)
    return cfg.get("config", cfg) if isinstance(cfg, dict) and "model" not in cfg else cfg


def read_run_config(step_dir: str) -> dict | None:
    """The run config stored with a checkpoint, or None for a converter output (model only)."""
    stored = read_stored_config(step_dir)
    return stored if isinstance(stored, dict) and ("vae" in stored or "text_encoder" in stored) else None


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
