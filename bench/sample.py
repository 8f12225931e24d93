"""Sampler benchmark: jaxsora's 30-step classifier-free-guided rectified-flow sampler
(`jaxsora.diffusion.rflow.sample`, the loop `python -m jaxsora.sample` runs) against Open-Sora 1.2's
`RFLOW.sample` (through the reference harness), with the same weights (ours, exported with
`jaxsora.convert.to_torch_state_dict` and loaded strict into the real STDiT3), the same initial noise,
caption states and text masks, back to back on this machine. Prints each side's wall time for the whole
loop (the compile is reported apart, and not timed) and the relative difference of the two outputs.

    python bench/sample.py --reference /tmp/refenv/bin/python                  # the listed shapes
    python bench/sample.py --shapes realistic --reference /tmp/refenv/bin/python --steps 30
    python bench/sample.py --reference /tmp/refenv/bin/python --cpu-matmul xla,onednn   # also JAXSORA_CPU_MATMUL=onednn

Listed shapes (latent T×H×W; the text is the real caption size, 300 tokens × 4096, 40–150 valid):
  realistic   depth 4, hidden 384, 6 heads, 144p × 17 frames (5×18×32 latents → 720 tokens), batch 2
  wide        depth 4, hidden 768, 12 heads, 240p × 17 frames (5×30×40 latents → 1500 tokens), batch 1

The VAE and T5 are not timed (both sides take latents and text states). fp32 on both sides. On CPU, run it
with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 as CPU jobs should run (README, "Benchmarks"); the variable reaches
the reference's process too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

CAPTION = dict(caption_channels=4096, model_max_length=300)  # T5-XXL states, Open-Sora's caption length
SHAPES = {
    "realistic": dict(overrides=dict(depth=4, hidden_size=384, num_heads=6, **CAPTION), latent=(5, 18, 32), batch=2),
    "wide": dict(overrides=dict(depth=4, hidden_size=768, num_heads=12, **CAPTION), latent=(5, 30, 40), batch=1),
}

REF_SCRIPT = r'''
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.environ["REFHARNESS"])
import ref_stdit3 as R
R.setup(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
a = json.loads(open(sys.argv[1]).read())
cfg = dict(a["config"]); cfg["patch_size"] = tuple(cfg["patch_size"])
model = R.build(cfg, seed=0)
missing, unexpected = R.load_state_dict(model, a["weights"], strict=True)
assert not missing and not unexpected, (missing, unexpected)
model.eval()
io = np.load(a["inputs"])
def run():
    return R.rflow_sample(model, io["z"], io["y"], io["mask"], y_null=io["y_null"], num_sampling_steps=a["steps"],
                          cfg_scale=7.0, fps=24.0, num_frames=io["num_frames"])
t0 = time.perf_counter(); out = run(); dt = time.perf_counter() - t0
np.save(a["out"], out)
print("REF " + json.dumps(dict(seconds=dt, threads=torch.get_num_threads())))
'''


def build(name: str):
    import jax
    from flax import nnx

    from jaxsora.models.presets import get_model_config
    from jaxsora.models.stdit3 import STDiT3

    spec = SHAPES[name]
    cfg = get_model_config("STDiT3-XL/2", in_channels=4, **spec["overrides"])
    model = STDiT3(cfg, rngs=nnx.Rngs(0))
    # our init zeroes the temporal blocks' outputs and the final layer: perturb every weight, so that
    # every block shapes the output the two samplers are compared on
    rng = np.random.default_rng(1)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = np.asarray(var[...])
        var[...] = jax.numpy.asarray(v + 0.02 * rng.standard_normal(v.shape).astype(np.float32))
    b, L, D = spec["batch"], cfg.model_max_length, cfg.caption_channels
    t, h, w = spec["latent"]
    r = np.random.default_rng(0)
    valid = r.integers(40, 151, (b, 1))  # OpenVid-style captions: 40–150 of the 300 tokens
    inputs = dict(z=r.standard_normal((b, cfg.in_channels, t, h, w)).astype(np.float32),
                  y=r.standard_normal((b, 1, L, D)).astype(np.float32),
                  mask=(np.arange(L)[None] < valid).astype(np.int64),
                  y_null=np.broadcast_to(np.asarray(model.y_embedder.y_embedding[...])[None, None],
                                         (b, 1, L, D)).astype(np.float32),
                  num_frames=np.float32(17))
    return cfg, model, inputs


def bench_jax(model, inputs, steps: int):
    import jax
    import jax.numpy as jnp

    from jaxsora.data import text_length
    from jaxsora.diffusion import rflow

    b = inputs["z"].shape[0]
    t, h, w = inputs["z"].shape[2:]
    full = lambda v: jnp.full((b,), v, jnp.float32)  # noqa: E731
    # the prompts' tokens cut as `jaxsora.sample` cuts them (Pipeline._cut_text, the default data.text_lengths)
    mask = inputs["mask"].astype(np.int32)
    n = text_length.length_for(mask, text_length.DEFAULT_LENGTHS)
    cond = dict(y=inputs["y"][:, :, :n], mask=mask[:, :n], fps=full(24.0), height=full(8.0 * h),
                width=full(8.0 * w))
    y_null = inputs["y_null"][:, :, :n]

    def run():
        out = rflow.sample(model, inputs["z"], cond, y_null, key=jax.random.key(0), num_sampling_steps=steps,
                           cfg_scale=7.0, height=cond["height"], width=cond["width"], num_frames=full(17.0),
                           progress=False)
        return np.asarray(jax.block_until_ready(out))

    t0 = time.perf_counter()
    run()  # compile + first run
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0, first


def bench_reference(cfg, model, inputs, steps: int, python: str):
    from jaxsora.convert import save_torch_state_dict, to_torch_state_dict

    conf = dict(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, patch_size=list(cfg.patch_size),
                in_channels=cfg.in_channels, caption_channels=cfg.caption_channels,
                model_max_length=cfg.model_max_length, qk_norm=cfg.qk_norm, pred_sigma=cfg.pred_sigma)
    harness = os.environ.get("REFHARNESS", os.path.join(HERE, "..", "..", "shared", "refharness"))
    with tempfile.TemporaryDirectory() as d:
        weights, io, out = (os.path.join(d, n) for n in ("w.safetensors", "io.npz", "out.npy"))
        save_torch_state_dict(to_torch_state_dict(model), weights)
        np.savez(io, **inputs)
        job = os.path.join(d, "job.json")
        with open(job, "w") as f:
            json.dump(dict(config=conf, weights=weights, inputs=io, out=out, steps=steps), f)
        script = os.path.join(d, "ref.py")
        with open(script, "w") as f:
            f.write(REF_SCRIPT)
        r = subprocess.run([python, script, job], capture_output=True, text=True, env={**os.environ,
                                                                                       "REFHARNESS": harness})
        if r.returncode:
            raise RuntimeError(f"reference sampler failed:\n{r.stderr[-3000:]}")
        info = json.loads(r.stdout.split("REF ", 1)[1])
        return np.load(out), info["seconds"], info["threads"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="realistic,wide", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=30, help="sampling steps (Open-Sora's default 30)")
    ap.add_argument("--reference", default=None, help="python of the refharness env: also time RFLOW.sample")
    ap.add_argument("--cpu-matmul", default="xla", help="XLA:CPU's matmul library (JAXSORA_CPU_MATMUL) to time side "
                    "by side: xla (the default), onednn, or xla,onednn")
    args = ap.parse_args(argv)
    from jaxsora.parallel import compile_options

    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; listed: {', '.join(SHAPES)}")
        cfg, model, inputs = build(name)
        timed = []
        for matmul in args.cpu_matmul.split(","):
            os.environ[compile_options.ENV] = matmul  # read when the sampler's loop is jitted (rflow.programs)
            out, seconds, first = bench_jax(model, inputs, args.steps)
            label = name + (" oneDNN" if compile_options.of_default_backend() else "")
            timed.append((out, dict(shape=label, jax_s=seconds, compile_s=first - seconds)))
        if args.reference:
            ref, ref_s, threads = bench_reference(cfg, model, inputs, args.steps, args.reference)
            for out, row in timed:
                row.update(ref_s=ref_s, threads=threads, ratio=row["jax_s"] / ref_s,
                           rel_diff=float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
        rows += [row for _, row in timed]
        t, h, w = SHAPES[name]["latent"]
        print(f"  {name}: depth {cfg.depth} hidden {cfg.hidden_size} heads {cfg.num_heads}, latents {t}×{h}×{w}, "
              f"batch {SHAPES[name]['batch']}, caption {cfg.model_max_length}×{cfg.caption_channels}, "
              f"{args.steps} steps, CFG 7", flush=True)
    print(f"\n{'shape':<17} {'jaxsora s':>10} {'(compile s)':>12} {'Open-Sora s':>12} {'ratio':>6} {'rel diff':>9}")
    for r in rows:
        ref = (f"{r['ref_s']:>12.2f} {r['ratio']:>6.2f} {r['rel_diff']:>9.1e}" if "ref_s" in r
               else f"{'-':>12} {'-':>6} {'-':>9}")
        print(f"{r['shape']:<17} {r['jax_s']:>10.2f} {r['compile_s']:>12.1f} {ref}")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
