"""Validation loss on a held-out table: Open-Sora 1.2's eval loss (`eval/loss/eval_loss.py`)
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

Modules: `train.eval.step` (the pure eval function and its jitted step), `train.eval.data` (the plan
and the decoded batches); this one runs the evaluation (`Evaluator`) and builds it from the config.
"""
from __future__ import annotations

import collections
import concurrent.futures
import time

import jax
import numpy as np

from jaxsora.diffusion import rflow
from jaxsora.errors import UserError
from jaxsora.train.eval.data import EvalBatch, EvalData, bucket_name, eval_plan, normalize_eval_buckets
from jaxsora.train.eval.step import (
    EVAL_SEED,
    EvalStep,
    bucket_code,
    eval_batch_spec,
    eval_global_batch,
    eval_noise,
    make_eval_fn,
    noise_key,
    vae_key,
)

__all__ = [
    "EVAL_SEED", "MAX_IN_FLIGHT", "EvalBatch", "EvalData", "EvalPlanError", "EvalStep", "Evaluator", "bucket_code",
    "bucket_name", "build_eval_data", "build_evaluator", "check_config", "enabled", "eval_batch_spec",
    "eval_global_batch", "eval_noise", "eval_plan", "make_eval_fn", "noise_key", "normalize_eval_buckets",
    "summarize", "vae_key",
]

# Eval batches dispatched ahead of the device (as the train loop's MAX_IN_FLIGHT).
MAX_IN_FLIGHT = 2


class EvalPlanError(UserError, ValueError):
    """The eval table gives nothing to evaluate, or an eval bucket does not fit the device."""


def enabled(config) -> bool:
    ecfg = config.get("eval")
    return bool(ecfg is not None and ecfg.get("table"))


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

    def compile(self, *, limit: int | None = None, check: bool = True, progress: bool = True,
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


def _plain(value):
    """A config section as plain dicts (ConfigDict → dict); other values as they are."""
    return value.to_dict() if hasattr(value, "to_dict") else value


def check_config(config) -> None:
    """The eval settings that can be checked before any work (ConfigError naming the problem):
    the table's files and columns, the bucket config (with `data.resolutions`), the cached text
    states a `data.text_cache` run needs."""
    from jaxsora.data.buckets import validate_bucket_config
    from jaxsora.data.tables import check_table
    from jaxsora.errors import ConfigError

    ecfg, dcfg = config.eval, config.data
    if not ecfg.get("table"):
        return
    extra = _plain(dcfg.get("resolutions") or None)
    bc = _plain(ecfg.get("bucket_config"))
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
    extra = _plain(dcfg.get("resolutions") or None)
    data = EvalData(ecfg.table, _plain(ecfg.bucket_config), seed=int(ecfg.get("seed", EVAL_SEED)),
                    data_parallel_size=setup.data_parallel_size, process_index=jax.process_index(),
                    process_count=jax.process_count(), frame_interval=int(dcfg.frame_interval),
                    extra_resolutions=extra, max_batches_per_bucket=int(ecfg.get("max_batches_per_bucket", 0)),
                    index_dir=os.path.join(outdir, "eval_table_index"), text_inputs=text_inputs,
                    decode_threads=int(ecfg.decode_threads), progress=jax.process_index() == 0)
    if not data.plan:
        raise EvalPlanError(f"eval.table {ecfg.table}: no row fits any bucket of eval.bucket_config (too small, too "
                            "short, or a resolution the config does not list)")
    return data


def build_evaluator(config, setup, outdir: str, data=None) -> Evaluator:
    ecfg = config.eval
    data = data if data is not None else build_eval_data(config, setup, outdir)
    return Evaluator(setup, data, num_timesteps=int(ecfg.get("num_timesteps", rflow.NUM_EVAL_TIMESTEPS)),
                     seed=int(ecfg.get("seed", EVAL_SEED)), use_ema=bool(ecfg.get("use_ema", False)))
