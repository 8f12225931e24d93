"""The video loader: the epoch plan → host-local batches, with exact resume (see `plan.py`).

Each host decodes only its contiguous share of each global batch (global / process_count rows);
the train loop assembles global arrays with `jax.make_array_from_process_local_data`. Decoding
runs in a pool of `num_workers` threads (PyAV and PIL release the GIL while decoding), a few
batches ahead. A missing, zero-length, truncated or corrupt file is skipped with a counted warning
and replaced by another row of the same bucket, chosen deterministically from (seed, epoch, batch,
slot), so the batch stays full, the run goes on, and a resume sees the same replacement.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import sys
from typing import Iterator, Mapping, Optional

import numpy as np

from jaxsora.data import plan as plan_lib
from jaxsora.data.buckets import Buckets, normalize_bucket_config
from jaxsora.data.plan import DataStateMismatch  # noqa: F401  (re-exported)
from jaxsora.data.tables import fingerprint, read_table
from jaxsora.data.video import DecodeError, load_sample

MAX_REPLACEMENTS = 16


class VideoLoader:
    def __init__(self, table: str, bucket_config: Mapping, *, seed: int, data_parallel_size: int,
                 process_index: int = 0, process_count: int = 1, num_workers: int = 0, frame_interval: int = 1,
                 extra_resolutions: Optional[Mapping] = None, prefetch: int = 2):
        self.df = read_table(table)
        self.bucket_config = normalize_bucket_config(bucket_config)
        self.buckets = Buckets(self.bucket_config, extra_resolutions)
        self.seed, self.dp, self.frame_interval = int(seed), int(data_parallel_size), int(frame_interval)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.num_workers, self.prefetch = int(num_workers), int(prefetch)
        self.fingerprint = plan_lib.make_fingerprint(
            fingerprint(self.df), {k: {str(f): v for f, v in fr.items()} for k, fr in self.bucket_config.items()},
            self.seed, self.dp, self.frame_interval)
        self.epoch = 0
        self.index = 0  # batches completed in the epoch (after the last one yielded)
        self.num_skipped = 0
        self._plans: dict[int, list] = {}
        self._bucket_cache: dict = {}
        self._texts = self.df["text"].to_numpy()
        self._paths = self.df["path"].to_numpy()
        self._nframes = self.df["num_frames"].to_numpy()

    # ---- plan ---------------------------------------------------------------------------------
    def plan(self, epoch: int) -> list:
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}  # this and the last epoch
            self._plans[epoch] = plan_lib.epoch_plan(self.df, self.buckets, seed=self.seed, epoch=epoch, dp=self.dp,
                                                     frame_interval=self.frame_interval)
        return self._plans[epoch]

    def steps_per_epoch(self, epoch: int = 0) -> int:
        return len(self.plan(epoch))

    def describe_plan(self, epoch: int = 0) -> list:
        """[(bucket (res, T, H, W), batches this epoch, global batch, rows assigned)] per (res, T, H, W),
        in order of first appearance; a bucket whose rows cannot fill one global batch shows 0 batches."""
        groups = plan_lib.assign_rows(self.df, self.buckets, seed=self.seed, epoch=epoch,
                                      frame_interval=self.frame_interval)
        counts = collections.OrderedDict()
        for b, rows in groups.items():
            f, h, w = self.buckets.target_size(b)
            gbs = self.buckets.bucket_batch_size(b) * self.dp
            n, _, r = counts.get((b[0], f, h, w), (0, gbs, 0))
            counts[(b[0], f, h, w)] = (n + len(rows) // gbs, gbs, r + len(rows))
        return [(k, n, gb, r) for k, (n, gb, r) in counts.items()]

    # ---- state --------------------------------------------------------------------------------
    def state(self) -> dict:
        return dict(epoch=self.epoch, index=self.index, fingerprint=self.fingerprint)

    def restore(self, state: dict, reset: bool = False) -> None:
        if reset:
            self.epoch, self.index = 0, 0
            return
        plan_lib.check_state(state, self.fingerprint)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    def _bucket_rows(self, epoch: int, bucket: tuple) -> np.ndarray:
        """Every row planned into `bucket` this epoch (the replacement pool for unreadable files)."""
        key = (epoch, bucket)
        if key not in self._bucket_cache:
            self._bucket_cache = {k: v for k, v in self._bucket_cache.items() if k[0] >= epoch - 1}
            self._bucket_cache[key] = np.concatenate([p.rows for p in self.plan(epoch) if p.bucket == bucket])
        return self._bucket_cache[key]

    # ---- decoding -----------------------------------------------------------------------------
    def _decode_slot(self, epoch: int, index: int, slot: int, pb) -> tuple:
        t, h, w = pb.size
        same_bucket = self._bucket_rows(epoch, pb.bucket)
        row = int(pb.rows[slot])
        for attempt in range(MAX_REPLACEMENTS + 1):
            rng = np.random.default_rng([self.seed, epoch, row, 1])  # the temporal crop of this row
            try:
                video, fps = load_sample(self._paths[row], t, h, w, frame_interval=self.frame_interval, rng=rng,
                                         num_frames_hint=int(self._nframes[row]))
                return row, video, fps, attempt
            except DecodeError as e:
                print(f"[jaxsora.data] skipped row {row}: {e}", file=sys.stderr)
                pick = np.random.default_rng([self.seed, epoch, index, slot, attempt + 1])
                row = int(same_bucket[pick.integers(len(same_bucket))])
        raise DecodeError(f"{MAX_REPLACEMENTS} replacement samples in bucket {pb.bucket} failed to decode; "
                          "check the dataset (python -m data_tools.meta lists unreadable files)")

    def _host_batch(self, pool, epoch: int, index: int) -> dict:
        pb = self.plan(epoch)[index]
        share = len(pb.rows) // self.process_count
        slots = range(self.process_index * share, (self.process_index + 1) * share)
        if pool is None:
            results = [self._decode_slot(epoch, index, s, pb) for s in slots]
        else:
            results = list(pool.map(lambda s: self._decode_slot(epoch, index, s, pb), slots))
        rows = np.array([r[0] for r in results], np.int64)
        t, h, w = pb.size
        return dict(
            video=np.stack([r[1] for r in results]), text=np.array([self._texts[r] for r in rows], object),
            fps=np.array([r[2] for r in results], np.float32), height=np.full(len(rows), h, np.float32),
            width=np.full(len(rows), w, np.float32), num_frames=np.full(len(rows), t, np.int32), row=rows,
            skipped=sum(r[3] for r in results), epoch=epoch, index=index + 1, bucket=(pb.bucket[0], t, h, w),
        )

    def __iter__(self) -> Iterator[dict]:
        # Decoding threads, and one more thread that assembles batches ahead (separate pools: a
        # batch task waiting on decode tasks of its own pool could deadlock).
        pool = cf.ThreadPoolExecutor(self.num_workers) if self.num_workers > 0 else None
        assembler = cf.ThreadPoolExecutor(1) if self.num_workers > 0 else None
        ahead: "collections.deque" = collections.deque()
        epoch, index = self.epoch, self.index

        def positions():
            e, i = epoch, index
            empty = 0
            while True:
                n = len(self.plan(e))
                empty = empty + 1 if n == 0 else 0
                if empty >= 3:  # an epoch can come up empty by chance (keep probabilities); three cannot
                    raise ValueError(f"epochs {e - 2}..{e} have no full batch: the table has too few rows for the "
                                     "bucket config's batch sizes × data-parallel size (see --dry-run)")
                while i < n:
                    yield e, i
                    i += 1
                e, i = e + 1, 0

        pos = positions()
        try:
            while True:
                while len(ahead) < max(1, self.prefetch):
                    e, i = next(pos)
                    if pool is None:
                        ahead.append(self._host_batch(None, e, i))
                    else:
                        ahead.append(assembler.submit(self._host_batch, pool, e, i))
                item = ahead.popleft()
                batch = item if isinstance(item, dict) else item.result()
                self.num_skipped += int(batch.pop("skipped"))
                self.epoch, self.index = batch["epoch"], batch["index"]
                if self.index >= len(self.plan(self.epoch)):
                    self.epoch, self.index = self.epoch + 1, 0
                yield batch
        finally:
            if pool is not None:
                try:
                    assembler.shutdown(wait=False, cancel_futures=True)
                    pool.shutdown(wait=False, cancel_futures=True)
                except (AttributeError, TypeError):  # interpreter teardown: the pools are gone already
                    pass
