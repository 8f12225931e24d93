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

On CPU, run it as CPU jobs should run (docs/benchmarks.md): `GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python
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


def device_budget(args) -> int | None:
    """Bytes per device a step may plan into: --device-memory-gib, else the device's own limit (a GPU's
    `bytes_limit`, XLA_PYTHON_CLIENT_MEM_FRACTION of its memory), × the remat plan's share (as training's
    `train.remat_memory_fraction`); None on a device without one (CPU)."""
    from jaxsora.train.plan import memory

    gib = getattr(args, "device_memory_gib", None)
    if gib:
        return int(gib * memory.GIB * memory.REMAT_MEMORY_FRACTION)
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit * memory.REMAT_MEMORY_FRACTION) if limit else None


def batch_spec_of(spec: dict, batch: int) -> dict:
    """The abstract batch `spec` (a batch of any size) at `batch` rows."""
    import jax

    return {k: jax.ShapeDtypeStruct((batch, *v.shape[1:]), v.dtype, sharding=v.sharding) for k, v in spec.items()}


def bench_jax(s: Shape, args, norm_guard: float = 2.0, ref=None, cpu_matmul: str = "xla") -> dict:
    """jaxsora's step at shape s; with `ref`, the reference's steps run in alternation with these (INTERLEAVE
    of each in turn), and the row gets `ratios`: per block, its median step time over the reference's. `ref`: a
    ReferenceSession, or a function making one when this process's turn on the device comes (BENCH_STEP_LOCK:
    then it is also finished in that turn, its row under "reference_row", so that it holds the device's memory only
    while it is timed).
    s.remat "auto": the remat the train step's compile plan would choose for this batch in the device's memory
    (`memory.choose_remat`, `device_budget`); s.batch 0 ("max"): the largest batch whose step fits the device's
    memory with s.remat (auto: full, the remat that fits the most; `memory.largest_batch`), then the remat chosen
    for it.
    cpu_matmul: JAXSORA_CPU_MATMUL for this step's compile ("xla" or "onednn", `jaxsora.parallel.compile_options`)."""
    import jax

    import jaxsora.models  # noqa: F401
    from jaxsora.parallel import compile_options
    from jaxsora.parallel.mesh import logical_rules, make_mesh
    from jaxsora.parallel.sharding import abstract_of
    from jaxsora.train.plan import memory
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
    budget = device_budget(args)
    t0 = time.perf_counter()
    if s.batch == 0:  # "max": the largest batch that fits with full remat, by compiling (no step is run)
        if budget is None:
            raise SystemExit("--batch max needs a device memory limit: a GPU's, or --device-memory-gib")
        probe = abstract_of(inputs(cfg, dataclasses.replace(s, batch=mesh.devices.size), mesh))

        class Sizer:  # what memory.largest_batch reads of a run's setup
            data_parallel_size = mesh.devices.size
            encoders = type("E", (), {"weights": {}})

            @staticmethod
            def batch_spec(size, gb):
                return batch_spec_of(probe, gb)

        Sizer.step = step
        best = memory.largest_batch(Sizer, s.latent, budget, start=4)  # remat auto compiles as full here
        if best == 0:
            raise SystemExit(f"{s.name}: not even one sample fits {budget / 2**30:.1f} GiB with remat {s.remat}")
        progress(f"{s.name}: largest batch with remat {s.remat} in {budget / 2**30:.1f} GiB: {best} "
                 f"({time.perf_counter() - t0:.1f} s of compiles)")
        s = dataclasses.replace(s, batch=best * mesh.devices.size)
    batch = inputs(cfg, s, mesh)
    spec = abstract_of(batch)
    progress(f"{s.name}: tracing and lowering the step (norm guard {norm_guard:g})")
    remat = None
    if s.remat == "auto":
        # on a GPU the candidates compile at once: one XL/2 step compiles in minutes there (bench/gpu_step.sh)
        parallel = args.remat_parallel or (1 if jax.default_backend() == "cpu" else 4)
        choice, info, compiled, tried = memory.choose_remat(step, spec, {}, cfg.depth, budget, parallel=parallel)
        step.adopt(spec, compiled, info, choice)
        remat = choice.label(cfg.depth)
        lower_s = 0.0
        progress(f"{s.name}: remat auto in {'?' if budget is None else f'{budget / 2**30:.1f}'} GiB → {remat} "
                 f"(tried: {', '.join(f'{c.label(cfg.depth)} {p / 2**30:.2f} GiB' for c, p in tried)}), "
                 f"{time.perf_counter() - t0:.1f} s of compiles")
        info = dataclasses.replace(info, seconds=time.perf_counter() - t0)
    else:
        t0 = time.perf_counter()
        lowered = step.lower(spec, {})
        lower_s = time.perf_counter() - t0
        progress(f"{s.name}: lowered in {lower_s:.1f} s; compiling")
        info = step.compile(spec, {}, lowered=lowered)
    progress(f"{s.name}: compiled in {info.seconds:.1f} s")
    owned = ref is not None and not isinstance(ref, ReferenceSession)
    with timing_turn():
        if owned:
            ref = ref(s)
        t0 = time.perf_counter()
        state = jax.block_until_ready(init_state_sharded(plan))
        progress(f"{s.name}: state initialized in {time.perf_counter() - t0:.1f} s")
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
        reference_row = ref.finish() if owned else None  # its process ends here, its memory freed in this turn
        # what the kernel spends beside the step's own work: XLA:CPU allocates each execution's scratch buffer anew
        # (746 MB at `realistic`), above glibc's mmap threshold a fresh mapping whose every page faults in — 4 KB
        # pages, or huge pages with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (docs/benchmarks.md)
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
                breakdown=breakdown, ratios=ratios, batch=s.batch, remat=remat or s.remat, reference_row=reference_row)


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
ns = R.setup(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
a = json.loads(sys.argv[1])
cfg = dict(a["config"]); cfg["patch_size"] = tuple(cfg["patch_size"])
# "fp32": the CPU comparison (fp32, eval mode). "train": scripts/train.py's setup on the device there is: the model
# cast to bf16 with fp32 master weights for AdamW (ColossalAI's zero2 with bf16), gradient checkpointing of every
# block (set_grad_checkpoint), train mode (caption dropout) and its attention kernel (flash-attn, or SDPA, below)
mode = a.get("mode", "fp32")
dev = torch.device("cuda" if mode == "train" and torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if mode == "train" and dev.type == "cuda" else torch.float32
attention = "manual (fp32 softmax)"
if dev.type == "cuda":
    import types
    try:
        import flash_attn  # noqa: F401  # Open-Sora's enable_flash_attn path, as its configs run it
        attention = "flash-attn"
    except ImportError:
        # no flash-attn in the image: the same call (B, N, H, Dh layout, softmax_scale) through torch's fused SDPA
        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, **_):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, scale=softmax_scale)
            return out.transpose(1, 2)
        sys.modules["flash_attn"] = types.SimpleNamespace(flash_attn_func=flash_attn_func)
        attention = "SDPA"

    def cross_attention(query, key, value, attn_bias=None, p=0.0, scale=None, **_):
        # xformers' memory_efficient_attention over the block-diagonal mask (queries of sample i attend to its own
        # valid caption tokens), one fused SDPA call per sample; xformers is not in the image either
        if attn_bias is None:
            return torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=p).transpose(1, 2)
        outs, qs, ks = [], 0, 0
        for nq, nk in zip(attn_bias.q_seqlen, attn_bias.kv_seqlen):
            o = torch.nn.functional.scaled_dot_product_attention(
                query[:, qs:qs + nq].transpose(1, 2), key[:, ks:ks + nk].transpose(1, 2),
                value[:, ks:ks + nk].transpose(1, 2), dropout_p=p)
            outs.append(o.transpose(1, 2)); qs += nq; ks += nk
        return torch.cat(outs, dim=1)
    ns.blocks.xformers.ops.memory_efficient_attention = cross_attention
model = R.build(cfg, seed=0)
if mode == "train":
    from opensora.acceleration.checkpoint import set_grad_checkpoint
    set_grad_checkpoint(model)
    if dev.type == "cuda":
        for m in model.modules():  # the Attention layers' flash path (the parameters are the same)
            if hasattr(m, "enable_flash_attn"):
                m.enable_flash_attn = True
model = model.to(dev, dtype)
if mode == "train" and dev.type == "cuda":
    model.train()  # caption dropout (its token_drop calls .cuda())
else:
    model.eval()  # no caption dropout (CUDA-only upstream); the math of the step is otherwise the same
params = [p for p in model.parameters() if p.requires_grad]
# the optimizer's weights: fp32 masters of the bf16 model (ColossalAI's LowLevelZeroOptimizer), or the params
masters = params if dtype == torch.float32 else [p.detach().float().clone().requires_grad_(True) for p in params]
opt = torch.optim.AdamW(masters, lr=1e-4, eps=1e-15, weight_decay=0.0, **({"fused": True} if dev.type == "cuda"
                                                                          else {}))
# scripts/train.py runs `update_ema(ema, model, decay=ema_decay)` after every optimizer step
# (opensora/utils/train_utils.py: ema <- decay*ema + (1 - decay)*param for each trained parameter, from the fp32
# masters); written out here because that module imports ColossalAI.
ema = [m.detach().clone() for m in masters]
def update_ema(decay=0.99):
    with torch.no_grad():
        torch._foreach_mul_(ema, decay)
        torch._foreach_add_(ema, [m.detach() for m in masters], alpha=1 - decay)
rng = np.random.default_rng(0)
L = cfg["model_max_length"]
t, h, w = a["latent"]
lengths = list(a["caption_lengths"])
def to(x, dt=None):
    return torch.from_numpy(x).to(dev, dt or dtype)
def make_batch(b):
    """x [b, C, T, H, W], y [b, 1, L, Cc] and the batch's other tensors as scripts/train.py passes them (cast to the
    training dtype); caption lengths repeat the given ones."""
    global x, y, mask_np, extra
    x = to(rng.standard_normal((b, cfg["in_channels"], t, h, w)).astype(np.float32))
    y = to(rng.standard_normal((b, 1, L, cfg["caption_channels"])).astype(np.float32))
    mask_np = (np.arange(L)[None] < np.resize(np.asarray(lengths), b)[:, None]).astype(np.int64)
    extra = dict(mask=torch.from_numpy(mask_np).to(dev), fps=torch.full((b,), 24.0, device=dev, dtype=dtype),
                 height=torch.full((b,), 8.0 * h, device=dev, dtype=dtype),
                 width=torch.full((b,), 8.0 * w, device=dev, dtype=dtype),
                 num_frames=torch.full((b,), 17.0 * max(1, t // 5), device=dev, dtype=dtype))
sched = ns.RFlowScheduler(num_timesteps=1000, sample_method="logit-normal", use_timestep_transform=True)
torch.manual_seed(0)
def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()
def grads_of_one_batch():
    if mode == "fp32":  # the CPU comparison's draws: uniform t, numpy noise (as before)
        noise = rng.standard_normal(x.shape).astype(np.float32)
        tt = rng.uniform(0, 1000, b).astype(np.float32)
        loss, grads = R.training_loss(model, x.cpu().numpy(), noise, tt, y.cpu().numpy(), mask_np, grad=True)
        for n, p in model.named_parameters():
            if n in grads:
                p.grad = torch.from_numpy(grads[n])
        return
    loss = sched.training_losses(model, x, model_kwargs=dict(y=y, **extra))["loss"].mean()
    loss.backward()
    if masters is not params:
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
def update():
    torch.nn.utils.clip_grad_norm_(masters, 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    if masters is not params:  # the bf16 working weights from the updated masters
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    update_ema()
def step():
    grads_of_one_batch(); update(); sync()
b = a["batch"]
if b == 0:  # "max": the largest batch that fits the device, as Open-Sora's search_bs finds it by trying
    if dev.type != "cuda":
        sys.exit("--reference-batch max needs CUDA")
    # peak memory is affine in the batch (weights, masters, Adam, EMA, then activations per sample): two
    # measured steps give the line, the device's memory (less 5% for the allocator's fragments) the batch; then
    # one sample less until a step runs
    peaks = {}
    for n in (1, 2):
        make_batch(n); torch.cuda.reset_peak_memory_stats(); step()
        peaks[n] = torch.cuda.max_memory_allocated()
    # what this process may have: the device's free memory and what it holds already (other processes keep theirs)
    total = (torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()) * float(
        os.environ.get("BENCH_REF_MEM_FRACTION", "0.95"))
    b = max(1, int((total - peaks[1]) // max(1, peaks[2] - peaks[1])) + 1)
    while b > 1:
        try:
            make_batch(b); torch.cuda.reset_peak_memory_stats(); step(); break
        except torch.OutOfMemoryError:
            b -= 1; opt.zero_grad(set_to_none=True); model.zero_grad(set_to_none=True); torch.cuda.empty_cache()
make_batch(b)
step(); step()
if dev.type == "cuda":
    torch.cuda.reset_peak_memory_stats(); step()
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
out = dict(step_s=float(np.median(ts)), threads=torch.get_num_threads(), device=str(dev), dtype=str(dtype),
           attention=attention, mode=mode, batch=b)
if dev.type == "cuda":
    out.update(device_name=torch.cuda.get_device_name(), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
if a.get("profile") and dev.type == "cpu":
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
        """The reference at shape s, its batch s.batch, or with args.reference_batch "max" the largest batch that
        fits the device (CUDA only; found by the reference's process)."""
        cfg = model_config(s)
        conf = dict(depth=cfg.depth, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                    patch_size=list(cfg.patch_size), in_channels=cfg.in_channels,
                    caption_channels=cfg.caption_channels, model_max_length=cfg.model_max_length,
                    qk_norm=cfg.qk_norm, pred_sigma=cfg.pred_sigma)
        self.mode, self.peak_tflops = getattr(args, "reference_mode", "fp32"), getattr(args, "peak_tflops", None)
        self.cfg = cfg
        batch = 0 if getattr(args, "reference_batch", "same") == "max" else s.batch
        payload = json.dumps(dict(config=conf, batch=batch, latent=list(s.latent), profile=args.profile,
                                  # a batch found by the reference ("max") repeats these lengths
                                  caption_lengths=caption_lengths(s.batch or 64, cfg.model_max_length).tolist(),
                                  mode=self.mode))
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
        if r.get("batch", self.shape.batch) != self.shape.batch:  # "max": the batch the reference found
            b = r["batch"]
            self.model_flops = 3 * forward_flops(self.cfg, self.shape.latent, self.cfg.model_max_length) * b
            self.tokens = tokens(self.cfg, self.shape.latent, b)
        if r.get("mode", "fp32") == "train":
            dt = "bf16 + fp32 masters" if "bfloat16" in r["dtype"] else "fp32"
            impl = f"Open-Sora PyTorch ({dt}, grad ckpt, {r['attention']} attention, no apex fused LayerNorm)"
        else:
            impl = f"Open-Sora PyTorch (fp32, {r['threads']} thr)"
        device = r.get("device_name") or r.get("device", "cpu")
        peak = self.peak_tflops or ((device_peak_flops(device, r.get("dtype", "")) or 0) / 1e12 or None)
        tflops = self.model_flops / step_s / 1e12
        return dict(impl=impl, device=device, step_s=step_s, batch=r.get("batch", self.shape.batch), remat="grad ckpt"
                    if r.get("mode") == "train" else "none",
                    compile_s=None, tokens_per_s=self.tokens / step_s, model_tflops=tflops,
                    xla_tflops=None, mfu=tflops / peak if peak and r.get("device", "cpu") != "cpu" else None,
                    peak_gib=r.get("peak_gib"), loss=None,
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
    ap.add_argument("--batch", type=lambda v: 0 if v == "max" else int(v), default=2,
                    help="custom shape: global batch, or max (the largest that fits the device's memory)")
    ap.add_argument("--remat-parallel", type=int, default=0, help="--remat auto: candidates compiled at once "
                    "(0: 4 on a GPU, 1 on CPU)")
    ap.add_argument("--device-memory-gib", type=float, default=None, help="plan remat auto and --batch max into "
                    "this much per device (default: the device's own limit)")
    ap.add_argument("--reference-only", action="store_true", help="with --reference: time the reference alone (in "
                    "its turn on the device: BENCH_STEP_LOCK), jaxsora not at all")
    ap.add_argument("--reference-batch", default="same", choices=["same", "max"],
                    help="the reference's batch: jaxsora's, or the largest that fits (CUDA)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", default="none")
    ap.add_argument("--scan", action="store_true", help="model.scan_blocks")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (auto on H100/H200)")
    ap.add_argument("--reference", default=None, help="python of the refharness env: also time the PyTorch step")
    ap.add_argument("--reference-mode", default="fp32", choices=["fp32", "train"],
                    help="the reference's step: fp32 (the CPU comparison, eval mode) or train (scripts/train.py's "
                    "setup: on CUDA bf16 with fp32 masters, gradient checkpointing, flash-attn or SDPA, caption "
                    "dropout; on CPU gradient checkpointing in fp32)")
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
    # read by glibc at process start, in this process and the reference's alike (docs/install.md: run CPU jobs with
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
        if args.reference_only:  # the reference alone, in this process's turn on the device (bench/gpu_vs_opensora.sh)
            with timing_turn():
                ref = ReferenceSession(s, args)
                try:
                    while len(ref.times) < args.steps:
                        ref.steps(min(INTERLEAVE, args.steps - len(ref.times)))
                except BaseException:
                    ref.close()
                    raise
                results.append((s, [ref.finish()]))
            continue
        if args.reference and os.environ.get("BENCH_STEP_LOCK"):
            # processes taking turns on one device: the reference starts in this one's turn and ends with it
            rows = [bench_jax(s, args, float(g), lambda s_: ReferenceSession(s_, args), m)
                    for g in args.norm_guard.split(",") for m in args.cpu_matmul.split(",")]
            rows += [r.pop("reference_row") for r in list(rows) if r.get("reference_row")]
            results.append((s, rows))
            continue
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

    head = (f"{'shape':<14} {'implementation':<44} {'device':<16} {'batch':>5} {'remat':<14} {'step s':>8} "
            f"{'tokens/s':>9} {'model TF/s':>10} {'XLA TF/s':>9} {'MFU':>6} {'compile s':>9} {'peak GiB':>8}")
    print()
    print(head)
    print("-" * len(head))
    for s, rows in results:
        for r in rows:
            print(f"{s.name:<14} {r['impl']:<44} {r['device'][:16]:<16} {r.get('batch', s.batch):>5} "
                  f"{str(r.get('remat', s.remat))[:14]:<14} {r['step_s']:>8.4f} {r['tokens_per_s']:>9.0f} "
                  f"{r['model_tflops']:>10.3f} {fmt(r['xla_tflops'], '9.3f'):>9} "
                  f"{fmt(r['mfu'] and 100 * r['mfu'], '5.1f'):>6} {fmt(r['compile_s'], '9.1f'):>9} "
                  f"{fmt(r['peak_gib'], '8.2f'):>8}")
        if args.reference and not args.reference_only:
            ref = rows[-1]
            for r in rows[:-1]:
                q = np.asarray(r["ratios"])
                what = "step time"
                if r.get("batch", s.batch) != ref.get("batch", s.batch):  # each side at its own batch: per sample
                    q, what = q * ref["batch"] / r["batch"], "time per sample"
                print(f"{s.name:<14} {r['impl']} / Open-Sora {what}: {np.median(q):.2f} (median of {len(q)} "
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
