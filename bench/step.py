"""Train-step benchmark: step time, samples/s, tokens/s and MFU of STDiT3, optionally beside the real
Open-Sora PyTorch step on the same machine.

    python bench/step.py --model tiny --batch 2 --frames 4 --height 16 --width 16
    python bench/step.py --model STDiT3-XL/2 --batch 4 --frames 15 --height 30 --width 53 --dtype bfloat16 --remat
    python bench/step.py --model tiny ... --reference /tmp/refenv/bin/python      # + the PyTorch step, and the ratio

Shapes are *latent* sizes (240p × 51 frames = 15 × 30 × 53 latents). The step is the real jitted
train step (`jaxsora.train.step`: rectified-flow loss, caption dropout, grads, clip, AdamW, EMA)
fed latents and text states directly, so the frozen VAE/T5 are not timed.

FLOP count (forward, per sample; matmuls count 2·m·n·k; N = T·S image tokens, C width, L text
tokens, d depth, each of the 2d blocks):
    28·N·C²            qkv (6), self-attn proj (2), cross q (2) and proj (2), MLP (16)
  + 4·L·C²             cross-attention k/v projection of the text
  + 4·N·L·C            cross-attention scores and weighted sum
  + 4·T·S²·C  (spatial blocks) or 4·S·T²·C (temporal blocks)   self-attention scores and sum
plus the patch embedding 2·N·(p·C_in)·C, the final layer 2·N·C·(p·C_out) and the caption MLP
2·L·(C_cap·C + C²). Training = 3 × forward (backward = 2 × forward); rematerialization adds a
forward that MFU does not count (model FLOPs, as in the PaLM convention). Peak: H100 SXM bf16
dense 989 TFLOP/s (fp32 via TF32: 495), H200 the same; elsewhere pass --peak-tflops.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np

PEAK_TFLOPS = {("h100", "bfloat16"): 989.0, ("h100", "float32"): 495.0, ("h200", "bfloat16"): 989.0,
               ("h200", "float32"): 495.0}


def forward_flops(cfg, t: int, h: int, w: int, text_len: int) -> float:
    pt, ph, pw = cfg.patch_size
    tt, hh, ww = -(-t // pt), -(-h // ph), -(-w // pw)
    s, n, c, L = hh * ww, tt * hh * ww, cfg.hidden_size, text_len
    per_block = 28 * n * c * c + 4 * L * c * c + 4 * n * L * c
    spatial = per_block + 4 * tt * s * s * c
    temporal = per_block + 4 * s * tt * tt * c
    p = pt * ph * pw
    extra = (2 * n * p * cfg.in_channels * c + 2 * n * c * p * cfg.out_channels
             + 2 * L * (cfg.caption_channels * c + c * c))
    return float(cfg.depth * (spatial + temporal) + extra)


def bench_jax(args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxsora  # noqa: F401
    from jaxsora.models.presets import get_model_config
    from jaxsora.models.stdit3 import STDiT3
    from jaxsora.train.optim import lr_schedule, make_optimizer
    from jaxsora.train.step import init_state, make_train_step

    cfg = get_model_config(args.model, compute_dtype=args.dtype, remat=args.remat, attention_impl=args.attention)
    optim = dict(lr=1e-4, warmup_steps=0, lr_schedule="constant", weight_decay=0.0, ema_decay=0.99)
    tx = make_optimizer(optim)
    model = STDiT3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = init_state(model, tx, 0)
    del model
    step = make_train_step(graphdef, tx, encode_video=lambda e, v, k: v, encode_text=lambda e, y, m: y,
                           scheduler_cfg=dict(sample_method="logit-normal", use_timestep_transform=True),
                           mask_ratios=None, ema_decay=0.99, lr_fn=lr_schedule(optim))
    b, L = args.batch, cfg.model_max_length
    rng = np.random.default_rng(0)
    batch = dict(
        video=jnp.asarray(rng.standard_normal((b, cfg.in_channels, args.frames, args.height, args.width)), jnp.float32),
        ids=jnp.asarray(rng.standard_normal((b, L, cfg.caption_channels)), jnp.float32),
        text_mask=jnp.asarray(np.arange(L)[None] < rng.integers(L // 4, L + 1, (b, 1)), jnp.int32),
        fps=jnp.full((b,), 24.0), height=jnp.full((b,), 8.0 * args.height), width=jnp.full((b,), 8.0 * args.width),
        num_frames=jnp.full((b,), 17.0 * max(1, args.frames // 5)),
    )
    jit_step = jax.jit(step, donate_argnums=(0,))
    t0 = time.perf_counter()
    state, m = jit_step(state, batch)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = jit_step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    flops = 3 * forward_flops(cfg, args.frames, args.height, args.width, L) * b
    kind = jax.devices()[0].device_kind.lower()
    peak = args.peak_tflops or next((v for (k, d), v in PEAK_TFLOPS.items() if k in kind and d == args.dtype), None)
    pt, ph, pw = cfg.patch_size
    tokens = b * -(-args.frames // pt) * -(-args.height // ph) * -(-args.width // pw)
    return dict(impl="jaxsora (JAX)", device=jax.devices()[0].device_kind, step_s=dt, compile_s=compile_s,
                samples_per_s=b / dt, tokens_per_s=tokens / dt, tflops=flops / dt / 1e12,
                mfu=(flops / dt / 1e12 / peak) if peak else None, loss=float(m["loss"]))


REF_SCRIPT = r'''
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.environ["REFHARNESS"])
import ref_stdit3 as R
R.setup(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
a = json.loads(sys.argv[1])
cfg = dict(a["config"]); cfg["patch_size"] = tuple(cfg["patch_size"])
model = R.build(cfg, seed=0)
model.eval()  # no caption dropout (CUDA-only upstream); the math of the step is otherwise the same
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, eps=1e-15, weight_decay=0.0)
rng = np.random.default_rng(0)
b, L = a["batch"], cfg["model_max_length"]
x = rng.standard_normal((b, cfg["in_channels"], a["frames"], a["height"], a["width"])).astype(np.float32)
y = rng.standard_normal((b, 1, L, cfg["caption_channels"])).astype(np.float32)
mask = (np.arange(L)[None] < rng.integers(L // 4, L + 1, (b, 1))).astype(np.int64)
def step():
    noise = rng.standard_normal(x.shape).astype(np.float32)
    t = rng.uniform(0, 1000, b).astype(np.float32)
    loss, grads = R.training_loss(model, x, noise, t, y, mask, grad=True)
    for n, p in model.named_parameters():
        if n in grads:
            p.grad = torch.from_numpy(grads[n])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
step()
ts = []
for _ in range(a["steps"]):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
print("REF " + json.dumps(dict(step_s=float(np.median(ts)), threads=torch.get_num_threads())))
'''


def bench_reference(args, cfg) -> dict:
    conf = dict(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, patch_size=list(cfg.patch_size),
                in_channels=cfg.in_channels, caption_channels=cfg.caption_channels,
                model_max_length=cfg.model_max_length, qk_norm=cfg.qk_norm, pred_sigma=cfg.pred_sigma)
    payload = json.dumps(dict(config=conf, batch=args.batch, frames=args.frames, height=args.height, width=args.width,
                              steps=args.steps))
    here = os.path.dirname(os.path.abspath(__file__))
    harness = os.environ.get("REFHARNESS", os.path.join(here, "..", "..", "shared", "refharness"))
    env = {**os.environ, "REFHARNESS": harness}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(REF_SCRIPT)
    out = subprocess.run([args.reference, f.name, payload], capture_output=True, text=True, env=env)
    os.unlink(f.name)
    if out.returncode:
        raise RuntimeError(f"reference step failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.split("REF ", 1)[1])
    b = args.batch
    pt, ph, pw = cfg.patch_size
    tokens = b * -(-args.frames // pt) * -(-args.height // ph) * -(-args.width // pw)
    flops = 3 * forward_flops(cfg, args.frames, args.height, args.width, cfg.model_max_length) * b
    return dict(impl=f"Open-Sora PyTorch (fp32, {r['threads']} threads)", device="cpu", step_s=r["step_s"],
                compile_s=None, samples_per_s=b / r["step_s"], tokens_per_s=tokens / r["step_s"],
                tflops=flops / r["step_s"] / 1e12, mfu=None, loss=None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset: tiny, demo, STDiT3-XL/2, STDiT3-3B/2")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--frames", type=int, default=4, help="latent frames")
    ap.add_argument("--height", type=int, default=16, help="latent height")
    ap.add_argument("--width", type=int, default=16, help="latent width")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (auto on H100/H200)")
    ap.add_argument("--reference", default=None, help="python of the refharness env: also time the PyTorch step")
    args = ap.parse_args(argv)

    import jaxsora  # noqa: F401
    from jaxsora.models.presets import get_model_config

    rows = [bench_jax(args)]
    if args.reference:
        rows.append(bench_reference(args, get_model_config(args.model)))
    print(f"\nSTDiT3 {args.model}: batch {args.batch}, latents {args.frames}×{args.height}×{args.width}, {args.dtype}"
          f"{', remat' if args.remat else ''}")
    print(f"{'implementation':<40} {'device':<22} {'step s':>9} {'samples/s':>10} {'tokens/s':>11} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'compile s':>9}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        comp = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        print(f"{r['impl']:<40} {r['device']:<22} {r['step_s']:>9.4f} {r['samples_per_s']:>10.2f} "
              f"{r['tokens_per_s']:>11.0f} {r['tflops']:>8.3f} {mfu:>6} {comp:>9}")
    if len(rows) == 2:
        print(f"speed ratio (PyTorch step time / jaxsora step time): {rows[1]['step_s'] / rows[0]['step_s']:.2f}×")
    return rows


if __name__ == "__main__":
    main()
