"""Gradient checkpointing policies and scanned blocks, compiled side by side: compile time and
per-device memory of the real train step for each (policy, scan_blocks) at one bucket shape.

    python bench/remat.py                                            # XL/2, 240p × 51 frames, batch 1, bf16
    python bench/remat.py --depth 8 --policies none,full --latent 15x30x53 --batch 2

Nothing runs: each variant is lowered and compiled (`TrainStep.compile`), and XLA's
`memory_analysis()` gives the bytes. On CPU, XLA drops remat's optimization barriers, so the
*unrolled* policies show (almost) no activation saving there — the scanned rows show what remat
saves; on a GPU both do. Compile time is the number to read on any backend.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def compile_variant(model: str, latent, batch: int, dtype: str, remat: str, scan: bool, overrides: dict):

    import step as bench_step

    from jaxsora.parallel.mesh import logical_rules, make_mesh
    from jaxsora.parallel.sharding import abstract_of
    from jaxsora.train.step.optim import AdamW
    from jaxsora.train.step.state import plan_state
    from jaxsora.train.step.train_step import TrainStep, make_train_step

    s = bench_step.Shape("x", model, tuple(latent), batch, dtype, remat, scan, overrides)
    cfg = bench_step.model_config(s)
    mesh = make_mesh(dict(data=-1, fsdp=1, sequence=1))
    optimizer = AdamW.from_config(dict(lr=1e-4, lr_schedule="constant"))
    plan = plan_state(cfg, optimizer.tx(), 0, mesh, logical_rules(mesh))
    fn = make_train_step(plan.graphdef, optimizer, encode_video=lambda e, v, k: v, encode_text=lambda e, y, m: y,
                         scheduler_cfg=dict(sample_method="logit-normal", use_timestep_transform=True),
                         mask_ratios=None, ema_decay=0.99)
    batch = bench_step.inputs(cfg, s, mesh)  # latents and text states: small beside the model
    batch_spec = abstract_of(batch)
    return TrainStep(fn, plan).compile(batch_spec, {}, keep=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="STDiT3-XL/2")
    ap.add_argument("--depth", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--latent", default="15x30x53", help="latent T×H×W (240p × 51 frames = 15×30×53)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policies", default="none,full,dots_saveable,dots_with_no_batch_dims,offload,save_matmuls,"
                                          "save_qkv_proj")
    ap.add_argument("--scan", default="no,yes", help="scan_blocks variants: no,yes")
    args = ap.parse_args(argv)
    import jax

    latent = tuple(int(v) for v in args.latent.split("x"))
    overrides = {"depth": args.depth} if args.depth else {}
    rows = []
    for scan in [v == "yes" for v in args.scan.split(",")]:
        for policy in args.policies.split(","):
            info = compile_variant(args.model, latent, args.batch, args.dtype, policy, scan, overrides)
            rows.append((policy, scan, info))
            print(f"  compiled remat={policy} scan={scan}: {info.seconds:.1f}s", flush=True)
    gib = 1 << 30
    print(f"\n{args.model}{' depth ' + str(args.depth) if args.depth else ''}, latents {args.latent}, batch "
          f"{args.batch}, {args.dtype}, {jax.devices()[0].device_kind}")
    head = f"{'remat':<24} {'scan':>5} {'compile s':>9} {'args GiB':>8} {'temp GiB':>8} {'peak GiB':>8}"
    print(head)
    print("-" * len(head))
    for policy, scan, info in rows:
        print(f"{policy:<24} {'yes' if scan else 'no':>5} {info.seconds:>9.1f} {info.argument_bytes / gib:>8.2f} "
              f"{info.temp_bytes / gib:>8.2f} {info.peak_bytes / gib:>8.2f}")
    if jax.default_backend() == "cpu":
        print("CPU: unrolled remat rows show no activation saving (XLA:CPU drops the barriers); see the scan rows.")


if __name__ == "__main__":
    main()
