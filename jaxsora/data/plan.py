"""The global batch plan of an epoch, and the loader state that makes resume exact and safe.

Under jit every host feeds the same bucket shape at a step, so (unlike the reference, where each
rank draws its own bucket) a step is one bucket for the whole mesh: global batch = the bucket's
per-device batch × data-parallel size. Per epoch, from (seed, epoch) alone:
1. assign every row to a bucket (reference semantics, `jaxsora.data.buckets`);
2. per bucket (in first-appearance order): shuffle its rows, drop the remainder of the global batch;
3. list each bucket once per batch and shuffle that access order.
Batch i is the next global batch of bucket access[i]. The plan is regenerated from (seed, epoch)
every time — there is no cached epoch-0 assignment to leak into a resume (the reference's quirk).

The loader state is (epoch, index = batches completed in the epoch, fingerprint). The fingerprint
covers the table contents, the bucket config, the seed and the data-parallel size; restoring with
any of them changed is refused, naming what changed, unless the caller asks for a reset.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections import OrderedDict

import numpy as np

from jaxsora.errors import UserError


class DataStateMismatch(UserError, ValueError):
    """Raised when a checkpoint's data position does not fit the current data setup."""


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    bucket: tuple  # (res, frames, ar_key)
    size: tuple  # (T, H, W) target
    rows: np.ndarray  # [global batch] table row ids


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_fingerprint(table_fp: str, bucket_config: dict, seed: int, dp: int, frame_interval: int) -> dict:
    return dict(table=table_fp, buckets=config_hash([bucket_config, frame_interval]), seed=int(seed),
                data_parallel_size=int(dp))


def check_state(saved: dict, current: dict) -> None:
    names = dict(table="the dataset table (rows, paths, captions or sizes)", buckets="the bucket config",
                 seed="the data seed", data_parallel_size="the data-parallel size")
    old = saved.get("fingerprint", {})
    changed = [names[k] + f" ({old.get(k)!r} → {current[k]!r})" for k in names if old.get(k) != current[k]]
    if changed:
        raise DataStateMismatch(
            "the checkpoint's data position does not fit this run: changed " + "; ".join(changed)
            + ". Resuming would repeat or skip batches. Use --start-from-scratch to restart the data order "
              "(the optimizer state is kept), or restore the original data setup.")


def assign_rows(sizes, buckets, *, seed: int, epoch: int, frame_interval: int = 1) -> OrderedDict[tuple, np.ndarray]:
    """bucket → its rows (ascending), buckets in order of first appearance in the table (as the
    reference). sizes: (num_frames, height, width), each [N] int."""
    t, h, w = (np.asarray(a, np.int64) for a in sizes)
    seeds = buckets.row_seeds(seed, epoch, np.arange(len(t)))
    codes = buckets.assign_many(t, h, w, seeds, frame_interval)
    kept = np.nonzero(codes >= 0)[0]
    order = kept[np.argsort(codes[kept], kind="stable")]  # rows grouped by code, ascending within
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    groups = np.split(order, bounds) if len(order) else []
    groups.sort(key=lambda rows: rows[0])  # first appearance
    return OrderedDict((buckets.bucket_keys[int(codes[g[0]])], g) for g in groups)


def epoch_plan(sizes, buckets, *, seed: int, epoch: int, dp: int, frame_interval: int = 1,
               groups: OrderedDict[tuple, np.ndarray] | None = None) -> list[PlannedBatch]:
    """Steps 2–3 above for one epoch. `groups` (bucket → rows) fixes the assignment of step 1 for
    every epoch (a feature cache stores it); by default rows are assigned anew from (seed, epoch)."""
    if groups is None:
        groups = assign_rows(sizes, buckets, seed=seed, epoch=epoch, frame_interval=frame_interval)
    rng = np.random.default_rng([seed, epoch])
    per_bucket, access = {}, []
    for b, rows in groups.items():
        gbs = buckets.bucket_batch_size(b) * dp
        n = len(rows) // gbs
        if n == 0:
            continue
        rows = rows[rng.permutation(len(rows))][: n * gbs]
        per_bucket[b] = rows.reshape(n, gbs)
        access += [b] * n
    order = rng.permutation(len(access))
    used = {b: 0 for b in per_bucket}
    plan = []
    for i in order:
        b = access[i]
        plan.append(PlannedBatch(b, buckets.target_size(b), per_bucket[b][used[b]]))
        used[b] += 1
    return plan


class Planner:
    """Epoch plans of one table (its size columns), bucket setup, seed and data-parallel size, kept
    for the current and the previous epoch. Thread-safe (grain may read from several threads)."""

    def __init__(self, sizes, buckets, *, seed: int, dp: int, frame_interval: int = 1,
                 groups: OrderedDict[tuple, np.ndarray] | None = None):
        self.sizes, self.buckets, self.groups = sizes, buckets, groups  # groups: a fixed assignment
        self.seed, self.dp, self.frame_interval = int(seed), int(dp), int(frame_interval)
        self._plans: dict[int, list] = {}
        self._pools: dict = {}
        self._lock = threading.Lock()

    def plan(self, epoch: int) -> list[PlannedBatch]:
        with self._lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._plans[epoch] = epoch_plan(self.sizes, self.buckets, seed=self.seed, epoch=epoch, dp=self.dp,
                                                frame_interval=self.frame_interval, groups=self.groups)
            return self._plans[epoch]

    def bucket_rows(self, epoch: int, bucket: tuple) -> np.ndarray:
        """Every row planned into `bucket` this epoch (the replacement pool for unreadable files)."""
        plan = self.plan(epoch)
        with self._lock:
            key = (epoch, bucket)
            if key not in self._pools:
                self._pools = {k: v for k, v in self._pools.items() if k[0] >= epoch - 1}
                self._pools[key] = np.concatenate([p.rows for p in plan if p.bucket == bucket])
            return self._pools[key]
