"""`python -m jaxsora.convert {to-torch,from-torch} ...` — see jaxsora/convert/__init__.py."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from jaxsora.cli import ArgumentParser
from jaxsora.errors import BadInput, run_cli


def _parse_overrides(items):
    out = {}
    for item in items or []:
        if "=" not in item:
            raise BadInput(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            import ast

            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m jaxsora.convert", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("to-torch", help="jaxsora checkpoint → Open-Sora STDiT3 state dict")
    t.add_argument("ckpt", help="jaxsora checkpoint folder (training output or from-torch output)")
    t.add_argument("out", help="OUT.safetensors or OUT.pth/.pt")
    t.add_argument("--ema", action="store_true", help="export the EMA weights")
    t.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    t.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    f = sub.add_parser("from-torch", help="Open-Sora STDiT3 / PixArt-Σ state dict → jaxsora checkpoint")
    f.add_argument("input", help="IN.pth / .pt / .safetensors")
    f.add_argument("out", help="output folder (orbax)")
    f.add_argument("--model", default="STDiT3-XL/2", help="model preset (default STDiT3-XL/2)")
    f.add_argument("--set", nargs="*", metavar="FIELD=VALUE", help="STDiT3Config overrides, e.g. depth=2")
    f.add_argument("--seed", type=int, default=0, help="seed for what the file lacks (initialized as the reference)")
    f.add_argument("--strict", action="store_true", help="fail unless every key maps one to one")
    args = ap.parse_args(argv)
    # The input path is checked before jax is imported: a wrong one is answered at once.
    if args.cmd == "to-torch":
        from jaxsora.checkpoint.layout import resolve_step_dir

        resolve_step_dir(args.ckpt, args.step)
    else:  # ... and so are the preset and its overrides (jaxsora.models.presets needs no jax)
        from jaxsora.io.weights import weights_file
        from jaxsora.models.presets import get_model_config

        weights_file(args.input)
        cfg = get_model_config(args.model, **_parse_overrides(args.set))

    from jaxsora.convert import native
    from jaxsora.convert import torch as tconv

    if args.cmd == "to-torch":
        cfg, flat = native.load_weights(args.ckpt, ema=args.ema, step=args.step)
        dtype = ml_dtypes.bfloat16 if args.dtype == "bf16" else np.float32
        sd = tconv.to_torch_state_dict(flat, dtype=dtype, config=cfg)
        tconv.save_torch_state_dict(sd, args.out, metadata={"format": "pt", "source": "jaxsora"}
                                    if args.out.endswith(".safetensors") else None)
        n = sum(int(np.prod(v.shape)) for v in sd.values())
        print(f"wrote {len(sd)} tensors ({n:,} numbers, {args.dtype}, {'EMA' if args.ema else 'params'}) → {args.out}")
        return 0

    sd = tconv.read_state_dict(args.input)
    model, report = tconv.from_torch_state_dict(sd, cfg, seed=args.seed, return_report=True)
    print(report.summary())
    if args.strict and (report.initialized or report.ignored):
        print("strict: refusing a partial mapping", file=sys.stderr)
        return 2
    native.save_weights(args.out, model, extra_config={"source": args.input})
    print(f"wrote jaxsora checkpoint → {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("jaxsora.convert", main))
