"""Bucket assignment with Open-Sora 1.2's semantics (`opensora/datasets/bucket.py`).

`bucket_config = {res_name: {num_frames: (keep_prob, batch_size)}}`; keep_prob is a float p or a
tuple (p_res, p_frames); `(0.0, None)` means "never here". For a sample (T, H, W) from the table,
resolutions are tried by descending pixel count (only those with H·W ≥ 0.8·pixels):
- an image (T = 1) is kept at the first resolution with a 1-frame entry whose draw `r < p` succeeds;
- a video takes the first frame count f (descending) with **T > f·frame_interval** (strict) and
  f ≠ 1; a tuple entry first needs `r ≤ p_frames` (else the next smaller f); then the resolution
  is kept if p ≥ 1 or the same RNG's next draw `r < p` (else the next *resolution*, not a shorter f).
The RNG is `numpy.random.default_rng(seed + bucket_id[res][f])` with
seed = data seed + epoch + row · num_bucket, so an assignment is a pure function of (seed, epoch, row).
The aspect-ratio key is the closest H/W in the chosen resolution's table.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxsora.data.aspect import closest_ratio_key, resolution_tables
from jaxsora.data.pcg import uniforms

# Open-Sora 1.2: a resolution is eligible when H·W ≥ 0.8 × its pixel count.
HW_APPROX = 0.8


def _frames_key(k):
    return int(k)


def normalize_bucket_config(bucket_config: Mapping) -> dict:
    """Plain {res: {int frames: (keep_prob, batch_size)}} with tuples (ConfigDict/JSON lists allowed)."""
    out = {}
    for res, frames in dict(bucket_config).items():
        entries = {}
        for f, v in dict(frames).items():
            v = tuple(v)
            if len(v) != 2:
                raise ValueError(f"bucket_config[{res!r}][{f!r}] must be (keep_prob, batch_size), got {v}")
            prob, bs = v
            prob = tuple(float(p) for p in prob) if isinstance(prob, (tuple, list)) else float(prob)
            entries[_frames_key(f)] = (prob, None if bs is None else int(bs))
        out[str(res)] = entries
    return out


def validate_bucket_config(bucket_config: Mapping, extra_resolutions: Mapping | None = None) -> None:
    tables = resolution_tables(extra_resolutions)
    cfg = normalize_bucket_config(bucket_config)
    if not cfg:
        raise ValueError("bucket_config is empty")
    for res, frames in cfg.items():
        if res not in tables:
            raise ValueError(f"unknown resolution {res!r}; known: {sorted(tables)}")
        for f, (prob, bs) in frames.items():
            if f < 1:
                raise ValueError(f"bucket_config[{res!r}]: frame count {f} < 1")
            if f == 1 and isinstance(prob, tuple):
                raise ValueError(f"bucket_config[{res!r}][1]: images need a float keep_prob, not a tuple")
            probs = prob if isinstance(prob, tuple) else (prob,)
            if any(not 0.0 <= p <= 1.0 for p in probs):
                raise ValueError(f"bucket_config[{res!r}][{f}]: keep_prob must lie in [0, 1], got {prob}")
            if bs is None and max(probs) > 0:
                raise ValueError(f"bucket_config[{res!r}][{f}]: batch_size None needs keep_prob 0")
            if bs is not None and bs < 1:
                raise ValueError(f"bucket_config[{res!r}][{f}]: batch_size must be ≥ 1, got {bs}")


class Buckets:
    def __init__(self, bucket_config: Mapping, extra_resolutions: Mapping | None = None):
        validate_bucket_config(bucket_config, extra_resolutions)
        self.tables = resolution_tables(extra_resolutions)
        cfg = normalize_bucket_config(bucket_config)
        # Descending pixel count; Python's stable sort keeps the config order on ties (2880 / 4k).
        self.res_order = sorted(cfg, key=lambda r: self.tables[r][0], reverse=True)
        self.probs, self.batch_size, self.bucket_id = {}, {}, {}
        n = 0
        self.num_bucket = 0
        for res in self.res_order:
            frames = sorted(cfg[res], reverse=True)
            self.probs[res] = {f: cfg[res][f][0] for f in frames}
            self.batch_size[res] = {f: cfg[res][f][1] for f in frames}
            self.bucket_id[res] = {}
            for f in frames:
                self.bucket_id[res][f] = n
                n += 1
                self.num_bucket += len(self.tables[res][1])
        # Codes for `assign_many`: code = code_base[res][f] + index of the aspect key in res's table.
        self.bucket_keys: list[tuple] = []
        self.code_base: dict = {}
        for res in self.res_order:
            self.code_base[res] = {}
            for f in self.probs[res]:
                self.code_base[res][f] = len(self.bucket_keys)
                self.bucket_keys += [(res, f, ar) for ar in self.tables[res][1]]

    def assign(self, t: int, h: int, w: int, seed: int, frame_interval: int = 1) -> tuple | None:
        """(res, frames, ar_key) or None (the sample sits this epoch out)."""
        hw = h * w
        for res in self.res_order:
            if hw < self.tables[res][0] * HW_APPROX:
                continue
            probs = self.probs[res]
            if t == 1:
                if 1 in probs:
                    rng = np.random.default_rng(seed + self.bucket_id[res][1])
                    if rng.random() < probs[1]:
                        return res, 1, closest_ratio_key(h, w, self.tables[res][1])
                continue
            chosen = None
            for f, prob in probs.items():
                rng = np.random.default_rng(seed + self.bucket_id[res][f])
                if isinstance(prob, tuple) and rng.random() > prob[1]:
                    continue
                if t > f * frame_interval and f != 1:
                    chosen = (f, prob, rng)
                    break
            if chosen is None:
                continue
            f, prob, rng = chosen
            p = prob[0] if isinstance(prob, tuple) else prob
            if p >= 1 or rng.random() < p:
                return res, f, closest_ratio_key(h, w, self.tables[res][1])
        return None

    def assign_many(self, t, h, w, seeds, frame_interval: int = 1) -> np.ndarray:
        """`assign` for arrays of rows at once, exactly (the draws come from `pcg.uniforms`, numpy's
        generator recomputed in bulk). t/h/w: [N] ints; seeds: [N] per-row seeds (`row_seeds`).
        → [N] int64 codes into `self.bucket_keys`, −1 where the row sits this epoch out."""
        t, h, w = (np.asarray(a, np.int64) for a in (t, h, w))
        seeds = np.asarray(seeds, np.uint64)
        codes = np.full(len(t), -1, np.int64)
        undecided = np.ones(len(t), bool)
        ratio = h / w
        for res in self.res_order:
            pixels, table = self.tables[res]
            cand = undecided & (h * w >= pixels * HW_APPROX)
            if not cand.any():
                continue
            ar_values = np.array([float(k) for k in table])
            probs, bid, base = self.probs[res], self.bucket_id[res], self.code_base[res]

            def keep(rows, f, ar_values=ar_values, base=base):  # called in this iteration only
                ar = np.argmin(np.abs(ar_values[None, :] - ratio[rows, None]), axis=1)  # first on ties
                codes[rows] = base[f] + ar
                undecided[rows] = False

            images = np.nonzero(cand & (t == 1))[0]
            if len(images) and 1 in probs:
                r = uniforms(seeds[images] + np.uint64(bid[1]), 1)[:, 0]
                keep(images[r < probs[1]], 1)
            pending = np.nonzero(cand & (t != 1))[0]  # videos without a frame count chosen at this res
            for f, prob in probs.items():  # descending frame counts
                if not len(pending):
                    break
                if f == 1:  # a video never takes f = 1; each f has its own generator, so no draw to skip
                    continue
                # Only rows with T > f·interval can take f: the others' draws (a fresh generator) don't matter.
                eligible = t[pending] > f * frame_interval
                rows = pending[eligible]
                if not len(rows):
                    continue
                tup = isinstance(prob, tuple)
                p = prob[0] if tup else prob
                n_draws = int(tup) + int(p < 1)
                draws = uniforms(seeds[rows] + np.uint64(bid[f]), n_draws) if n_draws else None
                passed = draws[:, 0] <= prob[1] if tup else np.ones(len(rows), bool)
                # p < 1: the same generator's next draw (the second for a tuple entry, else the first).
                kept = passed & (draws[:, n_draws - 1] < p) if p < 1 else passed
                keep(rows[kept], f)
                # Chosen (passed) but not kept: on to the next resolution, not a shorter f.
                pending = np.concatenate([pending[~eligible], rows[~passed]])
        return codes

    def row_seeds(self, seed: int, epoch: int, rows) -> np.ndarray:
        """`row_seed` for an array of rows: [N] uint64."""
        rows = np.asarray(rows, np.uint64)
        return np.uint64(seed + epoch) + rows * np.uint64(self.num_bucket)

    def target_size(self, bucket: tuple) -> tuple[int, int, int]:
        res, f, ar = bucket
        h, w = self.tables[res][1][ar]
        return f, h, w

    def bucket_batch_size(self, bucket: tuple) -> int:
        return self.batch_size[bucket[0]][bucket[1]]

    def row_seed(self, seed: int, epoch: int, row: int) -> int:
        """The reference's per-row seed: sampler seed + epoch + row · num_bucket."""
        return seed + epoch + row * self.num_bucket
