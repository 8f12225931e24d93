"""Writes docs/configs.md, the config reference: every knob of a run config with its default, its range and
what it does, and what each config file of configs/ changes. Nothing in it is typed by hand twice:

- the knobs and their defaults are `configs/base.py`'s `get_config()`, flattened;
- what a knob does is the comment beside it in `configs/base.py` (a comment on the lines above a key
  applies to it and the keys right after it), or `NOTES` below where the file has none;
- the range is `RANGES` of `jaxsora/train/plan/ranges.py` (what the trainer checks before any work), and
  the allowed values of the choice knobs come from the code that checks them (`CHOICES`);
- what each config file changes is its `get_config()` against the base's.

    python docs/gen_configs.py            # rewrite docs/configs.md
    python docs/gen_configs.py --check    # exit 1 if docs/configs.md differs (tests/test_docs.py does this)
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import os
import re
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "configs.md")
BASE = os.path.join(REPO, "configs", "base.py")
# The config files described at the end of the page, in this order (every .py of configs/ but the base and
# private helpers must be here: `config_files()` checks it).
CONFIG_FILES = ("configs/stage1.py", "configs/stage2.py", "configs/stage3.py", *(
    f"configs/lambda/stage{i}.py" for i in range(1, 8)), "configs/lora_example.py", "configs/demo.py")

# What a knob does, where configs/base.py has no comment beside it. Every key here must exist.
NOTES = {
    "model.name": "the STDiT3 preset",
    "model.hidden_size": "the preset's width, open to the command line (None: the preset's own)",
    "model.num_heads": "the preset's attention heads, open to the command line (None: the preset's own)",
    "model.class_dropout_prob": "caption dropout for classifier-free guidance (the learned null caption)",
    "model.fix_final_layer_double_mod": "True: skip the reference's second modulation of masked frames in the final "
                                        "layer (False keeps Open-Sora's behaviour)",
    "vae.kind": "`opensora` (the OpenSora VAE v1.2 at `vae.path`) or `identity` (pixel space, the demo)",
    "vae.path": "the OpenSora VAE v1.2: a folder with `model.safetensors`, or the file (docs/weights.md)",
    "vae.dtype": "the VAE's compute dtype",
    "vae.downsample": "`identity` only: (T, H, W) average pooling",
    "text_encoder.kind": "`t5` (T5 v1.1 at `text_encoder.path`) or `tiny` (random weights, byte tokenizer, no files)",
    "text_encoder.path": "the T5 v1.1 XXL folder: config, weights, `spiece.model` (docs/weights.md)",
    "text_encoder.model_max_length": "caption tokens (Open-Sora 1.2: 300)",
    "text_encoder.dtype": "T5's compute dtype",
    "text_encoder.param_dtype": "T5's parameter dtype (bf16: 9.5 GB instead of 19)",
    "text_encoder.d_model": "`tiny` only: width",
    "text_encoder.num_layers": "`tiny` only: layers",
    "text_encoder.num_heads": "`tiny` only: heads",
    "text_encoder.d_ff": "`tiny` only: feed-forward width",
    "text_encoder.seed": "`tiny` only: the seed of its random weights",
    "data.bucket_config": "{resolution: {num_frames: (keep_prob, per-device batch)}} (docs/data.md#buckets)",
    "data.frame_interval": "take every n-th frame",
    "data.seed": "the bucket draws and the epoch order",
    "scheduler.sample_method": "how training draws t",
    "scheduler.use_timestep_transform": "Open-Sora 1.2's resolution- and length-aware timestep shift",
    "scheduler.loc": "logit-normal mean",
    "scheduler.scale": "logit-normal scale",
    "scheduler.transform_scale": "the shift's scale",
    "optim.lr": "the learning rate (after warm-up; `1cycle`: the final one)",
    "optim.betas": "AdamW's (beta1, beta2), each in [0, 1)",
    "optim.eps": "AdamW's epsilon (Open-Sora 1.2: 1e-15)",
    "optim.weight_decay": "decoupled weight decay (the Lambda run: 0.01)",
    "optim.grad_clip": "clip the global gradient norm",
    "optim.lr_schedule": "the learning-rate schedule",
    "optim.warmup_steps": ("`linear_warmup`, `warmup_stable_decay`: steps to reach `lr`; `1cycle`: steps from "
                           "`min_lr` to `max_lr`"),
    "optim.min_lr": "`1cycle`: the starting lr; `warmup_stable_decay`: the final lr",
    "optim.max_lr": "`1cycle`: the peak lr",
    "optim.cooldown_steps": ("`1cycle`: steps from `max_lr` down to `lr`; `warmup_stable_decay`: from `lr` down "
                             "to `min_lr`"),
    "optim.anneal_strategy": "`1cycle`, `warmup_stable_decay`: the ramps' shape",
    "optim.decay_start": "`warmup_stable_decay`: the step the lr starts down from `lr` (not before the warm-up ends)",
    "optim.ema_decay": "the EMA of the parameters",
    "mesh.data": "data-parallel size (-1: the rest of the devices)",
    "mesh.fsdp": "parameter-sharding size (-1: the rest of the devices)",
    "mesh.sequence": "Ulysses sequence-parallel size; must divide the attention heads",
    "train.outputs": "where numbered run folders go (`--outputs`)",
    "train.experiment": "the run folder's name after its number",
    "train.seed": "the run's noise, timesteps and initialization",
    "train.max_steps": "",
    "train.ckpt_every": "",
    "train.keep_ckpts": "",
    "train.log_every": "",
    "train.watchdog_factor": "",
    "train.watchdog_min_seconds": "",
    "train.async_checkpoint": "write checkpoints in the background",
    "train.compilation_cache": "the persistent compilation cache in `<outputs>/jax_cache`",
    "wandb.enabled": "log to wandb (`pip install 'jaxsora[wandb]'`)",
    "wandb.project": "the wandb project",
    "wandb.mode": "`offline` works without network",
    "wandb.name": "the wandb run name (\"\": the run folder's name)",
    "sample.num_frames": "frames of this run's samples (`jaxsora.sample`, the server)",
    "sample.height": "height of this run's samples",
    "sample.width": "width of this run's samples",
    "sample.fps": "fps of this run's samples",
    "sample.cfg_scale": "guidance scale of this run's samples",
}


def _choices() -> dict[str, str]:
    """The allowed values of the choice knobs, from the code that checks them."""
    from jaxsora.models.config import ATTENTION_IMPLS, REMAT_SETTINGS
    from jaxsora.models.presets import available

    return {
        "model.name": ", ".join(available()),
        "model.compute_dtype": "float32, bfloat16",
        "model.remat": ", ".join(REMAT_SETTINGS),
        "model.attention_impl": ", ".join(ATTENTION_IMPLS),
        "vae.kind": "opensora, identity",
        "text_encoder.kind": "t5, tiny",
        "scheduler.sample_method": "uniform, logit-normal",
        "optim.lr_schedule": "constant, linear_warmup, 1cycle, warmup_stable_decay",
        "optim.anneal_strategy": "cos, linear",
        "wandb.mode": "online, offline, disabled",
        "lora.init": "kaiming, gaussian",
        "lora.targets": "attention, cross_attention, mlp, all, or module path patterns",
    }


def load_config(path: str):
    """`get_config()` of a config file of this repository (its `configs` package registered by path)."""
    from jaxsora.config_files import register_configs_package

    full = os.path.join(REPO, path)
    register_configs_package(full)
    name = "_gen_configs_" + re.sub(r"\W", "_", path)
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def flatten(node, prefix="") -> dict:
    """{dotted key: value} of a ConfigDict; dicts that are values (bucket configs, resolutions) stay whole."""
    out = {}
    items = node.items() if hasattr(node, "items") else []
    for k, v in items:
        key = f"{prefix}{k}"
        if type(v).__name__ == "ConfigDict" and key.count(".") == 0:  # a group
            out.update(flatten(v, key + "."))
        else:
            out[key] = v.to_dict() if hasattr(v, "to_dict") else v
    return out


def base_comments() -> tuple[dict, dict, dict]:
    """({key: the comment beside it}, {group: the comment above it}, {key or group: its place in the file})
    read from configs/base.py's get_config (a comment on the lines above a key applies to that key)."""
    with open(BASE) as f:
        source = f.read()
    body = source[source.index("def get_config"):]
    comments = {}  # line number → comment text (a trailing or a whole-line comment)
    whole = set()
    for tok in tokenize.generate_tokens(io.StringIO(body).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                whole.add(tok.start[0])
    keys, groups, order = {}, {}, {}
    group, pending, last_keys = None, [], []
    for n, line in enumerate(body.splitlines(), 1):
        m = re.match(r"\s*c\.(\w+) = ", line)
        if m:
            group = m.group(1)
            order.setdefault(group, len(order))
            if pending:
                groups[group] = " ".join(pending)
            pending, last_keys = [], []
            line = line[m.end():]
        if n in whole:
            if last_keys and line.index("#") > 20 and not pending:  # a continued trailing comment
                for k in last_keys:
                    keys[k] += " " + comments[n]
            else:
                pending.append(comments[n])
                last_keys = []
            continue
        names = re.findall(r"(?:^|[\s(,])(\w+)=(?!=)", line.split("#")[0])
        if group is None or not names:
            continue
        found = [f"{group}.{k}" for k in names]
        for k in found:
            order.setdefault(k, len(order))
        if n in comments:
            for k in found:
                keys[k] = comments[n]
            last_keys = found
        elif pending:  # a comment above: this key
            for k in found:
                keys[k] = " ".join(pending)
            last_keys = []
        else:
            last_keys = []
        pending = []
    return keys, groups, order


def _value(v, key: str = "") -> str:
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, dict) and key.endswith("bucket_config"):  # {res: {frames: ...}}: the buckets, not the numbers
        return "; ".join(f"{res}: {', '.join(str(f) for f in frames)} frames" for res, frames in v.items())
    if isinstance(v, dict):
        text = repr(v)
        return f"`{text}`" if len(text) <= 60 else f"a table of {len(v)} entries"
    return f"`{v!r}`"


def _range(key: str) -> str:
    from jaxsora.train.plan import ranges

    if key not in ranges.RANGES:
        return ""
    low, high, _ = ranges.RANGES[key]
    parts = []
    if low is not None:
        parts.append(f"> {low}" if key in ranges._EXCLUSIVE_LOW else f">= {low}")
    if high is not None:
        parts.append(f"<= {high}")
    text = " and ".join(parts)
    if key in ranges._ZERO_MEANS_OFF:
        text += ", or 0"
    return text


def _join(note: str, rnote: str) -> str:
    """The comment and the range's note, once each: the note is left out when the comment already says most
    of it (or the other way round)."""
    def words(text):
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    if not note or not rnote:
        return note or rnote
    if len(words(rnote) - words(note)) <= len(words(rnote)) // 3:
        return note
    if len(words(note) - words(rnote)) <= len(words(note)) // 3:
        return rnote
    return f"{note}; {rnote}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from jaxsora.train.plan.ranges import RANGES

    comments, groups, order = base_comments()
    unordered = flatten(load_config("configs/base.py"))
    last = len(order)  # keys the file does not spell out (a dict spread into a group): after their group's

    def place(key):
        return (order.get(key.split(".")[0], last), order.get(key, last), key)

    base = {k: unordered[k] for k in sorted(unordered, key=place)}
    choices = _choices()
    missing = [k for k in (*NOTES, *choices, *RANGES) if k not in base]
    assert not missing, f"docs/gen_configs.py names keys configs/base.py does not have: {missing}"
    out = io.StringIO()
    w = out.write
    w("# The config reference\n\n")
    w("<!-- Generated by `python docs/gen_configs.py` from configs/base.py and jaxsora/train/plan/ranges.py: "
      "do not edit by hand. tests/test_docs.py fails when this page differs from what the script writes. -->\n\n")
    w("Every knob of a run config, with its default (`configs/base.py`), the range the trainer checks before "
      "any work (`RANGES` in `jaxsora/train/plan/ranges.py`) or the values it takes, and what it does. "
      "Override any of them on the command line: `python -m jaxsora.train --config configs/stage1.py "
      "--config.optim.lr=2e-4`. A value out of its range, an unknown key or a wrong type is one line and "
      "exit code 2 before any work. What each config file changes from these defaults is at the end.\n")
    seen_groups = []
    for key in base:
        group = key.split(".")[0]
        if group not in seen_groups:
            seen_groups.append(group)
            w(f"\n## `{group}`\n\n")
            if groups.get(group):
                w(_cell(groups[group]) + "\n\n")
            w("| key | default | range or values | what it does |\n| --- | --- | --- | --- |\n")
        note = comments.get(key) or NOTES.get(key, "")
        if group == "mask_ratios" and not note:
            note = "the probability of this frame mask (Open-Sora's MaskGenerator); the rest is no mask"
        rnote = RANGES[key][2] if key in RANGES else ""
        what = _join(note, rnote)
        allowed = _range(key) or choices.get(key, "")
        w(f"| `{key}` | {_cell(_value(base[key], key))} | {_cell(allowed)} | {_cell(what)} |\n")
    w("\n## What each config file changes\n\n")
    w("Each config file starts from `configs/base.py` (or another config file) and changes these keys.\n")
    for path in config_files():
        cfg = flatten(load_config(path))
        doc = _docline(path)
        w(f"\n### `{path}`\n\n{doc}\n\n")
        changed = [(k, cfg[k]) for k in sorted(cfg, key=place) if k not in base or base[k] != cfg[k]]
        if not changed:
            w("No change from the base.\n")
            continue
        w("| key | value |\n| --- | --- |\n")
        for k, v in changed:
            w(f"| `{k}` | {_cell(_value(v, k))} |\n")
    return out.getvalue()


def _docline(path: str) -> str:
    """The first sentence of a config file's docstring."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    m = re.match(r'\s*"""(.*?)(?:\n\n|""")', text, re.S)
    return " ".join(m.group(1).split()) if m else ""


def config_files() -> tuple[str, ...]:
    """CONFIG_FILES, checked to be every config file of configs/."""
    on_disk = sorted(os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(os.path.join(REPO, "configs"))
                     for f in fs if f.endswith(".py") and not f.startswith("_") and f != "base.py")
    assert sorted(CONFIG_FILES) == on_disk, f"docs/gen_configs.py CONFIG_FILES {CONFIG_FILES} != configs/ {on_disk}"
    return CONFIG_FILES


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configs.md differs from what it would write")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(PAGE) as f:
            same = f.read() == text
        print("docs/configs.md is up to date" if same else "docs/configs.md is stale: run python docs/gen_configs.py")
        return 0 if same else 1
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
