"""Validation loss on a held-out table: Open-Sora 1.2's eval loss (spec §2.3, `eval/loss/eval_loss.py`)
run inside training every `eval.every` steps.

What is measured, as the reference: for every (resolution, num_frames) entry of `eval.bucket_config`,
every row of `eval.table` that can fill that bucket (the training bucket rule applied to the
one-bucket config `{res: {frames: (1.0, batch)}}`, so a long, large clip counts in several buckets, as
upstream builds one dataset per bucket) is encoded, noised at each of the fixed timesteps
`linspace(0, 1000, eval.num_timesteps + 2)[1:-1]` (no logit-normal draw, no shift) and scored with the
rectified-flow loss without frame masks and without caption dropout. A bucket's figure is the
sample mean at each t, averaged over the t's; `eval/loss` is the mean over the buckets evaluated.

Deterministic by construction, so values compare across runs, resumes and meshes:
- the plan is a function of the table and the config only (table order within each aspect-ratio
  group, the first `eval.max_batches_per_bucket` batches of each bucket); the last batch of a
  bucket is padded to the global batch with weight-0 rows, so every row counts once whatever the
  data-parallel size;
- every random number comes from `eval.seed` and where it is used, never from the train step or the
  train RNG: the noise of row r at timestep index i in bucket b is
  `normal(fold_in(fold_in(fold_in(fold_in(key(seed), 1), code(b)), r), i))` (per row, so it does not
  depend on how rows are batched), the VAE's posterior sample of batch j of bucket b uses
  `fold_in(fold_in(fold_in(key(seed), 0), code(b)), j)`, and the temporal crop of row r in a bucket
  of T frames uses `numpy.random.default_rng([seed, r, T])`; code(b) = crc32 of "<res>_<frames>".
- a row that cannot be decoded is left out (weight 0; counted in `eval/skipped` and not decoded again).

The weights evaluated are the trained parameters (`eval.use_ema=False`, what the reference's eval
script loads from a checkpoint's `model/`), or the EMA (`eval.use_ema=True`).

The evaluation is a separate jitted function (loss only: no gradients, no state update, nothing
donated), traced under the run's mesh and logical-axis rules like the train step and compiled once
per bucket shape before step 0 (its memory is checked against the device like the train step's).
Its per-batch outputs stay on the device; one transfer per evaluation fetches them.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import sys
import threading
import time
import zlib
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.data.video import to_model_range
from jaxsora.diffusion import rflow
from jaxsora.errors import UserError
from jaxsora.parallel.constraints import logical_rules
from jaxsora.parallel.sharding import abstract_of, batch_sharding, host_to_global
from jaxsora.train.step import CompileInfo, batch_key, batch_spec, global_batch

# Open-Sora's eval config seeds with 42.
EVAL_SEED = 42
# Stream tags folded into the eval key: the VAE posterior sample and the diffusion noise.
_VAE_STREAM, _NOISE_STREAM = 0, 1
# Eval batches dispatched ahead of the device (as the train loop's MAX_IN_FLIGHT).
MAX_IN_FLIGHT = 2


class EvalPlanError(UserError, ValueError):
    """The eval table gives nothing to evaluate, or an eval bucket does not fit the device."""


def enabled(config) -> bool:
    ecfg = config.get("eval")
    return bool(ecfg is not None and ecfg.get("table"))


def bucket_name(res: str, frames: int) -> str:
    """The logged name of an eval bucket: `<res>_<frames>` (metrics `eval/loss/<res>_<frames>`)."""
    return f"{res}_{int(frames)}"


def bucket_code(name: str) -> int:
    """A bucket's stream id in the eval keys (crc32 of its name, 31 bits)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------
# the pure eval function
# --------------------------------------------------------------------------------------------
def noise_key(seed: int, code, row, t_index):
    """The key of one row's noise at one timestep index (see the module docstring)."""
    k = jax.random.fold_in(jax.random.key(int(seed)), _NOISE_STREAM)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(k, code), row), t_index)


def vae_key(seed: int, code, batch_index):
    k = jax.random.fold_in(jax.random.key(int(seed)), _VAE_STREAM)
    return jax.random.fold_in(jax.random.fold_in(k, code), batch_index)


def eval_noise(seed: int, code, rows, t_index, shape) -> jax.Array:
    """[B, *shape] float32: each row's own noise at timestep index `t_index`."""
    return jax.vmap(lambda r: jax.random.normal(noise_key(seed, code, r, t_index), tuple(shape), jnp.float32))(
        jnp.asarray(rows))


def make_eval_fn(graphdef, *, encode_video: Callable, encode_text: Callable,
                 num_timesteps: int = rflow.NUM_EVAL_TIMESTEPS, seed: int = EVAL_SEED):
    """Returns `eval_fn(weights, frozen, batch, encoders, ids) -> {"loss_sum": [n], "count": []}`, a
    pure function (to be jitted by the caller): for each of the n fixed timesteps, Σ_rows weight ·
    per-sample loss; and Σ weight.

    batch: the train step's batch (video uint8 [B, 3, T, H, W], ids, text_mask, fps, height, width,
    num_frames) plus row [B] int32 (table rows: the noise streams) and weight [B] float32 (0 for
    padding and rows that failed to decode). ids: uint32 [2] = (bucket code, batch index in the
    bucket), replicated. No frame masks, no caption dropout, no state.
    """
    ts = rflow.eval_timesteps(num_timesteps)

    def eval_fn(weights, frozen, batch, encoders, ids):
        code, index = ids[0], ids[1]
        video = batch["video"]
        if video.dtype == jnp.uint8:
            video = to_model_range(video)
        x0 = encode_video(encoders, video, vae_key(seed, code, index)).astype(jnp.float32)
        y = encode_text(encoders, batch["ids"], batch["text_mask"])[:, None]
        cond = dict(y=y, mask=batch["text_mask"], fps=batch["fps"], height=batch["height"], width=batch["width"])
        model = nnx.merge(graphdef, weights, frozen)
        b = x0.shape[0]

        def one(i):
            noise = eval_noise(seed, code, batch["row"], i, x0.shape[1:])
            t = jnp.full((b,), jnp.asarray(ts)[i])
            return rflow.training_loss_explicit(model, x0, cond, noise, t)

        losses = jax.lax.map(one, jnp.arange(num_timesteps))  # [n, B]
        w = batch["weight"].astype(jnp.float32)
        return dict(loss_sum=jnp.sum(losses * w[None], axis=1), count=jnp.sum(w))

    return eval_fn


class EvalStep:
    """The eval function jitted for the run's mesh, like `train.step.TrainStep`: traced, compiled and
    called under `jax.set_mesh(mesh)` and the logical-axis rules; one executable per batch shape;
    outputs replicated; nothing donated. `use_ema`: evaluate the EMA instead of the params."""

    def __init__(self, eval_fn: Callable, plan, *, use_ema: bool = False):
        self.eval_fn, self.plan, self.use_ema = eval_fn, plan, bool(use_ema)
        self.mesh, self.rules = plan.mesh, plan.rules
        self._jit = jax.jit(self._traced, out_shardings=plan.replicated)
        self.executables: dict = {}
        self.info: dict = {}
        self._lock = threading.Lock()

    def _traced(self, weights, frozen, batch, encoders, ids):
        with logical_rules(self.rules):
            return self.eval_fn(weights, frozen, batch, encoders, ids)

    def weights(self, state):
        return (state.ema if self.use_ema else state.params), state.frozen

    def ids(self, code: int, index: int) -> jax.Array:
        value = np.array([code, index], np.uint32)
        return jax.make_array_from_callback((2,), self.plan.replicated, lambda idx: value[idx])

    def _abstract_ids(self):
        return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.plan.replicated)

    def lower(self, spec: dict, encoders):
        abstract = self.plan.abstract_sharded
        with jax.set_mesh(self.mesh):
            return self._jit.lower(abstract.ema if self.use_ema else abstract.params, abstract.frozen, spec,
                                   encoders, self._abstract_ids())

    def compile(self, spec: dict, encoders, lowered=None) -> CompileInfo:
        """Compile (once) the executable for this batch shape; thread-safe."""
        key = batch_key(spec)
        if key in self.info:
            return self.info[key]
        t0 = time.perf_counter()
        compiled = (lowered if lowered is not None else self.lower(spec, encoders)).compile()
        info = CompileInfo.of(compiled, time.perf_counter() - t0)
        with self._lock:
            self.executables.setdefault(key, compiled)
            self.info.setdefault(key, info)
        return self.info[key]

    def __call__(self, state, batch: dict, encoders, ids) -> dict:
        key = batch_key(batch)
        if key not in self.executables:
            self.compile(abstract_of(batch), encoders)
        weights, frozen = self.weights(state)
        with jax.set_mesh(self.mesh):
            return self.executables[key](weights, frozen, batch, encoders, ids)


def eval_batch_spec(size: tuple, batch: int, text_spec: dict, mesh) -> dict:
    """The eval function's abstract batch: the train step's plus row and weight."""
    spec = batch_spec(size, batch, text_spec, mesh)
    spec["row"] = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=batch_sharding(mesh, 1))
    spec["weight"] = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=batch_sharding(mesh, 1))
    return spec


def eval_global_batch(host: dict, mesh) -> dict:
    """A host eval batch → the eval function's global arrays."""
    out = global_batch(host, mesh)
    out.update(host_to_global(dict(row=np.asarray(host["row"], np.int32),
                                   weight=np.asarray(host["weight"], np.float32)), mesh))
    return out


# --------------------------------------------------------------------------------------------
# the plan and the data
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EvalBatch:
    name: str  # "<res>_<frames>"
    bucket: tuple  # (res, frames, aspect-ratio key)
    size: tuple  # (T, H, W) pixels
    index: int  # batch index within `name`
    rows: np.ndarray  # [global batch] table rows; padding repeats the first row
    real: int  # the leading `real` rows are evaluated, the rest are padding


def normalize_eval_buckets(bucket_config) -> list[tuple[str, int, int]]:
    """[(res, frames, per-device batch)] in config order; entries with batch None or keep 0 are off.
    Accepts the data format {res: {frames: (keep_prob, batch)}} or {res: {frames: batch}}."""
    out = []
    for res, frames in dict(bucket_config).items():
        for f, v in dict(frames).items():
            keep, bs = (v if isinstance(v, (tuple, list)) else (1.0, v))
            if bs is None or (not isinstance(keep, (tuple, list)) and float(keep) <= 0):
                continue
            out.append((str(res), int(f), int(bs)))
    return out


def eval_plan(sizes, bucket_config, *, dp: int, frame_interval: int = 1, extra_resolutions=None,
              max_batches_per_bucket: int = 0) -> list[EvalBatch]:
    """Every eval batch, a function of the table sizes (num_frames, height, width: [N] each) and the
    config only. For each (res, frames) entry: the rows the training bucket rule puts into the
    one-bucket config {res: {frames: (1.0, batch)}}, grouped by aspect ratio (first appearance), in
    table order, cut into global batches of batch × dp, the last one padded; at most
    `max_batches_per_bucket` batches per entry (0: all)."""
    from jaxsora.data.buckets import Buckets
    from jaxsora.data.plan import assign_rows

    plan = []
    for res, f, bs in normalize_eval_buckets(bucket_config):
        buckets = Buckets({res: {f: (1.0, bs)}}, extra_resolutions)
        groups = assign_rows(sizes, buckets, seed=0, epoch=0, frame_interval=frame_interval)  # keep 1: no draw
        name, gbs, index = bucket_name(res, f), bs * dp, 0
        for bucket, rows in groups.items():
            size = buckets.target_size(bucket)
            for start in range(0, len(rows), gbs):
                if max_batches_per_bucket and index >= max_batches_per_bucket:
                    break
                chunk = np.asarray(rows[start:start + gbs], np.int64)
                real = len(chunk)
                if real < gbs:
                    chunk = np.concatenate([chunk, np.full(gbs - real, chunk[0], np.int64)])
                plan.append(EvalBatch(name, tuple(bucket), tuple(int(v) for v in size), index, chunk, real))
                index += 1
    return plan


class EvalData:
    """The held-out table's batches in the plan's order (`eval_plan`), decoded anew at every
    evaluation in background threads (`decode_threads` batches at a time); this host's share of
    each global batch. Iterating yields (EvalBatch, host batch); a host batch is the loader's format
    (video uint8, text, ids/text_mask from `text_inputs`, fps/height/width/num_frames) plus row and
    weight."""

    def __init__(self, table: str, bucket_config, *, seed: int = EVAL_SEED, data_parallel_size: int = 1,
                 process_index: int = 0, process_count: int = 1, frame_interval: int = 1,
                 extra_resolutions=None, max_batches_per_bucket: int = 0, index_dir: Optional[str] = None,
                 text_inputs: Optional[Callable] = None, decode_threads: int = 1, progress: bool = True):
        from jaxsora.data.tables import TableIndex

        if index_dir and int(process_count) > 1:
            index_dir = f"{index_dir.rstrip('/')}/host{int(process_index)}"
        self.table = TableIndex.build(table, index_dir, progress=progress)
        self.seed, self.frame_interval = int(seed), int(frame_interval)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.text_inputs, self.decode_threads = text_inputs, max(1, int(decode_threads))
        sizes = (self.table.num_frames, self.table.height, self.table.width)
        self.plan = eval_plan(sizes, bucket_config, dp=int(data_parallel_size), frame_interval=self.frame_interval,
                              extra_resolutions=extra_resolutions, max_batches_per_bucket=int(max_batches_per_bucket))
        if any(len(b.rows) % self.process_count for b in self.plan):
            raise ValueError(f"eval global batches must divide over {self.process_count} processes")
        self.bad_rows: dict[tuple, str] = {}  # (row, T, H, W) → skip reason: left out of later evaluations
        self.skip_counts: collections.Counter = collections.Counter()

    def shapes(self) -> list[tuple[str, tuple, int]]:
        """[(name, (res, T, H, W), global batch)] per distinct batch shape, in plan order."""
        seen = {}
        for b in self.plan:
            seen.setdefault((b.size, len(b.rows)), (b.name, (b.bucket[0], *b.size), len(b.rows)))
        return list(seen.values())

    def describe(self) -> dict:
        """{name: (rows evaluated, batches)}."""
        out: dict = {}
        for b in self.plan:
            rows, n = out.get(b.name, (0, 0))
            out[b.name] = (rows + b.real, n + 1)
        return out

    def _sample(self, row: int, size: tuple):
        from jaxsora.data.video import DecodeError, load_sample

        t, h, w = size
        if (row, *size) in self.bad_rows:
            return None
        try:
            if not self.table.text(row).strip():
                raise DecodeError(f"empty caption for {self.table.path(row)}", "empty_caption")
            video, fps = load_sample(self.table.path(row), t, h, w, frame_interval=self.frame_interval,
                                     rng=np.random.default_rng([self.seed, row, t]),
                                     num_frames_hint=int(self.table.num_frames[row]))
            if video.shape != (3, t, h, w) or video.dtype != np.uint8:
                raise DecodeError(f"{self.table.path(row)} decoded to {video.dtype} {video.shape}", "bad_shape")
            return video, fps
        except DecodeError as e:
            self.bad_rows[(row, *size)] = e.reason
            self.skip_counts[e.reason] += 1
            msg = " ".join(str(e).split())
            print(f"[jaxsora.eval] row {row} left out of the eval ({e.reason}): {msg}", file=sys.stderr, flush=True)
            return None

    def host_batch(self, b: EvalBatch) -> dict:
        share = len(b.rows) // self.process_count
        slots = range(self.process_index * share, (self.process_index + 1) * share)
        t, h, w = b.size
        videos, fps, weight = [], [], []
        for s in slots:
            got = self._sample(int(b.rows[s]), b.size) if s < b.real else None
            videos.append(got[0] if got else np.zeros((3, t, h, w), np.uint8))
            fps.append(got[1] if got else 24.0)
            weight.append(1.0 if got else 0.0)
        rows = np.asarray([b.rows[s] for s in slots], np.int64)
        texts = [self.table.text(int(r)) for r in rows]
        extra = self.text_inputs(texts, rows) if self.text_inputs is not None else {}
        n = len(rows)
        return dict(extra, video=np.stack(videos), text=np.array(texts, object), fps=np.asarray(fps, np.float32),
                    height=np.full(n, h, np.float32), width=np.full(n, w, np.float32),
                    num_frames=np.full(n, t, np.int32), row=rows.astype(np.int32),
                    weight=np.asarray(weight, np.float32), bucket=(b.bucket[0], t, h, w))

    def __iter__(self) -> Iterator[tuple[EvalBatch, dict]]:
        with concurrent.futures.ThreadPoolExecutor(self.decode_threads, thread_name_prefix="jaxsora-eval") as pool:
            ahead: collections.deque = collections.deque()
            plan = iter(self.plan)

            def fill():  # keep `decode_threads` batches decoding beyond the one being evaluated
                while len(ahead) <= self.decode_threads:
                    b = next(plan, None)
                    if b is None:
                        return
                    ahead.append((b, pool.submit(self.host_batch, b)))

            fill()
            while ahead:
                b, fut = ahead.popleft()
                fill()
                yield b, fut.result()


# --------------------------------------------------------------------------------------------
# the evaluator the loop calls
# --------------------------------------------------------------------------------------------
class Evaluator:
    """Runs the eval over `data` on the train state (`evaluate`), and compiles it for every batch
    shape before step 0 (`compile`)."""

    def __init__(self, setup, data, *, num_timesteps: int = rflow.NUM_EVAL_TIMESTEPS, seed: int = EVAL_SEED,
                 use_ema: bool = False):
        self.setup, self.data = setup, data
        self.num_timesteps, self.seed, self.use_ema = int(num_timesteps), int(seed), bool(use_ema)
        enc = setup.encoders
        fn = make_eval_fn(setup.plan.graphdef, encode_video=enc.encode_video, encode_text=enc.encode_text,
                          num_timesteps=self.num_timesteps, seed=self.seed)
        self.step = EvalStep(fn, setup.plan, use_ema=use_ema)

    def spec(self, size: tuple, global_batch: int) -> dict:
        return eval_batch_spec(size, global_batch, self.setup.encoders.text_spec(global_batch), self.setup.mesh)

    def compile(self, *, limit: Optional[int] = None, check: bool = True, progress: bool = True,
                threads: int = 1) -> list:
        """Compile every eval batch shape (traced one after another, compiled in `threads` threads);
        → [(name, (res, T, H, W), global batch, CompileInfo)]. With `check`, raise EvalPlanError naming
        the shapes whose peak exceeds `limit` bytes per device."""
        enc = self.setup.encoders.weights
        with concurrent.futures.ThreadPoolExecutor(max(1, int(threads))) as pool:
            futures = []
            for name, bucket, gb in self.data.shapes():
                spec = self.spec(bucket[1:], gb)
                lowered = self.step.lower(spec, enc)
                futures.append((name, bucket, gb, pool.submit(self.step.compile, spec, enc, lowered)))
            rows = [(name, bucket, gb, f.result()) for name, bucket, gb, f in futures]
        bad = [r for r in rows if limit and r[3].peak_bytes > limit]
        if check and bad:
            gib = 1 << 30
            lines = ", ".join(f"{b[0]} {b[1]}×{b[2]}×{b[3]} at global batch {gb}: {i.peak_bytes / gib:.2f} GiB"
                              for _, b, gb, i in bad)
            raise EvalPlanError(f"eval bucket(s) do not fit in {limit / gib:.2f} GiB per device: {lines}; lower "
                                "their batch sizes in eval.bucket_config")
        if progress and rows:
            desc = ", ".join(f"{k} {r} rows" for k, (r, _) in self.data.describe().items())
            print(f"[jaxsora] eval: {len(self.data.plan)} batches ({desc}) × {self.num_timesteps} timesteps on the "
                  f"{'EMA' if self.use_ema else 'params'}; compiled {len(rows)} shape(s) in "
                  f"{sum(r[3].seconds for r in rows):.1f}s, largest "
                  f"{max(r[3].peak_bytes for r in rows) / (1 << 30):.2f} GiB per device", flush=True)
        return rows

    def evaluate(self, state) -> dict:
        """The eval of `state`'s weights: {"step", "eval/loss", "eval/loss/<name>", "eval/samples/<name>",
        "eval/loss_by_t/<name>" (list), "eval/skipped", "eval/seconds", "eval/weights"}. The outputs stay
        on the device until one transfer at the end (with the state's step)."""
        t0 = time.monotonic()
        mesh, enc = self.setup.mesh, self.setup.encoders.weights
        outs: list = []
        in_flight: collections.deque = collections.deque()
        for b, host in self.data:
            batch = eval_global_batch(host, mesh)
            out = self.step(state, batch, enc, self.step.ids(bucket_code(b.name), b.index))
            outs.append((b.name, out))
            in_flight.append(out["count"])
            if len(in_flight) > MAX_IN_FLIGHT:
                in_flight.popleft().block_until_ready()
        fetched, step = jax.device_get(([o for _, o in outs], state.step))
        sums: dict = {}
        for (name, _), o in zip(outs, fetched):
            s, c = sums.get(name, (np.zeros(self.num_timesteps, np.float64), 0.0))
            sums[name] = (s + np.asarray(o["loss_sum"], np.float64), c + float(o["count"]))
        return summarize(sums, step=int(step), seconds=time.monotonic() - t0,
                         skipped=len(getattr(self.data, "bad_rows", ())), use_ema=self.use_ema)


def summarize(sums: dict, *, step: int, seconds: float, skipped: int = 0, use_ema: bool = False) -> dict:
    """{name: (Σ weight·loss per t [n], Σ weight)} → the logged eval record. A bucket's loss is the
    sample mean at each t averaged over the t's; `eval/loss` the mean over buckets with samples."""
    out: dict = dict(step=int(step))
    per_bucket = {}
    for name, (s, c) in sums.items():
        out[f"eval/samples/{name}"] = int(round(c))
        if c > 0:
            by_t = np.asarray(s, np.float64) / c
            per_bucket[name] = float(np.mean(by_t))
            out[f"eval/loss/{name}"] = per_bucket[name]
            out[f"eval/loss_by_t/{name}"] = [float(v) for v in by_t]
    out["eval/loss"] = float(np.mean(list(per_bucket.values()))) if per_bucket else float("nan")
    out["eval/skipped"] = int(skipped)
    out["eval/seconds"] = float(seconds)
    out["eval/weights"] = "ema" if use_ema else "params"
    return out


def check_config(config) -> None:
    """The eval settings that can be checked before any work (ConfigError naming the problem):
    the table's files and columns, the bucket config (with `data.resolutions`), the cached text
    states a `data.text_cache` run needs."""
    from jaxsora.config import ConfigError
    from jaxsora.data.buckets import validate_bucket_config
    from jaxsora.data.tables import check_table

    ecfg, dcfg = config.eval, config.data
    if not ecfg.get("table"):
        return
    extra = dcfg.get("resolutions") or None
    extra = extra.to_dict() if hasattr(extra, "to_dict") else extra
    bc = ecfg.get("bucket_config")
    bc = bc.to_dict() if hasattr(bc, "to_dict") else bc
    try:
        entries = normalize_eval_buckets(bc or {})
        validate_bucket_config({r: {f: (1.0, b)} for r, f, b in entries}, extra)
    except (ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"eval.bucket_config: {e}") from e
    if not entries:
        raise ConfigError("eval.bucket_config has no bucket with a batch size: nothing to evaluate")
    if dcfg.get("text_cache") and not ecfg.get("text_cache"):
        raise ConfigError("data.text_cache replaces T5 in the step, so the eval table needs cached text states too: "
                          "precompute them for eval.table (python -m data_tools.precompute) and set eval.text_cache")
    try:
        check_table(ecfg.table)
    except UserError as e:
        raise ConfigError(f"eval.table: {e}") from e


def build_eval_data(config, setup, outdir: str):
    """The `EvalData` of `config.eval` for this run (index under `<run>/eval_table_index`)."""
    import os

    ecfg, dcfg = config.eval, config.data
    check_config(config)
    text_inputs = setup.encoders.text_inputs
    if setup.encoders.text_from_cache:
        from jaxsora.data.cache import TextStateCache
        from jaxsora.train.build import TextInputs


        text_inputs = TextInputs(cache=TextStateCache(ecfg.text_cache))
    extra = dcfg.get("resolutions") or None
    extra = extra.to_dict() if hasattr(extra, "to_dict") else extra
    bucket_config = ecfg.bucket_config.to_dict() if hasattr(ecfg.bucket_config, "to_dict") else ecfg.bucket_config
    data = EvalData(ecfg.table, bucket_config, seed=int(ecfg.get("seed", EVAL_SEED)),
                    data_parallel_size=setup.data_parallel_size, process_index=jax.process_index(),
                    process_count=jax.process_count(), frame_interval=int(dcfg.get("frame_interval", 1)),
                    extra_resolutions=extra, max_batches_per_bucket=int(ecfg.get("max_batches_per_bucket", 0)),
                    index_dir=os.path.join(outdir, "eval_table_index"), text_inputs=text_inputs,
                    decode_threads=int(ecfg.get("decode_threads", 1)), progress=jax.process_index() == 0)
    if not data.plan:
        raise EvalPlanError(f"eval.table {ecfg.table}: no row fits any bucket of eval.bucket_config (too small, too "
                            "short, or a resolution the config does not list)")
    return data


def build_evaluator(config, setup, outdir: str, data=None) -> Evaluator:
    ecfg = config.eval
    data = data if data is not None else build_eval_data(config, setup, outdir)
    return Evaluator(setup, data, num_timesteps=int(ecfg.get("num_timesteps", rflow.NUM_EVAL_TIMESTEPS)),
                     seed=int(ecfg.get("seed", EVAL_SEED)), use_ema=bool(ecfg.get("use_ema", False)))
