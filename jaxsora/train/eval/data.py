"""The eval's plan and data: which table rows each eval bucket evaluates, in which global batches
(a function of the table and the config only), and `EvalData`, which decodes them each evaluation."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import sys
from collections.abc import Callable, Iterator

import numpy as np

from jaxsora.train.eval.step import EVAL_SEED


def bucket_name(res: str, frames: int) -> str:
    """The logged name of an eval bucket: `<res>_<frames>` (metrics `eval/loss/<res>_<frames>`)."""
    return f"{res}_{int(frames)}"


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
                 extra_resolutions=None, max_batches_per_bucket: int = 0, index_dir: str | None = None,
                 text_inputs: Callable | None = None, decode_threads: int = 1, progress: bool = True):
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
