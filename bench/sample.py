"""Sampler benchmark: jaxsora's 30-step classifier-free-guided rectified-flow sampler
(`jaxsora.diffusion.rflow.sample`, the loop `python -m jaxsora.sample` runs) against Open-Sora 1.2's
`RFLOW.sample` (through the reference harness), with the same weights (ours, exported with
`jaxsora.convert.to_torch_state_dict` and loaded strict into the real STDiT3), the same initial noise,
caption states and text masks, back to back on this machine. Prints each side's wall time for the whole
loop (the first call, which compiles or reads the programs from jax's cache, is reported apart and not timed)
and the relative difference of the two outputs.

With --reference the two sides take turns: the reference's model is built once in a process of its own, which
samples once untimed (one step) and then on request, and each of the --repeat rounds runs the reference's loop
and then each of jaxsora's, back to back. The ratio printed is the median over rounds of jaxsora's time over the
reference's in the same round, with the range, and each side's time is its median: on this shared 2-core host the
same train step has read 1.0 s and 1.8 s within one minute, so one run of each side can be off by that much.

    python bench/sample.py --reference /tmp/refenv/bin/python                  # the listed shapes
    python bench/sample.py --shapes realistic --reference /tmp/refenv/bin/python --steps 30 --repeat 5
    python bench/sample.py --reference /tmp/refenv/bin/python --cpu-matmul xla,onednn   # also JAXSORA_CPU_MATMUL=onednn

Listed shapes (latent T×H×W; the text is the real caption size, 300 tokens × 4096, 40–150 valid):
  realistic   depth 4, hidden 384, 6 heads, 144p × 17 frames (5×18×32 latents → 720 tokens), batch 2
  wide        depth 4, hidden 768, 12 heads, 240p × 17 frames (5×30×40 latents → 1500 tokens), batch 1

The VAE and T5 are not timed (both sides take latents and text states). fp32 on both sides. On CPU, run it
with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 as CPU jobs should run (docs/benchmarks.md); the variable reaches
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
def run(steps):
    return R.rflow_sample(model, io["z"], io["y"], io["mask"], y_null=io["y_null"], num_sampling_steps=steps,
                          cfg_scale=7.0, fps=24.0, num_frames=io["num_frames"])
run(1)  # warm-up, untimed: PyTorch's first call (as jaxsora's first call, which compiles, is not timed either)
print("READY", flush=True)
for line in sys.stdin:  # one loop per line, timed, until "end"
    if line.strip() == "end":
        break
    t0 = time.perf_counter(); out = run(a["steps"]); dt = time.perf_counter() - t0
    np.save(a["out"], out)
    print("REF " + json.dumps(dict(seconds=dt, threads=torch.get_num_threads())), flush=True)
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


def jax_sampler(model, inputs, steps: int):
    """jaxsora's sampling loop on `inputs`, as a function of no arguments returning the output [B, C, T, H, W]."""
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

    return run


def timed(fn):
    """(fn's result, its wall time in s)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class ReferenceSampler:
    """Open-Sora's STDiT3 with the same weights and `RFLOW.sample` on the same inputs, in the refharness env's
    python, built once; `run()` samples once more and returns (output, seconds)."""

    def __init__(self, cfg, model, inputs, steps: int, python: str):
        from jaxsora.convert import save_torch_state_dict, to_torch_state_dict

        conf = dict(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                    patch_size=list(cfg.patch_size), in_channels=cfg.in_channels,
                    caption_channels=cfg.caption_channels, model_max_length=cfg.model_max_length,
                    qk_norm=cfg.qk_norm, pred_sigma=cfg.pred_sigma)
        harness = os.environ.get("REFHARNESS", os.path.join(HERE, "..", "..", "shared", "refharness"))
        self.dir = tempfile.TemporaryDirectory()
        d = self.dir.name
        weights, io, self.out = (os.path.join(d, n) for n in ("w.safetensors", "io.npz", "out.npy"))
        save_torch_state_dict(to_torch_state_dict(model), weights)
        np.savez(io, **inputs)
        job, script = os.path.join(d, "job.json"), os.path.join(d, "ref.py")
        with open(job, "w") as f:
            json.dump(dict(config=conf, weights=weights, inputs=io, out=self.out, steps=steps), f)
        with open(script, "w") as f:
            f.write(REF_SCRIPT)
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - its stderr, read if it fails; closed by close()
        self.proc = subprocess.Popen([python, script, job], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env={**os.environ, "REFHARNESS": harness})
        self.threads = None
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait()
        self.log.seek(0)
        err = self.log.read()[-3000:]
        self.close()
        raise RuntimeError(f"reference sampler failed:\n{err}")

    def run(self):
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        info = json.loads(self._expect("REF "))
        self.threads = info["threads"]
        return np.load(self.out), info["seconds"]

    def close(self):
        """End the process (killed if it is still running) and remove its files; once."""
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.stdin.write("end\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.dir.cleanup()


def bench_shape(name: str, args, matmuls: list) -> list:
    """The rows of one shape: per `JAXSORA_CPU_MATMUL` choice, jaxsora's loop timed --repeat times; with
    --reference, each round the reference's loop first, then each of jaxsora's."""
    from jaxsora.parallel import compile_options

    cfg, model, inputs = build(name)
    runs, rows = [], []
    for matmul in matmuls:
        os.environ[compile_options.ENV] = matmul  # read when the sampler's loop is jitted (rflow.programs)
        run = jax_sampler(model, inputs, args.steps)
        _, first = timed(run)  # compiles, or reads the programs from jax's persistent cache
        label = name + (" oneDNN" if compile_options.of_default_backend() else "")
        runs.append((matmul, run))
        rows.append(dict(shape=label, first_s=first, jax=[], ref=[]))
    ref = ReferenceSampler(cfg, model, inputs, args.steps, args.reference) if args.reference else None
    try:
        for k in range(args.repeat):
            ref_s = None
            if ref is not None:
                ref_out, ref_s = ref.run()
                progress(f"{name}: round {k + 1}/{args.repeat}: Open-Sora {ref_s:.2f} s")
            for (matmul, run), row in zip(runs, rows):
                os.environ[compile_options.ENV] = matmul
                out, seconds = timed(run)
                progress(f"{name}: round {k + 1}/{args.repeat}: {row['shape']} {seconds:.2f} s")
                row["jax"].append(seconds)
                if ref_s is not None:
                    row["ref"].append(ref_s)
                    row["rel_diff"] = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
    finally:
        if ref is not None:
            ref.close()
    for row in rows:
        row["jax_s"] = float(np.median(row["jax"]))
        if row["ref"]:
            ratios = [a / b for a, b in zip(row["jax"], row["ref"])]
            row.update(ref_s=float(np.median(row["ref"])), threads=ref.threads, ratio=float(np.median(ratios)),
                       ratio_range=(min(ratios), max(ratios)))
    t, h, w = SHAPES[name]["latent"]
    print(f"  {name}: depth {cfg.depth} hidden {cfg.hidden_size} heads {cfg.num_heads}, latents {t}×{h}×{w}, "
          f"batch {SHAPES[name]['batch']}, caption {cfg.model_max_length}×{cfg.caption_channels}, "
          f"{args.steps} steps, CFG 7", flush=True)
    return rows


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="realistic,wide", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=30, help="sampling steps (Open-Sora's default 30)")
    ap.add_argument("--reference", default=None, help="python of the refharness env: also time RFLOW.sample")
    ap.add_argument("--repeat", type=int, default=3, help="timed loops of each side, in turns (default 3)")
    ap.add_argument("--cpu-matmul", default="xla", help="XLA:CPU's matmul library (JAXSORA_CPU_MATMUL) to time side "
                    "by side: xla (the default), onednn, or xla,onednn")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    for name in args.shapes.split(","):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; listed: {', '.join(SHAPES)}")
    rows = [row for name in args.shapes.split(",") for row in bench_shape(name, args, args.cpu_matmul.split(","))]
    print(f"\n{'shape':<17} {'jaxsora s':>10} {'(1st call s)':>13} {'Open-Sora s':>12} {'ratio':>6} "
          f"{'(range)':>12} {'rel diff':>9}")
    for r in rows:
        if "ref_s" in r:
            lo, hi = r["ratio_range"]
            ref = f"{r['ref_s']:>12.2f} {r['ratio']:>6.2f} {f'{lo:.2f}–{hi:.2f}':>12} {r['rel_diff']:>9.1e}"
        else:
            ref = f"{'-':>12} {'-':>6} {'-':>12} {'-':>9}"
        print(f"{r['shape']:<17} {r['jax_s']:>10.2f} {r['first_s']:>13.1f} {ref}")
    if args.reference:
        print(f"(medians of {args.repeat} rounds; ratio: per round, jaxsora's time over Open-Sora's in that round)")
    return rows


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
