"""Train-step benchmark: per shape, step time, tokens/s, TFLOP/s and MFU, compile time and device
memory of jaxsora's real jitted step (`jaxsora.train.step.train_step.TrainStep` on a mesh of the local
devices); with `--reference`, the real Open-Sora PyTorch step at the same shape, side by side.

    python bench/step.py                                         # the listed shapes: tiny, realistic
    python bench/step.py --shapes realistic,wide,240p --reference /tmp/refenv/bin/python
    python bench/step.py --shapes h100                           # XL/2 240p×51 (remat) and 3B/2, bf16
    python bench/step.py --shapes realistic --reference /tmp/refenv/bin/python --profile   # where the time goes
    python bench/step.py --shapes realistic --profile --profile-top 30   # ... and its costliest non-matmul thunks
    python bench/step.py --shapes realistic --reference ... --cpu-matmul xla,onednn   # XLA:CPU's matmuls and oneDNN's
    python bench/step.py --model STDiT3-XL/2 --latent 15x30x53 --batch 4 --dtype bfloat16 --remat full
    python bench/step.py --model STDiT3-XL/2 --set depth=3,hidden_size=576,num_heads=9 --latent 5x24x42 \
        --reference /tmp/refenv/bin/python                      # a shape of your own, against the reference

Listed shapes (latent T×H×W; 240p × 51 frames = 15×30×53 latents):
  tiny       the `tiny` preset (the parity-test model): depth 2, hidden 64, caption 8×32, 4×16×16, batch 2
  realistic  depth 4, hidden 384, 6 heads, the real caption (300 tokens × 4096), 144p × 17 frames
             (5×18×32 latents → 720 tokens per sample), batch 2 — where the step's real costs show
  wide       depth 2, XL/2's width (hidden 1152, 16 heads), the real caption, 144p × 17 frames, batch 1
  240p       depth 2, hidden 768, 12 heads, the real caption, 240p × 17 frames (5×30×53 latents → 2025
             tokens per sample), batch 1 — toward stage 1's token counts
The realistic shapes' captions hold 40–150 valid tokens of the 300 (OpenVid-1M-style captions, as
bench/sample.py); the same lengths feed both implementations. jaxsora's batch is cut to the shortest of
configs/base.py's `data.text_lengths` that holds them, as the trainer cuts it; the reference packs the
valid tokens itself.
  h100       STDiT3-XL/2 at 240p × 51 frames (15×30×53), batch 4, bf16, remat full; STDiT3-3B/2 at
             144p × 51 frames (15×18×32), batch 4, bf16, remat full

The step is fed latents and text states directly (the frozen VAE and T5 are not timed); it is
otherwise the training step: rectified-flow loss with caption dropout, gradients, clipping, AdamW
and EMA, the state donated. The reference row is the real Open-Sora step as scripts/train.py runs
it: training_losses, backward, gradient clipping, AdamW and the EMA update. The two are timed in
alternation — blocks of INTERLEAVE steps of each in turn, the reference in a process kept alive
between its blocks — and the ratio printed is the median of the blocks' ratios, with their range: on
a shared host a slow minute then falls on both sides (sequential runs of the same programs have read
1.05× and 1.32× within the hour).

On CPU, run it as CPU jobs should run (README, "Benchmarks"): `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python
bench/step.py ...` — the variable reaches the reference's process too, so both sides run with it.

FLOPs, two ways (both printed): "model" is the formula below × 3 (forward + backward; the PaLM
convention, rematerialization not counted); "XLA" is the compiled step's cost analysis (everything
the executable does, recomputation and optimizer included). MFU uses the model count. The formula
per sample (matmuls 2·m·n·k; N = T·S image tokens, C width, L text tokens, d depth, 2d blocks):
    28·N·C²  qkv (6), self-attn proj (2), cross q (2) and proj (2), MLP (16)
  + 4·L·C²   cross-attention k/v of the text          + 4·N·L·C   cross-attention scores and sum
  + 4·T·S²·C (spatial blocks) or 4·S·T²·C (temporal)   self-attention scores and sum
plus the patch embedding, the final layer and the caption MLP. Peak: H100/H200 SXM dense 989
TFLOP/s in bf16 (495 in fp32 via TF32); elsewhere pass --peak-tflops.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxsora.train.plan.mfu import device_peak_flops, forward_flops

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

REALISTIC = dict(depth=4, hidden_size=384, num_heads=6, patch_size=(1, 2, 2), in_channels=4, caption_channels=4096,
                 model_max_length=300)


@dataclasses.dataclass
class Shape:
    name: str
    model: str  # preset
    latent: tuple  # (T, H, W)
    batch: int
    dtype: str = "float32"
    remat: str = "none"
    scan: bool = False
    overrides: dict = dataclasses.field(default_factory=dict)


SHAPES = {
    "tiny": [Shape("tiny", "tiny", (4, 16, 16), 2)],
    "realistic": [Shape("realistic", "STDiT3-XL/2", (5, 18, 32), 2, overrides=REALISTIC)],
    "wide": [Shape("wide", "STDiT3-XL/2", (5, 18, 32), 1, overrides=dict(REALISTIC, depth=2, hidden_size=1152,
                                                                         num_heads=16))],
    "240p": [Shape("240p", "STDiT3-XL/2", (5, 30, 53), 1, overrides=dict(REALISTIC, depth=2, hidden_size=768,
                                                                         num_heads=12))],
    "h100": [Shape("XL/2 240p×51", "STDiT3-XL/2", (15, 30, 53), 4, "bfloat16", "full"),
             Shape("3B/2 144p×51", "STDiT3-3B/2", (15, 18, 32), 4, "bfloat16", "full")],
}


def model_config(s: Shape, attention="auto"):
    from jaxsora.models.presets import get_model_config

    return get_model_config(s.model, compute_dtype=s.dtype, remat=s.remat, scan_blocks=s.scan,
                            attention_impl=attention, **s.overrides)


def tokens(cfg, latent, batch) -> int:
    pt, ph, pw = cfg.patch_size
    t, h, w = latent
    return batch * -(-t // pt) * -(-h // ph) * -(-w // pw)


def caption_lengths(batch: int, L: int) -> np.ndarray:
    """[batch] valid caption tokens: 40–150 of the real caption's 300 (OpenVid-1M-style captions), L/4..L for
    the short test captions. Seeded: both implementations get the same lengths."""
    rng = np.random.default_rng(1)
    lo, hi = (40, 150) if L >= 150 else (L // 4, L)
    return rng.integers(lo, hi + 1, batch)


def inputs(cfg, s: Shape, mesh):
    """A batch of latents and text states (numpy → global arrays on the mesh), its captions cut as the
    trainer cuts them (`data.text_lengths` of configs/base.py: the shortest length that holds them)."""
    from configs import base
    from jaxsora.data import text_length
    from jaxsora.parallel.sharding import host_to_global

    b, L = s.batch, cfg.model_max_length
    rng = np.random.default_rng(0)
    t, h, w = s.latent
    host = dict(
        video=rng.standard_normal((b, cfg.in_channels, t, h, w)).astype(np.float32),
        ids=rng.standard_normal((b, L, cfg.caption_channels)).astype(np.float32),
        text_mask=(np.arange(L)[None] < caption_lengths(b, L)[:, None]).astype(np.int32),
        fps=np.full((b,), 24.0, np.float32), height=np.full((b,), 8.0 * h, np.float32),
        width=np.full((b,), 8.0 * w, np.float32), num_frames=np.full((b,), 17.0 * max(1, t // 5), np.float32))
    n = text_length.length_for(host["text_mask"], base.get_config().data.text_lengths)
    return host_to_global(text_length.cut(host, n), mesh)


def progress(msg: str) -> None:
    """A line on stderr as the run goes (the table comes at the end): where a run cut short by a timeout was."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timing_turn():
    """With BENCH_STEP_LOCK=<file>, hold that file's lock while timing: several bench processes can then
    compile side by side (the slow part on a GPU) and still time their steps one at a time on the device.
    With BENCH_STEP_PEERS=N and BENCH_STEP_NAME, timing starts only once all N processes have compiled (a
    `.ready.<name>` file each beside the lock; the caller leaves `.done.<name>` for one that ended), so that no
    compile competes for the host cores with a timed step."""
    path = os.environ.get("BENCH_STEP_LOCK")
    if not path:
        yield
        return
    import fcntl
    import glob

    folder, peers = os.path.dirname(os.path.abspath(path)), int(os.environ.get("BENCH_STEP_PEERS", "1"))
    open(os.path.join(folder, ".ready." + os.environ.get("BENCH_STEP_NAME", str(os.getpid()))), "w").close()
    while len({f.rsplit(".", 1)[1] for f in glob.glob(os.path.join(folder, ".ready.*")) +
               glob.glob(os.path.join(folder, ".done.*"))}) < peers:
        time.sleep(1)
    with open(path, "a") as f:
        progress(f"waiting for the device ({path})")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# jaxsora's and the reference's steps alternate in blocks of this many timed steps, each block after the first
# preceded by an untimed one on either side: with glibc's huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) the
# first step after the other process's turn spent up to 5x the kernel time on its page faults (1.5 s at `240p`)
INTERLEAVE = 4


def bench_jax(s: Shape, args, norm_guard: float = 2.0, ref: ReferenceSession | None = None,
              cpu_matmul: str = "xla") -> dict:
    """jaxsora's step at shape s; with `ref`, the reference's steps run in alternation with these (INTERLEAVE
    of each in turn), and the row gets `ratios`: per block, its median step time over the reference's.
    cpu_matmul: JAXSORA_CPU_MATMUL for this step's compile ("xla" or "onednn", `jaxsora.parallel.compile_options`)."""
    import jax

    import jaxsora.models  # noqa: F401
    from jaxsora.parallel import compile_options
    from jaxsora.parallel.mesh import logical_rules, make_mesh
    from jaxsora.parallel.sharding import abstract_of
    from jaxsora.train.step.optim import AdamW
    from jaxsora.train.step.state import init_state_sharded, plan_state
    from jaxsora.train.step.train_step import TrainStep, make_train_step

    cfg = model_config(s, args.attention)
    mesh = make_mesh(dict(data=-1, fsdp=1, sequence=1))
    optimizer = AdamW.from_config(dict(lr=1e-4, warmup_steps=0, lr_schedule="constant", weight_decay=0.0))
    plan = plan_state(cfg, optimizer.tx(), 0, mesh, logical_rules(mesh))
    fn = make_train_step(plan.graphdef, optimizer, encode_video=lambda e, v, k: v, encode_text=lambda e, y, m: y,
                         scheduler_cfg=dict(sample_method="logit-normal", use_timestep_transform=True),
                         mask_ratios=None, ema_decay=0.99, max_norm_growth=norm_guard)
    os.environ[compile_options.ENV] = cpu_matmul  # read when the step is jitted (TrainStep)
    step = TrainStep(fn, plan)
    batch = inputs(cfg, s, mesh)
    spec = abstract_of(batch)
    progress(f"{s.name}: tracing and lowering the step (norm guard {norm_guard:g})")
    t0 = time.perf_counter()
    lowered = step.lower(spec, {})
    lower_s = time.perf_counter() - t0
    progress(f"{s.name}: lowered in {lower_s:.1f} s; compiling")
    info = step.compile(spec, {}, lowered=lowered)
    progress(f"{s.name}: compiled in {info.seconds:.1f} s; initializing the state")
    t0 = time.perf_counter()
    state = jax.block_until_ready(init_state_sharded(plan))
    progress(f"{s.name}: state initialized in {time.perf_counter() - t0:.1f} s")
    with timing_turn():
        for _ in range(2):  # warm-up (allocations, caches)
            state, m = step(state, batch, {})
        jax.block_until_ready(m)
        times, ratios, usage = [], [], []
        while len(times) < args.steps:
            block = []
            if times and ref:  # untimed: the first step after the reference's turn (see INTERLEAVE)
                state, m = step(state, batch, {})
                jax.block_until_ready(m["loss"])
            before = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(min(INTERLEAVE if ref else args.steps, args.steps - len(times))):
                t0 = time.perf_counter()
                state, m = step(state, batch, {})
                jax.block_until_ready(m["loss"])
                block.append(time.perf_counter() - t0)
                progress(f"{s.name}: step {len(times) + len(block)}/{args.steps} {block[-1]:.4f} s")
            usage.append((before, resource.getrusage(resource.RUSAGE_SELF)))
            times += block
            if ref:
                ratios.append(float(np.median(block) / np.median(ref.steps(len(block)))))
        # what the kernel spends beside the step's own work: XLA:CPU allocates each execution's scratch buffer anew
        # (746 MB at `realistic`), above glibc's mmap threshold a fresh mapping whose every page faults in — 4 KB
        # pages, or huge pages with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (README, "Benchmarks")
        def per_step(field):
            return sum(getattr(b, field) - getattr(a, field) for a, b in usage) / args.steps

        progress(f"{s.name}: per step {per_step('ru_minflt'):.0f} page faults, {per_step('ru_stime'):.3f} s kernel "
                 f"CPU, {per_step('ru_utime'):.3f} s user CPU")
        dt = float(np.median(times))
        breakdown = None
        if args.profile:
            state, breakdown = profile_jax(step, state, batch, args.profile_top)
    model_flops = 3 * forward_flops(cfg, s.latent, cfg.model_max_length) * s.batch
    n_dev = mesh.devices.size
    xla_flops = info.flops * n_dev if info.flops else None  # the cost analysis is per device
    kind = jax.devices()[0].device_kind.lower()
    peak = args.peak_tflops or ((device_peak_flops(kind, s.dtype) or 0) / 1e12 or None)
    onednn = ", oneDNN matmuls" if jax.default_backend() == "cpu" and compile_options.of_mesh(mesh) else ""
    gpu_xla = f", XLA {'+'.join(compile_options.gpu_variants())}" if compile_options.gpu_variants() else ""
    return dict(impl="jaxsora (JAX)" + (f", norm guard {norm_guard:g}" if norm_guard else ", no norm guard") + onednn
                + gpu_xla,
                device=f"{jax.devices()[0].device_kind} ×{n_dev}", step_s=dt,
                compile_s=lower_s + info.seconds, tokens_per_s=tokens(cfg, s.latent, s.batch) / dt,
                model_tflops=model_flops / dt / 1e12, xla_tflops=(xla_flops / dt / 1e12) if xla_flops else None,
                mfu=(model_flops / dt / 1e12 / (peak * n_dev)) if peak else None,
                peak_gib=info.peak_bytes / 2**30, loss=float(m["loss"]), text_tokens=int(batch["text_mask"].shape[1]),
                breakdown=breakdown, ratios=ratios)


PROFILED_STEPS = 3


def _hlo_instructions(hlo: str) -> dict:
    """name → (op_name metadata, kind, result shape) for every instruction of a compiled HLO text; kind is
    "matmul" (a dot or convolution, a fusion of one, or a cuBLAS call), "attention" (a cuDNN attention call)
    or "other"."""
    bodies, cur, out = {}, None, {}
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = bodies.setdefault(head.group(1), [])
            continue
        if cur is not None and line.startswith("  "):
            cur.append(line)
    for body in bodies.values():
        for line in body:
            m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
            op = m and re.search(r"([A-Za-z][\w\-]*)\(", m.group(2))
            if not op:
                continue
            op_name = re.search(r'op_name="([^"]*)"', line)
            called = re.search(r"calls=%?([\w.\-]+)", line)
            fused = bodies.get(called.group(1), []) if called else []
            target = re.search(r'custom_call_target="([^"]*)"', line)
            target = target.group(1) if target else ""
            if "fmha" in target or "cudnn$flash" in target.lower():
                kind = "attention"
            elif (op.group(1) in ("dot", "convolution") or "cublas" in target
                  or any(re.search(r" (dot|convolution)\(", f) for f in fused)):
                kind = "matmul"
            else:
                kind = "other"
            out[m.group(1)] = (op_name.group(1) if op_name else "", kind, m.group(2).split(" ", 1)[0])
    return out


# GPU kernels that carry no instruction name (cuBLAS and cuDNN library kernels inside a CUDA graph), by their
# kernel names: nvjet/xmma/cutlass are cuBLAS's GEMMs on Hopper, sdpa/flash/fmha cuDNN's attention.
_LIBRARY_KERNELS = (("matmul", ("nvjet", "gemm", "xmma", "cutlass", "cublas")),
                    ("attention", ("sdpa", "flash", "fmha", "cudnn")))
UNNAMED = "kernels without an instruction name"


def gpu_kernel_instruction(name: str, stats: dict, hlo: dict) -> str | None:
    """The HLO instruction a GPU kernel event ran: its `hlo_op` stat where the trace has one; else its kernel
    name, which XLA:GPU derives from the instruction's name with '.' written '_' (`loop_add_fusion_59` runs
    `loop_add_fusion.59`; an H200, jax 0.11.2, whose step ran as a CUDA graph, gave no `hlo_op` stat)."""
    for cand in (stats.get("hlo_op"), name, re.sub(r"_(\d+)$", r".\1", name)):
        if cand in hlo:
            return cand
    return None


def library_kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in _LIBRARY_KERNELS if any(m in low for m in marks)), "other")


def _device_events(data, hlo: dict):
    """(instruction name, start ns, duration ns) of the profiled device work. XLA:CPU: its thunk events, named
    by instruction. A GPU: every kernel of the device planes, named by its instruction where the trace tells
    (`gpu_kernel_instruction`), else `(UNNAMED, kind)` with the kind read off the kernel's name."""
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    for plane in gpu or data.planes:
        for line in plane.lines:
            for ev in line.events:
                if not gpu:
                    if ev.name in hlo:  # executor and thread-pool events, python frames
                        yield ev.name, ev.start_ns, ev.duration_ns
                    continue
                if ev.name.startswith("Memset") or ev.name.startswith("memcpy"):
                    continue
                inst = gpu_kernel_instruction(ev.name, dict(ev.stats), hlo)
                yield inst or (UNNAMED, library_kernel_kind(ev.name)), ev.start_ns, ev.duration_ns


def profile_jax(step, state, batch, top: int = 0) -> tuple:
    """Where one step's time goes: the profiler's trace (jax.profiler) of PROFILED_STEPS steps — XLA:CPU's
    thunks or a GPU's kernels — each named by its HLO instruction and put in a category by what it computes
    (a matmul, attention, or other) and where (autodiff's forward `jvp(...)`, its backward `transpose(jvp(...))`,
    or neither: the norms, clipping, AdamW, the guard, EMA). ms per step, summed over events — XLA:CPU runs
    independent thunks side by side, so the sum can exceed the step's wall time; "device busy" is the union of
    the events' intervals. top > 0: also print (stderr) the `top` costliest instructions that are not matmuls."""
    import glob

    import jax

    hlo = _hlo_instructions(next(iter(step.executables.values())).as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(PROFILED_STEPS):
                state, m = step(state, batch, {})
            jax.block_until_ready(m)
        trace = glob.glob(d + "/**/*.xplane.pb", recursive=True)[0]
        if os.environ.get("BENCH_PROFILE_KEEP"):  # a folder: keep the raw trace (xprof / tensorboard read it)
            import shutil

            os.makedirs(os.environ["BENCH_PROFILE_KEEP"], exist_ok=True)
            keep = os.path.join(os.environ["BENCH_PROFILE_KEEP"], os.environ.get("BENCH_STEP_NAME", "step"))
            shutil.copy(trace, keep + ".xplane.pb")
            with open(keep + ".hlo.txt", "w") as f:  # the compiled program: the trace's names are read against it
                f.write(next(iter(step.executables.values())).as_text())
        return state, breakdown(jax.profiler.ProfileData.from_file(trace), hlo, top)


def breakdown(data, hlo: dict, top: int = 0) -> dict:
    """ms per step by category from a trace (`jax.profiler.ProfileData`) of PROFILED_STEPS steps and the compiled
    step's `_hlo_instructions` (see profile_jax). Offline, on a kept trace: BENCH_PROFILE_KEEP."""
    events = list(_device_events(data, hlo))
    if not events:  # what the profiler wrote, to see why nothing matched
        for plane in data.planes:
            progress(f"profile plane {plane.name}: lines {[line.name for line in plane.lines][:12]}")
            for line in list(plane.lines)[:3]:
                for ev in list(line.events)[:2]:
                    progress(f"   {line.name}: {ev.name[:80]} {list(ev.stats)[:8]}")
    cats: dict = {}
    per: dict = {}  # (category, instruction) → ms per step
    for name, _, dur in events:
        if isinstance(name, tuple):  # a GPU library kernel with no instruction name: forward or backward unknown
            key = f"{name[0]}: {name[1]}"
        else:
            op_name, kind, _ = hlo[name]
            where = ("backward" if "transpose(jvp" in op_name else "forward" if "jvp(" in op_name
                     else "optimizer, norms, EMA")
            key = where if where.startswith("optimizer") else f"{where} {kind}"
            if kind == "matmul" and not op_name:  # a library fusion of a model's dot that kept no op_name (the
                key = "matmul, forward or backward"  # update has no matmul: before, they counted as the update's)
        ms = dur / 1e6 / PROFILED_STEPS
        cats[key] = cats.get(key, 0.0) + ms
        per[key, name] = per.get((key, name), 0.0) + ms
    busy, end = 0, None
    for start, dur in sorted((s, d) for _, s, d in events):
        lo = start if end is None else max(start, end)
        busy += max(0, start + dur - lo)
        end = start + dur if end is None else max(end, start + dur)
    cats["device busy (union of events)"] = busy / 1e6 / PROFILED_STEPS
    if top:  # the costliest instructions outside the matmuls, and how many each category runs
        counts = {k: sum(1 for c, _ in per if c == k) for k in cats if k in {c for c, _ in per}}
        progress("instructions per category: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
        rest = sorted(((ms, k, name) for (k, name), ms in per.items()
                       if "matmul" not in k and not isinstance(name, tuple)), reverse=True)
        for ms, k, name in rest[:top]:
            op_name, _, shape = hlo[name]
            progress(f"  {ms:7.2f} ms  {k:<22} {name:<32} {shape:<28} {op_name[-60:]}")
    return cats


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
# scripts/train.py runs `update_ema(ema, model, decay=ema_decay)` after every optimizer step
# (opensora/utils/train_utils.py: ema ← decay·ema + (1 − decay)·param for each trained parameter);
# written out here because that module imports ColossalAI.
ema = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
def update_ema(decay=0.99):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in ema:
                ema[n].mul_(decay).add_(p.data, alpha=1 - decay)
rng = np.random.default_rng(0)
b, L = a["batch"], cfg["model_max_length"]
t, h, w = a["latent"]
x = rng.standard_normal((b, cfg["in_channels"], t, h, w)).astype(np.float32)
y = rng.standard_normal((b, 1, L, cfg["caption_channels"])).astype(np.float32)
mask = (np.arange(L)[None] < np.asarray(a["caption_lengths"])[:, None]).astype(np.int64)
def grads_of_one_batch():
    noise = rng.standard_normal(x.shape).astype(np.float32)
    tt = rng.uniform(0, 1000, b).astype(np.float32)
    loss, grads = R.training_loss(model, x, noise, tt, y, mask, grad=True)
    for n, p in model.named_parameters():
        if n in grads:
            p.grad = torch.from_numpy(grads[n])
def update():
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    update_ema()
def step():
    grads_of_one_batch(); update()
step(); step()
# timed on request, interleaved with jaxsora's steps: a line "n" runs one untimed step (the first after jaxsora's
# turn, as jaxsora's side leaves its first untimed: see INTERLEAVE), then n timed ones, and answers their times;
# "end" ends
print("READY", flush=True)
ts = []
for line in sys.stdin:
    if line.strip() == "end":
        break
    block = []
    step()
    for _ in range(int(line)):
        t0 = time.perf_counter(); step(); block.append(time.perf_counter() - t0)
    ts += block
    print("TIMES " + json.dumps(block), flush=True)
out = dict(step_s=float(np.median(ts)), threads=torch.get_num_threads())
if a.get("profile"):
    # matmul self time from torch.profiler; the update (clip, AdamW, EMA) timed around its call
    from torch.profiler import ProfilerActivity, profile
    upd = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            grads_of_one_batch()
            t0 = time.perf_counter(); update(); upd.append(time.perf_counter() - t0)
    mm = sum(e.self_cpu_time_total for e in prof.key_averages()
             if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution",
                          "aten::_convolution", "aten::mkldnn_convolution", "aten::convolution_backward"))
    out.update(matmul_ms=mm / 1e3 / 3, update_ms=1e3 * float(np.mean(upd)))
print("REF " + json.dumps(out))
'''


class ReferenceSession:
    """The real Open-Sora step at shape s in its own process (the refharness env's python), built and warmed up
    once, then timed on request — `steps(n)` between blocks of jaxsora's steps, so that both sides are timed
    back to back in alternation and a slow minute of a shared host falls on both (on the 2-core machine the same
    step has read 2.4 s and 3.1 s within the hour)."""

    def __init__(self, s: Shape, args):
        cfg = model_config(s)
        conf = dict(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                    patch_size=list(cfg.patch_size), in_channels=cfg.in_channels,
                    caption_channels=cfg.caption_channels, model_max_length=cfg.model_max_length,
                    qk_norm=cfg.qk_norm, pred_sigma=cfg.pred_sigma)
        payload = json.dumps(dict(config=conf, batch=s.batch, latent=list(s.latent), profile=args.profile,
                                  caption_lengths=caption_lengths(s.batch, cfg.model_max_length).tolist()))
        harness = os.environ.get("REFHARNESS", os.path.join(HERE, "..", "..", "shared", "refharness"))
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(REF_SCRIPT)
        self.script, self.shape, self.times = f.name, s, []
        self.model_flops = 3 * forward_flops(cfg, s.latent, cfg.model_max_length) * s.batch
        self.tokens = tokens(cfg, s.latent, s.batch)
        progress(f"{s.name}: building and warming up the Open-Sora step")
        # its stderr, read if it fails (a pipe left unread could fill and stall it); closed by finish()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen([args.reference, self.script, payload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "REFHARNESS": harness})
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.proc.wait()
        self.log.seek(0)
        err = self.log.read()[-3000:]
        self.close()
        raise RuntimeError(f"reference step failed:\n{err}")

    def steps(self, n: int) -> list:
        """Run n Open-Sora steps now; their times (s)."""
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        block = json.loads(self._expect("TIMES "))
        self.times += block
        progress(f"{self.shape.name}: Open-Sora steps {', '.join(f'{t:.4f}' for t in block)} s")
        return block

    def close(self):
        """End the process (killed if it is still running: jaxsora's side failed) and remove its files; once."""
        if self.log.closed:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.unlink(self.script)
        self.log.close()

    def finish(self) -> dict:
        """End the process (with --profile, after its profile) and return the reference's row."""
        self.proc.stdin.write("end\n")
        self.proc.stdin.flush()
        r = json.loads(self._expect("REF "))
        self.proc.wait()
        self.close()
        step_s = float(np.median(self.times))
        return dict(impl=f"Open-Sora PyTorch (fp32, {r['threads']} thr)", device="cpu", step_s=step_s,
                    compile_s=None, tokens_per_s=self.tokens / step_s, model_tflops=self.model_flops / step_s / 1e12,
                    xla_tflops=None, mfu=None, peak_gib=None, loss=None,
                    breakdown=None if "matmul_ms" not in r else {
                        "matmul (forward + backward)": r["matmul_ms"], "optimizer, norms, EMA": r["update_ms"],
                        "other (forward + backward, wall − the two)": 1e3 * step_s - r["matmul_ms"] - r["update_ms"]})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,realistic", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--model", help="a custom shape instead: preset name")
    ap.add_argument("--latent", default="4x16x16", help="custom shape: latent T×H×W")
    ap.add_argument("--set", default="", metavar="K=V,...", help="custom shape: model config overrides, e.g. "
                    "depth=2,hidden_size=576,num_heads=9 (a shape none of the listed ones names)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", default="none")
    ap.add_argument("--scan", action="store_true", help="model.scan_blocks")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (auto on H100/H200)")
    ap.add_argument("--reference", default=None, help="python of the refharness env: also time the PyTorch step")
    ap.add_argument("--profile", action="store_true", help="also print where a step's time goes (XLA:CPU's "
                    "per-thunk trace; with --reference, the PyTorch step's matmul time and its update's time)")
    ap.add_argument("--profile-top", type=int, default=0, help="with --profile: also list this many of the "
                    "costliest non-matmul thunks (stderr)")
    ap.add_argument("--read-profile", metavar="PREFIX", help="instead of timing: the breakdown of a kept trace "
                    "(BENCH_PROFILE_KEEP wrote PREFIX.xplane.pb and PREFIX.hlo.txt), with --profile-top")
    ap.add_argument("--json", default=None, help="also write the rows to this file (JSON)")
    ap.add_argument("--norm-guard", default="2", help="train.max_param_norm_growth values to time side by side, "
                    "e.g. 0,2 (0: off; 2: the default)")
    ap.add_argument("--cpu-matmul", default="xla", help="XLA:CPU's matmul library (JAXSORA_CPU_MATMUL) to time side "
                    "by side: xla (the default), onednn, or xla,onednn")
    ap.add_argument("--dense-backward", default="custom", choices=["custom", "autodiff"],
                    help="the Linear layers' backward: layers.dense_matmul's (custom, the default) or autodiff's "
                    "(A/B of the weight-gradient form on another backend)")
    args = ap.parse_args(argv)
    # read by glibc at process start, in this process and the reference's alike (README: run CPU jobs with
    # glibc.malloc.hugetlb=1)
    progress(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
    with dense_backward(args.dense_backward):
        return _main(args)


@contextlib.contextmanager
def dense_backward(kind: str):
    """The Linear layers' matmul inside the block: `layers.dense_matmul` with its own backward ("custom") or the
    same contraction differentiated by jax ("autodiff")."""
    if kind == "custom":
        yield
        return
    from jaxsora.models import layers, lora

    def plain(x, w, precision=None):
        return layers._contract_last(x, w, precision)

    saved = layers.dense_matmul, lora.dense_matmul
    layers.dense_matmul = lora.dense_matmul = plain
    try:
        yield
    finally:
        layers.dense_matmul, lora.dense_matmul = saved


def _main(args):
    if args.read_profile:
        import jax

        with open(args.read_profile + ".hlo.txt") as f:
            hlo = _hlo_instructions(f.read())
        cats = breakdown(jax.profiler.ProfileData.from_file(args.read_profile + ".xplane.pb"), hlo, args.profile_top)
        for k, v in sorted(cats.items()):
            print(f"{k:<44} {v:9.1f} ms")
        return cats
    if args.model:
        overrides = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.set.split(",") if kv)}
        shapes = [Shape("custom", args.model, tuple(int(v) for v in args.latent.split("x")), args.batch, args.dtype,
                        args.remat, args.scan, overrides)]
    else:
        shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    results = []
    for s in shapes:
        ref = ReferenceSession(s, args) if args.reference else None
        try:
            rows = [bench_jax(s, args, float(g), ref, m) for g in args.norm_guard.split(",")
                    for m in args.cpu_matmul.split(",")]
        except BaseException:  # no Open-Sora process left waiting for its next block
            if ref:
                ref.close()
            raise
        if ref:
            rows.append(ref.finish())
        results.append((s, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(shape=dataclasses.asdict(s), rows=rows) for s, rows in results], f, indent=1, default=str)

    def fmt(v, f):
        return "-" if v is None else format(v, f)

    head = (f"{'shape':<14} {'implementation':<44} {'device':<16} {'step s':>8} {'tokens/s':>9} {'model TF/s':>10} "
            f"{'XLA TF/s':>9} {'MFU':>6} {'compile s':>9} {'peak GiB':>8}")
    print()
    print(head)
    print("-" * len(head))
    for s, rows in results:
        for r in rows:
            print(f"{s.name:<14} {r['impl']:<44} {r['device'][:16]:<16} {r['step_s']:>8.4f} {r['tokens_per_s']:>9.0f} "
                  f"{r['model_tflops']:>10.3f} {fmt(r['xla_tflops'], '9.3f'):>9} "
                  f"{fmt(r['mfu'] and 100 * r['mfu'], '5.1f'):>6} {fmt(r['compile_s'], '9.1f'):>9} "
                  f"{fmt(r['peak_gib'], '8.2f'):>8}")
        if args.reference:
            for r in rows[:-1]:
                q = r["ratios"]
                print(f"{s.name:<14} {r['impl']} / Open-Sora step time: {np.median(q):.2f} (median of {len(q)} "
                      f"alternating blocks of {INTERLEAVE} steps each, {min(q):.2f}–{max(q):.2f})")
    if args.profile:
        print("\nwhere a step's time goes (ms per step; jaxsora: XLA:CPU thunks, which may overlap, or GPU kernels)")
        for s, rows in results:
            for r in rows:
                for k, v in sorted((r.get("breakdown") or {}).items()):
                    print(f"{s.name:<14} {r['impl']:<44} {k:<44} {v:9.1f}")
    for s, rows in results:
        cfg = model_config(s)
        lens = caption_lengths(s.batch, cfg.model_max_length)
        print(f"  {s.name}: {s.model} depth {cfg.depth} hidden {cfg.hidden_size} heads {cfg.num_heads}, latents "
              f"{'×'.join(map(str, s.latent))}, batch {s.batch}, caption {cfg.model_max_length}×"
              f"{cfg.caption_channels} ({', '.join(map(str, lens))} valid; jaxsora runs it cut to "
              f"{rows[0].get('text_tokens', cfg.model_max_length)}), {s.dtype}, remat {s.remat}"
              f"{', scan' if s.scan else ''}")
    return results


if __name__ == "__main__":
    main()
