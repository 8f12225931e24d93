"""Device memory of every bucket before step 0, read from the compiled train step.

For each bucket shape of the plan the real step (the run's mesh, shardings, encoders, remat
policy) is lowered and compiled ahead of time, and XLA's `memory_analysis()` gives per device the
bytes of the arguments (state, batch, encoder weights), of the outputs, of what the donated state
saves, and of the temporaries (activations). Compiles run in parallel threads; the executables are
kept and are the ones training runs. A bucket fits when its peak is within the device's memory
(`train.device_memory_gib`, or what the device reports).

`model.remat="auto"`: for each bucket the plan compiles the step with the rungs of
`models.config.AUTO_REMAT_LADDER`, cheapest first — no remat, the named policies that keep the matmul
outputs (`save_matmuls`, then `save_qkv_proj`), partial remat (`full` on the first k block pairs, k from the
measured memory of none and full), full — and keeps the first whose peak is within
`train.remat_memory_fraction` of the device's memory (`choose_remat`). A bucket that fits without remat
compiles once; one that needs full remat four times (the persistent compilation cache keeps them all).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Sequence

import jax

from jaxsora.errors import UserError
from jaxsora.models.config import AUTO_REMAT_LADDER, RematChoice
from jaxsora.train.step.train_step import CompileInfo

GIB = 1 << 30


class EmptyPlanError(UserError):
    """The table gives no full global batch: nothing to train on."""


class MemoryPlanError(UserError, ValueError):
    """Some bucket of the plan cannot fit on the device: a user error (batch sizes, remat, mesh)."""


@dataclasses.dataclass
class BucketMemory:
    bucket: tuple  # (resolution, T, H, W) — pixel size
    global_batch: int
    per_device_batch: int
    tokens: int  # image tokens per sample
    info: CompileInfo
    limit: int | None  # device bytes, None when unknown
    remat: str = ""  # the blocks' remat in this bucket's step (with "auto": the choice, e.g. "full 12/28")
    tried: tuple = ()  # "auto": (label, peak bytes) of each remat compiled for this bucket, in order

    @property
    def fits(self) -> bool | None:
        return None if self.limit is None else self.info.peak_bytes <= self.limit


def device_memory_limit(config) -> int | None:
    """Bytes one device may use: `train.device_memory_gib` when set, else the `train.target`'s
    (`jaxsora.parallel.targets`), else the device's own `bytes_limit` (GPU/TPU), else None (CPU)."""
    gib = float(config.train.get("device_memory_gib", 0) or 0)
    if gib > 0:
        return int(gib * GIB)
    if config.train.get("target"):
        from jaxsora.parallel import targets

        return targets.parse(config.train.target).memory_bytes
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory stats
        stats = None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def compile_threads(config) -> int:
    n = int(config.train.get("compile_threads", 0) or 0)
    return n if n > 0 else max(1, min(8, os.cpu_count() or 1))


# The share of the device's memory "auto" remat may plan a bucket's step into: XLA's memory analysis does not
# count the allocator's fragmentation, the loader's pinned buffers or a second program resident at the same time
REMAT_MEMORY_FRACTION = 0.9


def remat_budget(config, limit: int | None) -> int | None:
    """Bytes per device that "auto" remat plans each bucket into (None: unknown, no remat is chosen)."""
    if limit is None:
        return None
    fraction = float(config.train.get("remat_memory_fraction", REMAT_MEMORY_FRACTION) or REMAT_MEMORY_FRACTION)
    return int(limit * fraction)


# Compiles of partial remat a bucket may take after its estimate (each k one more pair than the last)
PARTIAL_TRIES = 3


def choose_remat(step, spec: dict, encoders, depth: int, budget: int | None, parallel: int = 1, on_try=None):
    """The cheapest remat of the ladder whose compiled step fits `budget` bytes per device, for one bucket:
    (RematChoice, CompileInfo, compiled executable, tried), tried = ((choice, peak bytes), ...) in ladder order.
    Rungs: AUTO_REMAT_LADDER up to full; before full, partial remat — `full` on the first k pairs, the rest
    without, k = ⌈depth·(none − budget)/(none − full)⌉ from the two measured peaks (activation memory is close to
    linear in the rematerialized pairs), then one pair more at a time (PARTIAL_TRIES). Nothing fits: full, whose
    peak the memory check then refuses. budget None (a device without a memory limit): no remat.
    parallel > 1: that many candidates compile at once (the fixed rungs together, then the partial ones) — the
    wall time of about two compiles instead of up to seven, for as many times the compile work (bench/step.py on
    a GPU, where one XL/2 compile takes minutes); 1 (training's plan, whose buckets compile side by side
    already): one after another, stopping at the first that fits."""
    import concurrent.futures

    def measure(choices):
        if on_try is not None:  # what is compiling now (a target's XL/2 compile takes minutes)
            on_try(choices)
        if parallel > 1 and len(choices) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(parallel, len(choices))) as pool:
                done = list(pool.map(lambda c: step.compile_candidate(spec, encoders, c), choices))
        else:
            done = [step.compile_candidate(spec, encoders, c) for c in choices]
        return [(c, info, compiled) for c, (compiled, info) in zip(choices, done)]

    tried = []

    def first_fit(choices):
        """Compile `choices` (all at once, or one after another until one fits); the first that fits, or None."""
        batches = [choices] if parallel > 1 else [[c] for c in choices]
        for batch in batches:
            for got in measure(batch):
                tried.append((got[0], got[1].peak_bytes))
                if budget is None or got[1].peak_bytes <= budget:
                    return got
        return None

    ladder = list(AUTO_REMAT_LADDER)
    if budget is None:
        return _no_budget(step, spec, encoders)
    if parallel > 1:  # every fixed rung at once
        compiled = {}
        for got in measure(ladder):
            compiled[got[0]] = got
            tried.append((got[0], got[1].peak_bytes))
        fit = next((compiled[c] for c in ladder[:-1] if compiled[c][1].peak_bytes <= budget), None)
        full = compiled[ladder[-1]]
    else:
        fit = first_fit(ladder[:-1])
        if fit is None:
            (full,) = measure(ladder[-1:])
            tried.append((full[0], full[1].peak_bytes))
    if fit is not None:
        return (*fit, tuple(tried))
    none_peak = dict(tried)[ladder[0]]
    full_peak = full[1].peak_bytes
    if full_peak > budget or depth < 2 or none_peak <= full_peak:
        return (*full, tuple(tried))
    k = max(1, -(-depth * (none_peak - budget) // (none_peak - full_peak)))
    partial = [RematChoice("full", j) for j in range(k, min(depth, k + PARTIAL_TRIES))]
    fit = first_fit(partial)
    return (*(fit or full), tuple(tried))


def _no_budget(step, spec, encoders):
    """No device memory limit known: no remat, one compile."""
    choice = AUTO_REMAT_LADDER[0]
    compiled, info = step.compile_candidate(spec, encoders, choice)
    return choice, info, compiled, ((choice, info.peak_bytes),)


def _label(setup, choice: RematChoice | None) -> str:
    mcfg = setup.model_config
    if choice is None:
        choice = RematChoice("full" if mcfg.remat == "auto" else mcfg.remat, mcfg.remat_blocks)
    return choice.label(mcfg.depth)


def compile_buckets(setup, buckets: Sequence[tuple], *, limit: int | None, threads: int = 1,
                    progress: bool = True, budget: int | None = None) -> list[BucketMemory]:
    """buckets: [(bucket (res, T, H, W), global batch)]. The main thread lowers one bucket after
    another (tracing holds the GIL) and hands each to a pool where the XLA compiles run side by
    side in `threads` threads. With `model.remat="auto"` each bucket's worker runs `choose_remat` instead
    (its candidates lowered and compiled one after another), planning into `budget` bytes."""
    from tqdm import tqdm

    dp = setup.data_parallel_size
    auto = setup.model_config.remat == "auto"
    bar = tqdm(total=len(buckets), desc="compiling the train step per bucket" + (" (remat auto)" if auto else ""),
               unit="bucket", disable=not progress or not buckets)

    def row(bucket, gb, info, choice, tried=()):
        return BucketMemory(tuple(bucket), gb, gb // dp, setup.tokens_per_sample(bucket[1:]), info, limit,
                            _label(setup, choice), tuple((_label(setup, c), p) for c, p in tried))

    def compile_one(bucket, gb, spec, lowered):
        info = setup.step.compile(spec, setup.encoders.weights, lowered=lowered)
        bar.update(1)
        return row(bucket, gb, info, setup.step.remat_for(spec))

    def choose_one(bucket, gb, spec):
        def trying(choices):
            bar.set_postfix_str(f"{bucket[0]} {bucket[1]}f: remat {', '.join(_label(setup, c) for c in choices)}")

        choice, info, compiled, tried = choose_remat(setup.step, spec, setup.encoders.weights,
                                                     setup.model_config.depth, budget, on_try=trying)
        info = setup.step.adopt(spec, compiled, info, choice)
        bar.update(1)
        return row(bucket, gb, info, setup.step.remat_for(spec), tried)

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = []
        for bucket, gb in buckets:
            spec = setup.batch_spec(tuple(bucket[1:]), gb)
            if setup.step.compiled(spec):  # a step reused from an earlier run of the process (`setup_run`)
                futures.append(pool.submit(compile_one, bucket, gb, spec, None))
            elif auto:
                futures.append(pool.submit(choose_one, bucket, gb, spec))
            else:
                futures.append(pool.submit(compile_one, bucket, gb, spec,
                                           setup.step.lower(spec, setup.encoders.weights)))
        out = [f.result() for f in futures]
    bar.close()
    return out


def peak_bytes(setup, size: tuple, global_batch: int) -> int:
    """The compiled step's peak bytes per device for one shape (not kept for training)."""
    spec = setup.batch_spec(size, global_batch)
    return setup.step.compile(spec, setup.encoders.weights, keep=False).peak_bytes


def largest_batch(setup, size: tuple, limit: int, start: int, *, cap: int | None = None) -> int:
    """The largest per-device batch whose step fits in `limit` bytes, by compiling: peak memory is
    close to affine in the batch, so two compiles give an estimate, then a few more pin it down.
    `start`: a per-device batch to begin from; `cap`: never go above. 0 if one sample does not fit."""
    dp = setup.data_parallel_size
    cache: dict[int, int] = {}

    def peak(b):
        if b not in cache:
            cache[b] = peak_bytes(setup, size, b * dp)
        return cache[b]

    if peak(1) > limit:
        return 0
    hi = max(2, int(start))
    slope = max(1.0, (peak(hi) - peak(1)) / (hi - 1))
    guess = max(1, 1 + int((limit - peak(1)) // slope))
    if cap:
        guess = min(guess, cap)
    b = guess
    if peak(b) > limit:  # overshot: binary search in [1 (fits), b (does not))
        lo, hi = 1, b
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
        return lo
    while (cap is None or b < cap) and peak(b + 1) <= limit:
        b += 1
    return b


def backend_notes(model_config, platform: str = "cpu") -> list[str]:
    """What the compiled numbers on this platform (the mesh's) do not show (XLA:CPU specifics)."""
    if platform != "cpu":
        return []
    notes = []
    if model_config.remat != "none" and not model_config.scan_blocks:
        notes.append("XLA:CPU drops remat's optimization barriers, so unrolled remat saves no memory here (GPU and "
                     "TPU keep them): set model.scan_blocks=True for activation memory that holds on a GPU")
    if model_config.remat == "offload":
        notes.append("XLA:CPU has no host offload: remat 'offload' keeps the saved matmul outputs in device memory")
    return notes


def format_table(rows: Sequence[BucketMemory]) -> str:
    gb = lambda n: f"{n / GIB:8.2f}"  # noqa: E731
    head = (f"{'bucket (res, frames×H×W)':<30} {'global':>6} {'/dev':>5} {'tokens':>7} {'remat':<18} {'compile s':>9} "
            f"{'args GiB':>8} {'out GiB':>8} {'temp GiB':>8} {'peak GiB':>8}  fits")
    lines = [head, "-" * len(head)]
    for r in rows:
        res, t, h, w = r.bucket
        fits = "?" if r.fits is None else ("yes" if r.fits else "NO")
        lines.append(f"{f'{res} {t}×{h}×{w}':<30} {r.global_batch:>6} {r.per_device_batch:>5} {r.tokens:>7} "
                     f"{r.remat:<18} {r.info.seconds:>9.1f} {gb(r.info.argument_bytes)} {gb(r.info.output_bytes)} "
                     f"{gb(r.info.temp_bytes)} {gb(r.info.peak_bytes)}  {fits}")
    limit = next((r.limit for r in rows if r.limit), None)
    lines.append(f"device memory: {limit / GIB:.2f} GiB per device" if limit else
                 "device memory: unknown on this backend; plan for a GPU or TPU with --target (e.g. h100x8), or set "
                 "train.device_memory_gib")
    return "\n".join(lines)


def format_choices(rows: Sequence[BucketMemory], budget: int | None) -> str | None:
    """With remat "auto": per bucket, each remat compiled and its peak, the chosen one last (None: no auto)."""
    chosen = [r for r in rows if r.tried]
    if not chosen:
        return None
    where = f"{budget / GIB:.2f} GiB per device (train.remat_memory_fraction of the device)" if budget else \
        "no device memory limit known: no remat (--target h100x8 plans for a GPU)"
    lines = [f"remat auto: the cheapest remat whose step fits {where}:"]
    for r in chosen:
        res, t, h, w = r.bucket
        steps = ", ".join(f"{label} {peak / GIB:.2f}" for label, peak in r.tried)
        lines.append(f"  {f'{res} {t}×{h}×{w}':<28} → {r.remat:<18} (tried, GiB: {steps})")
    return "\n".join(lines)


def refusal(setup, rows: Sequence[BucketMemory]) -> str | None:
    """None when every bucket fits; else the message naming each bucket that does not, and the
    largest per-device batch that would."""
    bad = [r for r in rows if r.fits is False]
    if not bad:
        return None
    lines = [f"{len(bad)} bucket(s) of the plan do not fit in {bad[0].limit / GIB:.2f} GiB per device:"]
    for r in bad:
        res, t, h, w = r.bucket
        best = largest_batch(setup, (t, h, w), r.limit, r.per_device_batch, cap=r.per_device_batch)
        fix = f"largest per-device batch that fits: {best}" if best else "even one sample per device does not fit"
        lines.append(f"  {res} {t}×{h}×{w}: per-device batch {r.per_device_batch} needs "
                     f"{r.info.peak_bytes / GIB:.2f} GiB — {fix}")
    lines.append("lower those batch sizes in data.bucket_config (python -m jaxsora.tools.search_bs writes one), "
                 "or use model.remat / a larger mesh.fsdp or mesh.sequence")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the run's compiles: every bucket of the plan before step 0, a bucket first met later when it comes
# --------------------------------------------------------------------------------------------
def compile_plan(setup, loader) -> list:
    """Compile the step for each bucket shape of the current epoch's plan; refuse a plan with a
    bucket that does not fit. (A shape first met in a later epoch compiles when it comes.)"""
    config = setup.config
    described = loader.describe_plan(loader.epoch)
    shapes = [(b, gb) for b, n, gb, _ in described if n > 0]
    if not shapes:
        rows = getattr(loader, "num_rows", None)
        if rows == 0:
            raise EmptyPlanError(f"the table {config.data.get('table')} has no rows")
        per_bucket = ", ".join(f"{b[0]} {b[1]}f: {r} rows for a global batch of {gb}" for b, _, gb, r in described)
        raise EmptyPlanError(f"no bucket gets one full global batch from the table {config.data.get('table')} "
                             f"({per_bucket or 'no row fits any bucket'}); lower the batch sizes or add data "
                             "(python -m jaxsora.train ... --dry-run shows the plan)")
    note = loader.left_out_note(loader.epoch, described) if hasattr(loader, "left_out_note") else None
    if note and jax.process_index() == 0:
        print(f"[jaxsora.data] {note}", flush=True)
    limit = device_memory_limit(config)
    budget = remat_budget(config, limit)
    rows = compile_buckets(setup, shapes, limit=limit, threads=compile_threads(config),
                           progress=jax.process_index() == 0, budget=budget)
    choices = format_choices(rows, budget)
    if choices and jax.process_index() == 0:
        print(f"[jaxsora] {choices}", flush=True)
    if config.train.get("check_memory", True):
        msg = refusal(setup, rows)
        if msg:
            raise MemoryPlanError(msg)
    if jax.process_index() == 0 and rows:
        peak = max(rows, key=lambda r: r.info.peak_bytes)
        res, t, h, w = peak.bucket
        print(f"[jaxsora] compiled {len(rows)} bucket shape(s) in {sum(r.info.seconds for r in rows):.1f}s of "
              f"compile time; largest: {res} {t}×{h}×{w} at {peak.info.peak_bytes / GIB:.2f} GiB per device"
              + (f" of {limit / GIB:.2f}" if limit else ""))
    return rows


def compile_late(setup, batch, host) -> None:
    """A batch shape not compiled before step 0: a bucket first met in a later epoch, or captions cut
    to one of `data.text_lengths` (the plan compiles every bucket at the full caption length, the
    largest in memory; the cut batch runs with the remat chosen there). With remat "auto", a new bucket
    chooses its remat as the plan does."""
    from jaxsora.parallel.sharding import abstract_of

    spec = abstract_of(batch)
    limit = device_memory_limit(setup.config)
    choice = setup.step.remat_for(spec)
    if setup.model_config.remat == "auto" and choice is None:
        choice, info, compiled, _ = choose_remat(setup.step, spec, setup.encoders.weights, setup.model_config.depth,
                                                 remat_budget(setup.config, limit))
        info = setup.step.adopt(spec, compiled, info, choice)
    else:
        info = setup.step.compile(spec, setup.encoders.weights)
    if jax.process_index() == 0:
        text = int(batch["text_mask"].shape[1])
        remat = f", remat {_label(setup, setup.step.remat_for(spec))}" if setup.model_config.remat == "auto" else ""
        print(f"[jaxsora] compiled a new batch shape (bucket {host.get('bucket')}, captions of {text} tokens{remat}) "
              f"in {info.seconds:.1f}s: "
              f"{info.peak_bytes / GIB:.2f} GiB per device"
              + (f" of {limit / GIB:.2f}" + ("" if info.peak_bytes <= limit else " — MAY NOT FIT")
                 if limit else ""), flush=True)
