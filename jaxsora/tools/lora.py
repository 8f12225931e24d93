"""`python -m jaxsora.tools.lora {merge,export-adapters} --ckpt-path CKPT --output OUT [--step N] [--ema]
[--dtype fp32|bf16]`: the results of a LoRA run (`lora.rank` > 0) as files other tools read.

CKPT is a run folder, its `checkpoints/` folder or one step folder (`--step N` picks a step of the
first two; default: the newest). A LoRA run's checkpoint holds the adapters (params/, and their EMA
in ema/) and the frozen base model (frozen/); `--ema` takes the EMA of the adapters instead of the
adapters (merged onto the same base).

merge             W ← W + (alpha/rank)·A·B for every adapted Linear (float64, stored as float32),
                  adapters dropped. OUT a folder: a plain jaxsora weights checkpoint `OUT/<step>/`
                  (params, ema = the same merged weights, frozen, and the run's config with
                  `lora.rank` 0 and a `lora.merged` record) that sampling, `--ckpt-path` and
                  `python -m jaxsora.convert to-torch` read. OUT.safetensors / .pth: the Open-Sora
                  STDiT3 state dict directly (as `convert to-torch` writes it).
export-adapters   the adapters alone. OUT a folder: peft's own adapter folder
                  (`adapter_config.json` + `adapter_model.safetensors`), which
                  `PeftModel.from_pretrained(stdit3, OUT)` loads onto Open-Sora's PyTorch STDiT3.
                  OUT.safetensors (or .pth): the bare tensors `<module>.lora_A.weight` [r, din] and
                  `<module>.lora_B.weight` [dout, r] (PyTorch module paths, e.g.
                  `spatial_blocks.0.attn.qkv`), for peft's `inject_adapter_in_model`; the safetensors
                  metadata records rank, alpha, scale, the target patterns and the adapted modules.

OUT (`--output`; the older `--out` and `--ckpt` still work) must not exist (a folder may exist empty).
Host only (no accelerator is taken); the checkpoint's arrays are checked against its integrity record
when it has one. A mistake is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

# Host work only: never take an accelerator (a training job may hold it).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.cli import ArgumentParser, hidden_aliases  # noqa: E402
from jaxsora.cli import HelpFormatter as _Help  # noqa: E402
from jaxsora.errors import BadInput, OutputExists, run_cli  # noqa: E402

PROG = "jaxsora.tools.lora"
TORCH_OUT = (".safetensors", ".pth", ".pt")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=f"python -m {PROG}", description=__doc__, formatter_class=_Help)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("merge", "adapters merged into the base: a jaxsora checkpoint folder or an Open-Sora "
                                  "state dict (.safetensors/.pth)"),
                        ("export-adapters", "the adapters alone: OUT a folder is peft's adapter folder "
                                            "(PeftModel.from_pretrained), OUT.safetensors the bare tensors")):
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=_Help)
        hidden_aliases(p, p.add_argument("--ckpt-path", dest="ckpt", required=True, help="a LoRA run folder, "
                                         "its checkpoints/ folder or one step folder"), "--ckpt")
        hidden_aliases(p, p.add_argument("--output", dest="out", metavar="OUT", required=True,
                                         help=("OUT folder (jaxsora checkpoint) or OUT.safetensors/.pth"
                                               if name == "merge" else "OUT.safetensors (or .pth)")), "--out")
        p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
        p.add_argument("--ema", action="store_true", help="use the EMA of the adapters")
        p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                       help="dtype of a PyTorch output (a jaxsora checkpoint keeps float32)")
        p.add_argument("--debug", action="store_true", help="tracebacks for user errors too")
    return ap


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
def step_dir_of(path: str, step: int | None = None) -> str:
    """The step folder of CKPT (run / checkpoints / step folder; newest step unless `step`)."""
    from jaxsora import checkpoint as ck

    root, named = ck.resolve_checkpoint(path, step)
    s = named if named is not None else (step if step is not None else ck.checkpoint_steps(root)[-1])
    d = os.path.join(root, str(s))
    if not ck.has_weights(d):
        raise BadInput(f"{d} is not a jaxsora checkpoint (no params/ or state/ folder)")
    return d


def read_lora_checkpoint(path: str, *, step: int | None = None, ema: bool = False):
    """(step folder, run config, LoRASpec, STDiT3Config, {path: numpy array} of the adapters (or
    their EMA) and the frozen base)."""
    from jaxsora.convert import native
    from jaxsora.models import lora

    step_dir = step_dir_of(path, step)
    config = native.read_config(step_dir)
    try:
        spec = lora.LoRASpec.from_config(config.get("lora"))
    except lora.LoRAError as e:
        raise BadInput(f"{step_dir}: its lora config is unusable: {e}") from None
    if spec is None:
        raise BadInput(f"{step_dir} is not a LoRA checkpoint (its config has no lora group or lora.rank 0); "
                       "a plain checkpoint converts directly: python -m jaxsora.convert to-torch")
    cfg, flat = native.load_weights(step_dir, ema=ema, merge_lora=False)
    if not lora.adapter_modules(flat):
        raise BadInput(f"{step_dir}: its config says lora.rank {spec.rank} but its {'ema' if ema else 'params'} "
                       "hold no adapters (lora_a/lora_b)")
    return step_dir, config, spec, cfg, flat


def _check_out(out: str, kinds: Sequence[str]) -> None:
    if out.endswith(TORCH_OUT):
        if not any(out.endswith(k) for k in kinds):
            raise BadInput(f"--output {out}: expected one of {', '.join(kinds)}")
        if os.path.exists(out):
            raise OutputExists(f"--output {out} exists: give a new file name")
        return
    if ".folder" not in kinds:
        raise BadInput(f"--output {out}: expected a file ending in {', '.join(k for k in kinds if k != '.folder')}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise OutputExists(f"--output {out} exists and is not an empty folder: give a new folder")


def _torch_dtype(name: str):
    import ml_dtypes
    import numpy as np

    return ml_dtypes.bfloat16 if name == "bf16" else np.float32


def _write_torch(sd: dict, out: str, metadata: dict) -> None:
    """Written to a temporary name beside OUT and renamed: a failure leaves no partial OUT."""
    from jaxsora.convert import torch as tconv

    ext = next(k for k in TORCH_OUT if out.endswith(k))
    tmp = f"{out[:-len(ext)]}.tmp-{os.getpid()}{ext}"
    try:
        tconv.save_torch_state_dict(sd, tmp, metadata=metadata if out.endswith(".safetensors") else None)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------
def plain_model(cfg, flat: dict):
    """An STDiT3 (no adapters) holding the arrays of `flat` {path of str: array}: the abstract
    model's variables filled in (nothing initialized). Missing or mis-shaped entries raise."""
    from flax import nnx

    from jaxsora.models.stdit3 import STDiT3

    graphdef, state = nnx.split(nnx.eval_shape(lambda: STDiT3(cfg, rngs=nnx.Rngs(0))))
    filled, missing = [], []
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(p) for p in path)
        if key not in flat:
            missing.append(".".join(key))
            continue
        value = flat[key]
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise BadInput(f"{'.'.join(key)}: the checkpoint has {tuple(value.shape)}, the model "
                           f"{tuple(var.get_value().shape)}")
        filled.append((path, var.replace(value.astype(var.get_value().dtype))))
    if missing:
        raise BadInput(f"the checkpoint lacks {len(missing)} model weights, e.g. {missing[:3]}")
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def merge(path: str, out: str, *, step: int | None = None, ema: bool = False, dtype: str = "fp32") -> dict:
    """See the module docstring. Returns {"out", "modules", "step_dir", "kind"}."""
    from jaxsora.models import lora

    _check_out(out, (".folder",) + TORCH_OUT)
    step_dir, config, spec, cfg, flat = read_lora_checkpoint(path, step=step, ema=ema)
    modules = sorted(".".join(m) for m in lora.adapter_modules(flat))
    merged = lora.merge_flat(flat, spec.scale)
    record = dict(source=step_dir, ema=bool(ema), modules=len(modules), **spec.to_dict(),
                  base=(config.get("lora") or {}).get("base", ""))
    if out.endswith(TORCH_OUT):
        from jaxsora.convert import torch as tconv

        sd = tconv.to_torch_state_dict(merged, dtype=_torch_dtype(dtype), config=cfg)
        _write_torch(sd, out, {"format": "pt", "source": "jaxsora", "lora_merged": json.dumps(record)})
        return dict(out=out, modules=modules, step_dir=step_dir, kind="state dict", tensors=len(sd))
    from jaxsora.convert import native

    extra = {k: v for k, v in config.items() if k != "model"}
    extra["lora"] = {**(config.get("lora") or {}), "rank": 0, "merged": record}
    s = int(os.path.basename(step_dir))
    native.save_weights(out, plain_model(cfg, merged), step=s, extra_config=extra)
    return dict(out=os.path.join(os.path.abspath(out), str(s)), modules=modules, step_dir=step_dir,
                kind="jaxsora checkpoint")


# ----------------------------------------------------------------------------------------------
# export-adapters
# ----------------------------------------------------------------------------------------------
def export_adapters(path: str, out: str, *, step: int | None = None, ema: bool = False,
                    dtype: str = "fp32") -> dict:
    from jaxsora.models import lora

    _check_out(out, (*TORCH_OUT, ".folder"))
    step_dir, config, spec, cfg, flat = read_lora_checkpoint(path, step=step, ema=ema)
    sd = lora.to_torch_adapters(flat, dtype=_torch_dtype(dtype))
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in sd})
    meta = {"format": "pt", "source": "jaxsora", "lora_rank": str(spec.rank), "lora_alpha": repr(float(spec.alpha)),
            "lora_scale": repr(spec.scale), "lora_targets": json.dumps(list(spec.targets)),
            "lora_modules": json.dumps(modules), "checkpoint": step_dir, "ema": str(bool(ema)).lower(),
            "base": str((config.get("lora") or {}).get("base", ""))}
    if out.endswith(TORCH_OUT):
        _write_torch(sd, out, meta)
    else:
        _write_peft_folder(sd, out, spec, modules, meta)
    return dict(out=out, modules=modules, step_dir=step_dir, tensors=len(sd))


# peft's adapter folder (peft.utils.constants CONFIG_NAME / SAFETENSORS_WEIGHTS_NAME); its tensor
# names carry the PeftModel prefix, which set_peft_model_state_dict strips again.
PEFT_CONFIG, PEFT_WEIGHTS, PEFT_PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."


def _write_peft_folder(sd: dict, out: str, spec, modules: Sequence[str], meta: dict) -> None:
    """`PeftModel.from_pretrained(model, out)`'s folder: the LoRA config (rank, alpha, dropout, the exact
    module paths as target_modules: peft matches a name equal to a target) and the prefixed tensors.
    Written into a temporary folder beside OUT and renamed."""
    import shutil

    from jaxsora.convert import torch as tconv

    config = dict(peft_type="LORA", task_type=None, base_model_name_or_path=None, inference_mode=True,
                  r=int(spec.rank), lora_alpha=float(spec.alpha), lora_dropout=float(spec.dropout),
                  target_modules=list(modules), bias="none", fan_in_fan_out=False, use_rslora=False,
                  init_lora_weights=True, modules_to_save=None)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.normpath(out))}.tmp-{os.getpid()}")
    try:
        os.makedirs(tmp)
        with open(os.path.join(tmp, PEFT_CONFIG), "w") as f:
            json.dump(config, f, indent=1)
        tconv.save_torch_state_dict({PEFT_PREFIX + k: v for k, v in sd.items()}, os.path.join(tmp, PEFT_WEIGHTS),
                                    metadata=meta)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (_check_out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "merge":
        res = merge(args.ckpt, args.out, step=args.step, ema=args.ema, dtype=args.dtype)
        print(f"merged the {'EMA ' if args.ema else ''}adapters of {len(res['modules'])} layers of {res['step_dir']} "
              f"into the base → {res['out']} ({res['kind']})")
    else:
        res = export_adapters(args.ckpt, args.out, step=args.step, ema=args.ema, dtype=args.dtype)
        print(f"wrote the {'EMA ' if args.ema else ''}adapters of {len(res['modules'])} layers ({res['tensors']} "
              f"tensors) of {res['step_dir']} → {res['out']}")
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, lambda: main(argv), argv)


if __name__ == "__main__":
    sys.exit(run())
