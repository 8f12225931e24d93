"""The video loader: the epoch plan as a grain `MapDataset`, decoded in grain worker processes, with
exact resume (plan semantics in `plan.py`).

Element k of the dataset is the k-th global batch from the loader's position (epoch, index): its
host share — this host's contiguous global / process_count rows — decoded. Positions run across
epochs (each epoch's plan is regenerated from (seed, epoch) wherever it is needed, in the workers
too), so one pipeline serves the whole run and the iterator state is the one position. Workers
are grain's `mp_prefetch` processes (spawned; each reads element k ≡ w mod num_workers, and grain
returns them in order), so the batches do not depend on the worker count. The train loop
assembles global arrays with `jax.make_array_from_process_local_data`.

A row that cannot give what its bucket needs is skipped with a one-line warning naming the reason,
and replaced by another row of the same bucket chosen from (seed, epoch, batch, slot, attempt), so
the batch stays full, the run goes on, and a resume replays the same skips and replacements.
Reasons (`video.py` has the decoding ones): ``missing``, ``unreadable`` (zero-length, truncated,
corrupt), ``too_short`` (fewer frames than T·frame_interval), ``image_in_video_bucket``,
``animated_image``, ``empty_caption`` (an empty or blank table caption: a data error — caption
dropout for classifier-free guidance happens in the model, not in the table) and ``bad_shape``
(a decoded sample not of the bucket's [3, T, H, W]; a guard, so a batch always stacks). Each host
batch carries `skipped` {reason: count}; `VideoLoader` sums them in `skip_counts`, which its
state saves and restores. After `MAX_REPLACEMENTS` failed replacements in a row the bucket is
taken as broken and the loader raises.

Nothing is left behind: each grain worker exits on its own when the process that started it dies
(kill -9 included; see `_ExitWithParent`); the shared-memory names of the arrays a batch arrives
in are unlinked as soon as the batch is received (the memory itself lives as long as the arrays),
so batches still referenced at exit leak nothing; and a table index in a temporary folder is
removed at exit or, after a kill, by the next index build (`tables.py`).

Host batch: video [b, 3, T, H, W] uint8 (→ [-1, 1] by `video.to_model_range`, in the train step);
text [b] str; with `text_inputs`, also ids and text_mask (see `VideoLoader`); fps/height/width [b]
float32; num_frames [b] int32; row [b] int64 (table rows); epoch, index (batches of the epoch done
after this one), bucket (res, T, H, W). (The dataset's elements also carry `skipped` and
`epoch_batches`, which `VideoLoader.__iter__` takes out.)
"""
from __future__ import annotations

import collections
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from jaxsora.data import plan as plan_lib
from jaxsora.data.buckets import Buckets, normalize_bucket_config
from jaxsora.data.plan import DataStateMismatch  # noqa: F401  (re-exported)
from jaxsora.data.tables import TableIndex
from jaxsora.data.video import DecodeError, load_sample

MAX_REPLACEMENTS = 16
# How often a grain worker checks that the process that started it is alive (seconds).
PARENT_POLL_S = 0.5
# Element count of the (unbounded) plan dataset; grain wants a length.
_ENDLESS = 1 << 50


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or a job's share)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def default_codec_threads(num_workers: int, decode_threads: int = 1, cores: int | None = None) -> int:
    """Decoder threads per sample when none are given: the host's cores over the threads decoding at
    once (worker processes × grain read threads), at least 1 and at most 4 — frame threading adds a
    frame of delay and a decoder context per thread, which a window of a few dozen frames per sample
    does not repay beyond a few threads."""
    busy = max(1, int(num_workers)) * max(1, int(decode_threads))
    return max(1, min(4, (cores or host_cores()) // busy))


class _PlanSource:
    """The random-access source behind the grain dataset: element k → the host share of the k-th
    batch after (epoch, index). Pickled into each worker (the table travels as its index folder)."""

    def __init__(self, table: TableIndex, bucket_config: dict, extra_resolutions, *, seed: int, dp: int,
                 frame_interval: int, process_index: int, process_count: int, epoch: int, index: int,
                 planner: plan_lib.Planner | None = None, text_inputs: Callable | None = None,
                 codec_threads: int = 1):
        self.table, self.bucket_config, self.extra_resolutions = table, bucket_config, extra_resolutions
        self.text_inputs, self.codec_threads = text_inputs, max(1, int(codec_threads))
        self.seed, self.dp, self.frame_interval = seed, dp, frame_interval
        self.process_index, self.process_count = process_index, process_count
        self.start = (epoch, index)
        self._planner = planner  # shared with the loader in-process; rebuilt in each worker
        self._segments: list = []  # [(first k, epoch, first index, batches in epoch)], grown lazily
        self._lock = threading.RLock()

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_planner", "_segments", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _planner=None, _segments=[], _lock=threading.RLock())

    @property
    def planner(self) -> plan_lib.Planner:
        with self._lock:
            if self._planner is None:
                sizes = (self.table.num_frames, self.table.height, self.table.width)
                self._planner = plan_lib.Planner(sizes, Buckets(self.bucket_config, self.extra_resolutions),
                                                 seed=self.seed, dp=self.dp, frame_interval=self.frame_interval)
            return self._planner

    def __len__(self) -> int:
        return _ENDLESS

    def position(self, k: int) -> tuple[int, int, int]:
        """Element k → (epoch, batch index, batches in that epoch)."""
        with self._lock:
            return self._position(k)

    def _position(self, k: int) -> tuple[int, int, int]:
        segs = self._segments
        if not segs or k < segs[0][0]:
            segs.clear()
            e, i = self.start
            segs.append((0, e, i, len(self.planner.plan(e))))
        empty = 0
        while True:
            k0, e, i0, n = segs[-1]
            if k < k0 + n - i0:
                break
            nxt = len(self.planner.plan(e + 1))
            empty = empty + 1 if nxt == 0 else 0
            if empty >= 3:  # an epoch can come up empty by chance (keep probabilities); three cannot
                raise ValueError(f"epochs {e - 1}..{e + 1} have no full batch: the table has too few rows for "
                                 "the bucket config's batch sizes × data-parallel size (see --dry-run)")
            segs.append((k0 + n - i0, e + 1, 0, nxt))
            del segs[:-4]
        for k0, e, i0, n in reversed(segs):
            if k >= k0:
                return e, i0 + (k - k0), n
        raise AssertionError("unreachable")

    def _decode_slot(self, epoch: int, index: int, slot: int, pb) -> tuple:
        """→ (row, video [3, T, H, W] uint8, fps, [skip reasons]) for one slot of planned batch `pb`."""
        t, h, w = pb.size
        row = int(pb.rows[slot])
        skips = []
        for attempt in range(MAX_REPLACEMENTS + 1):
            rng = np.random.default_rng([self.seed, epoch, row, 1])  # the temporal crop of this row
            try:
                if not self.table.text(row).strip():
                    raise DecodeError(f"empty caption for {self.table.path(row)}", "empty_caption")
                video, fps = load_sample(self.table.path(row), t, h, w, frame_interval=self.frame_interval,
                                         rng=rng, num_frames_hint=int(self.table.num_frames[row]),
                                         threads=self.codec_threads)
                if video.shape != (3, t, h, w) or video.dtype != np.uint8:
                    raise DecodeError(f"{self.table.path(row)} decoded to {video.dtype} {video.shape}, "
                                      f"not uint8 {(3, t, h, w)}", "bad_shape")
                return row, video, fps, skips
            except DecodeError as e:
                skips.append(e.reason)
                msg = " ".join(str(e).split())  # one line
                print(f"[jaxsora.data] skipped row {row} ({e.reason}): {msg}", file=sys.stderr, flush=True)
                same_bucket = self.planner.bucket_rows(epoch, pb.bucket)
                pick = np.random.default_rng([self.seed, epoch, index, slot, attempt + 1])
                row = int(same_bucket[pick.integers(len(same_bucket))])
        raise DecodeError(f"{MAX_REPLACEMENTS} replacement samples in bucket {pb.bucket} failed "
                          f"({dict(collections.Counter(skips))}); check the dataset "
                          "(python -m data_tools.meta lists unreadable files)")

    def __getitem__(self, k: int) -> dict:
        epoch, index, n = self.position(int(k))
        pb = self.planner.plan(epoch)[index]
        share = len(pb.rows) // self.process_count
        slots = range(self.process_index * share, (self.process_index + 1) * share)
        results = [self._decode_slot(epoch, index, s, pb) for s in slots]
        rows = np.array([r[0] for r in results], np.int64)
        texts = [self.table.text(r) for r in rows]
        t, h, w = pb.size
        text_inputs = self.text_inputs(texts, rows) if self.text_inputs is not None else {}
        skipped = collections.Counter(reason for r in results for reason in r[3])
        return dict(
            text_inputs, video=np.stack([r[1] for r in results]), text=np.array(texts, object),
            fps=np.array([r[2] for r in results], np.float32), height=np.full(len(rows), h, np.float32),
            width=np.full(len(rows), w, np.float32), num_frames=np.full(len(rows), t, np.int32), row=rows,
            skipped={reason: int(c) for reason, c in sorted(skipped.items())}, epoch=epoch, index=index + 1,
            epoch_batches=n, bucket=(pb.bucket[0], t, h, w),
        )


class _ExitWithParent:
    """grain `worker_init_fn`: a daemon thread in the worker that ends it (`os._exit`) as soon as
    the process that started it is gone — its parent pid changes when the parent dies, kill -9
    included. Grain's workers are daemonic, so a normal exit already stops them; a killed trainer
    left them running (blocked on their full output queues). Polling rather than Linux's
    PR_SET_PDEATHSIG: that signal fires when the *thread* that started the child exits, and grain
    starts its workers from its own prefetch threads, which end and are replaced while the trainer
    lives (it would kill live workers); polling is also portable. What the worker had in shared
    memory is reclaimed by multiprocessing's resource tracker, which exits after the last process
    holding it.

    It also registers faulthandler for SIGUSR1, so that the trainer's watchdog can ask a stalled
    loader's workers for their stacks (`train.run.supervise.Watchdog`)."""

    def __init__(self, parent_pid: int):
        self.parent_pid = int(parent_pid)

    def __call__(self, worker_index: int = 0, worker_count: int = 1) -> None:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        threading.Thread(target=self._watch, name="jaxsora-exit-with-parent", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)


def _unlink_shared_memory(batch: dict) -> None:
    """Remove the /dev/shm names of the batch's grain shared-memory arrays now (the mapping stays
    valid until the arrays are freed). Grain otherwise unlinks them when the arrays are garbage
    collected, which does not happen for those still referenced at interpreter exit: the resource
    tracker then warns about leaked shared_memory objects."""
    for value in batch.values():
        shm = getattr(value, "shm", None)
        if shm is not None and getattr(value, "_unlink_on_del", False):
            shm.unlink()  # also unregisters it from the resource tracker
            value._unlink_on_del = False  # grain's flag: its __del__ then only unmaps


class VideoLoader:
    """Global batches of the reference's bucket shapes from a table of videos and images.

    num_workers: grain worker processes decoding batches (0: decode in this process).
    decode_threads: grain read threads per process (batches decoded concurrently in each).
    codec_threads: FFmpeg decoder (and swscale) threads per sample being decoded; 0 (default):
    `default_codec_threads` — the host's cores shared among the decoding threads, 1 to 4. The
    frames do not depend on it.
    prefetch: batches buffered ahead per worker (and in this process).
    index_dir: where the memory-mapped table index goes (default: a temporary folder); an index of
    the same table files found there is reused.
    text_inputs: captions → the step's text inputs (token ids or cached text states), called where
    the batch is decoded (`train.build.TextInputs`; picklable), so the training thread does no
    tokenization or cache reads.

    skip_counts: {reason: count} of the skips in the batches yielded so far (a bad row met twice
    counts twice), saved in `state()`; `num_skipped` is their sum.
    """

    def __init__(self, table: str, bucket_config: Mapping, *, seed: int, data_parallel_size: int,
                 process_index: int = 0, process_count: int = 1, num_workers: int = 0, decode_threads: int = 1,
                 frame_interval: int = 1, extra_resolutions: Mapping | None = None, prefetch: int = 2,
                 index_dir: str | None = None, progress: bool = True, text_inputs: Callable | None = None,
                 codec_threads: int = 0):
        if index_dir and int(process_count) > 1:  # one index per host, even on a shared filesystem
            index_dir = f"{index_dir.rstrip('/')}/host{int(process_index)}"
        self.table = TableIndex.build(table, index_dir, progress=progress)
        self.bucket_config = normalize_bucket_config(bucket_config)
        self.extra_resolutions = extra_resolutions
        self.buckets = Buckets(self.bucket_config, extra_resolutions)
        self.seed, self.dp, self.frame_interval = int(seed), int(data_parallel_size), int(frame_interval)
        if self.dp % int(process_count):
            raise ValueError(f"data-parallel size {self.dp} is not a multiple of the process count {process_count}")
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.num_workers, self.decode_threads = int(num_workers), max(1, int(decode_threads))
        self.codec_threads = (int(codec_threads) if int(codec_threads) > 0
                              else default_codec_threads(self.num_workers, self.decode_threads))
        self.prefetch = max(1, int(prefetch))
        self.fingerprint = plan_lib.make_fingerprint(
            self.table.fingerprint,
            {k: {str(f): v for f, v in fr.items()} for k, fr in self.bucket_config.items()},
            self.seed, self.dp, self.frame_interval)
        self.epoch = 0
        self.index = 0  # batches completed in the epoch (after the last one yielded)
        self.skip_counts: dict[str, int] = {}  # reason → skips in the batches yielded so far
        self.text_inputs = text_inputs
        self._planner = plan_lib.Planner((self.table.num_frames, self.table.height, self.table.width),
                                         self.buckets, seed=self.seed, dp=self.dp, frame_interval=self.frame_interval)

    @property
    def num_rows(self) -> int:
        return len(self.table)

    @property
    def num_skipped(self) -> int:
        """Skips so far, all reasons (`skip_counts` has them per reason)."""
        return sum(self.skip_counts.values())

    # ---- plan ---------------------------------------------------------------------------------
    def plan(self, epoch: int) -> list:
        return self._planner.plan(epoch)

    def steps_per_epoch(self, epoch: int = 0) -> int:
        return len(self.plan(epoch))

    def describe_plan(self, epoch: int = 0) -> list:
        """[(bucket (res, T, H, W), batches this epoch, global batch, rows assigned)] per (res, T, H, W),
        in order of first appearance; a bucket whose rows cannot fill one global batch shows 0 batches."""
        groups = self._planner.groups  # a fixed assignment (feature cache), else this epoch's
        if groups is None:
            groups = plan_lib.assign_rows(self._planner.sizes, self.buckets, seed=self.seed, epoch=epoch,
                                          frame_interval=self.frame_interval)
        counts = collections.OrderedDict()
        for b, rows in groups.items():
            f, h, w = self.buckets.target_size(b)
            gbs = self.buckets.bucket_batch_size(b) * self.dp
            n, _, r = counts.get((b[0], f, h, w), (0, gbs, 0))
            counts[(b[0], f, h, w)] = (n + len(rows) // gbs, gbs, r + len(rows))
        return [(k, n, gb, r) for k, (n, gb, r) in counts.items()]

    def left_out_note(self, epoch: int = 0, plan: list | None = None) -> str | None:
        """One line when rows of the table sit out epoch `epoch` (None when every row has a bucket):
        how many, and how many are clips too short for every video bucket — a T-frame bucket takes
        clips of more than T·frame_interval frames (Open-Sora's rule), so 8-frame clips with an
        8-frame bucket train nowhere, without an error. `plan`: `describe_plan(epoch)` when the caller
        has it already (assigning a large table's rows is not free)."""
        assigned = sum(r for *_, r in (self.describe_plan(epoch) if plan is None else plan))
        total = self.num_rows
        if assigned >= total:
            return None
        video_frames = [f for fr in self.bucket_config.values() for f, (p, b) in fr.items()
                        if f != 1 and b is not None and (max(p) if isinstance(p, tuple) else p) > 0]
        t = np.asarray(self.table.num_frames)
        short = int(((t > 1) & (t <= min(video_frames) * self.frame_interval)).sum()) if video_frames else 0
        why = (f"{short} are clips of too few frames for every video bucket (a T-frame bucket takes more than "
               f"T·frame_interval frames); " if short else "")
        return (f"epoch {epoch} trains on {assigned} of {total} rows: {why}{total - assigned - short} fit no bucket "
                f"this epoch (keep probabilities, sizes) — --dry-run shows the plan")

    # ---- state --------------------------------------------------------------------------------
    def state(self) -> dict:
        """{epoch, index, fingerprint, skipped: {reason: count}} (JSON-serializable)."""
        return dict(epoch=self.epoch, index=self.index, fingerprint=self.fingerprint,
                    skipped=dict(sorted(self.skip_counts.items())))

    def restore(self, state: dict, reset: bool = False) -> None:
        """Continue from `state` (refused if the data setup changed, see `plan.check_state`), or with
        `reset`, from the start with zero counts. States saved before the counts existed restore
        with zero counts."""
        if reset:
            self.epoch, self.index, self.skip_counts = 0, 0, {}
            return
        plan_lib.check_state(state, self.fingerprint)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.skip_counts = {str(r): int(c) for r, c in dict(state.get("skipped") or {}).items()}

    # ---- iteration ----------------------------------------------------------------------------
    def _plan_source(self) -> _PlanSource:
        """The random-access source of the dataset, from the current position."""
        return _PlanSource(self.table, self.bucket_config, self.extra_resolutions, seed=self.seed, dp=self.dp,
                           frame_interval=self.frame_interval, process_index=self.process_index,
                           process_count=self.process_count, epoch=self.epoch, index=self.index,
                           planner=self._planner, text_inputs=self.text_inputs, codec_threads=self.codec_threads)

    def dataset(self):
        """The grain pipeline from the current position: a `MapDataset` over the plan, read by
        `decode_threads` threads, in `num_workers` processes."""
        import grain

        ds = grain.MapDataset.source(self._plan_source()).to_iter_dataset(
            grain.ReadOptions(num_threads=self.decode_threads, prefetch_buffer_size=self.prefetch))
        if self.num_workers > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain reads its absl flags when it starts workers; outside
                flags.FLAGS.mark_as_parsed()  # an absl app (tests, notebooks) their defaults apply
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers,
                                                             per_worker_buffer_size=self.prefetch),
                                worker_init_fn=_ExitWithParent(os.getpid()))
        return ds

    def __iter__(self) -> Iterator[dict]:
        it = iter(self.dataset())
        try:
            for batch in it:
                _unlink_shared_memory(batch)
                for reason, count in batch.pop("skipped").items():
                    self.skip_counts[reason] = self.skip_counts.get(reason, 0) + int(count)
                n = int(batch.pop("epoch_batches"))
                self.epoch, self.index = int(batch["epoch"]), int(batch["index"])
                if self.index >= n:
                    self.epoch, self.index = self.epoch + 1, 0
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
