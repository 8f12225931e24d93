"""A feature cache: every clip's VAE latents and T5 caption states, computed once, trained from
many times (Open-Sora 1.2's feature training, `stage1_feat`: multi-epoch stages then run only
STDiT3 — no video decoding, no VAE and no T5 on the accelerators).

Written by `python -m data_tools.precompute --latents --config ...` (`data_tools/latents.py`),
read here; training uses it with `data.features=DIR`.

What a record holds, and why the assignment is fixed. The video loader assigns each row to a
bucket anew every epoch (keep probabilities draw from (seed, epoch, row)) and crops a new window;
a latent, though, is computed at one size and length. So the cache fixes each row's bucket and
temporal window to those of epoch 0 — exactly what the video loader gives in epoch 0 — and stores
them with it; every epoch then shuffles the same rows within the same buckets (`plan.epoch_plan`
with fixed `groups`). The VAE posterior is sampled once per clip, as Open-Sora's feature
extraction does. Rows that could not be decoded at precompute time are left out (counted per
reason in the manifest), so training from features never skips.

Layout of a feature directory (TFDS ArrayRecord, read with TFDS's own data source):

* `features-train.array_record-XXXXX-of-YYYYY`: shards, each holding rows of one bucket. A record:
  `row` (table row), `bucket` (index into the manifest's `buckets`), `text` (the caption),
  `latent` [C, t, h, w] and `y` [length, D] (the valid text tokens' states; `length` of them) in
  the stored dtype, and the pixel-space `fps`, `num_frames`, `height`, `width` the step conditions on.
* `dataset_info.json`, `features.json`: TFDS metadata (`tfds.builder_from_directory(dir)`).
* `assignment.npz`: `rows` and `bucket` per record, in record order — the plan needs no record.
* `plan.json`: what is being encoded (table fingerprint, buckets, seed, encoders), written first;
  `progress/<shard>.json`: one per finished shard, so an interrupted precompute resumes.
* `manifest.json`: written last; a directory without it is incomplete. Its `fingerprint` (plan +
  every shard's rows) is the dataset identity a resumed run checks.
"""
from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxsora.data import plan as plan_lib
from jaxsora.data.buckets import Buckets, normalize_bucket_config
from jaxsora.data.cache import SPLIT, np_dtype  # the ArrayRecord/TFDS conventions both caches share
from jaxsora.data.loader import VideoLoader, _PlanSource
from jaxsora.errors import MissingFile, UserError

FORMAT = "jaxsora.features/1"
DATASET_NAME = "features"
MANIFEST = "manifest.json"
PLAN = "plan.json"
ASSIGNMENT = "assignment.npz"
PROGRESS = "progress"


class FeatureCacheError(UserError, ValueError):
    """A feature directory that is incomplete, corrupt, or does not fit the run."""


def shard_name(i: int, n: int) -> str:
    return f"{DATASET_NAME}-{SPLIT}.array_record-{i:05d}-of-{n:05d}"


def tfds_features(latent_channels: int, caption_channels: int, store_dtype: str):
    """The TFDS FeaturesDict of one record (tensorflow_datasets, no TensorFlow)."""
    import tensorflow_datasets as tfds

    dt = np_dtype(store_dtype)
    enc = tfds.features.Encoding.BYTES
    return tfds.features.FeaturesDict({
        "row": tfds.features.Scalar(dtype=np.int64),
        "bucket": tfds.features.Scalar(dtype=np.int32),
        "text": tfds.features.Text(),
        "length": tfds.features.Scalar(dtype=np.int32),
        "latent": tfds.features.Tensor(shape=(latent_channels, None, None, None), dtype=dt, encoding=enc),
        "y": tfds.features.Tensor(shape=(None, caption_channels), dtype=dt, encoding=enc),
        "fps": tfds.features.Scalar(dtype=np.float32),
        "num_frames": tfds.features.Scalar(dtype=np.int32),
        "height": tfds.features.Scalar(dtype=np.int32),
        "width": tfds.features.Scalar(dtype=np.int32),
    })


def bucket_key(entry: Mapping) -> tuple:
    """A manifest bucket entry → the bucket key (res, frames, aspect-ratio key) of `Buckets`."""
    res, frames, ar = entry["key"]
    return (str(res), int(frames), str(ar))


def serialize_record(features, record: Mapping) -> bytes:
    """One record's bytes: TFDS's tf.train.Example, serialized with its feature map in key order
    (protobuf's default map order varies between processes, so two runs of the same precompute
    would write different shard bytes and a cache could not be checked by its checksums)."""
    from tensorflow_datasets.proto import tf_example_pb2

    return tf_example_pb2.Example.FromString(features.serialize_example(record)).SerializeToString(deterministic=True)


def shard_problem(path: str, expected: int | None) -> str | None:
    """None when the ArrayRecord shard at `path` is there and holds `expected` records (None: any);
    else what is wrong with it. Reads only the file's footer (a truncated file has none: 0 records)."""
    from array_record.python.array_record_module import ArrayRecordReader

    if not os.path.exists(path):
        return "is missing"
    try:
        reader = ArrayRecordReader(path)
        try:
            n = int(reader.num_records())
        finally:
            reader.close()
    except Exception as e:  # noqa: BLE001 — any reader error: the file is not a readable shard
        detail = " ".join(str(e).split())[:120]
        return f"is unreadable (truncated, or not an ArrayRecord file{': ' + detail if detail else ''})"
    if expected is not None and n != int(expected):
        return f"holds {n} records where {int(expected)} were written (truncated, or another file)"
    return None


# (folder, every shard's (name, size, mtime)) this process found intact (`FeatureStore._check_shards`)
_INTACT_SHARDS: set = set()


class FeatureStore:
    """Random access to a finished feature directory. Picklable (the TFDS source reopens lazily),
    so it can travel into grain workers.

    read(rows) → the records of those table rows (dicts of numpy arrays; `text` as str)."""

    def __init__(self, directory: str):
        self.dir = str(directory)
        path = os.path.join(self.dir, MANIFEST)
        if not os.path.isdir(self.dir):
            raise MissingFile(f"data.features: no such folder {self.dir}")
        if not os.path.exists(path):
            hint = (" (precompute did not finish: run it again with the same arguments to resume)"
                    if os.path.exists(os.path.join(self.dir, PLAN)) else
                    " (not a feature cache: make one with python -m data_tools.precompute --latents)")
            raise FeatureCacheError(f"{self.dir}: no {MANIFEST}{hint}")
        try:
            with open(path) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise FeatureCacheError(f"{path} does not read as JSON: {e}") from None
        if self.manifest.get("format") != FORMAT:
            raise FeatureCacheError(f"{path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self._check_shards()
        try:
            with np.load(os.path.join(self.dir, ASSIGNMENT)) as a:
                self.record_rows = np.asarray(a["rows"], np.int64)
                self.record_bucket = np.asarray(a["bucket"], np.int32)
        except (OSError, ValueError, KeyError) as e:
            raise FeatureCacheError(f"{self.dir}: {ASSIGNMENT} is missing or corrupt ({e})") from None
        if len(self.record_rows) != int(self.manifest["num_records"]):
            raise FeatureCacheError(f"{self.dir}: {ASSIGNMENT} lists {len(self.record_rows)} records, the manifest "
                                    f"{self.manifest['num_records']}")
        self.buckets = [bucket_key(b) for b in self.manifest["buckets"]]
        self.sizes = [tuple(int(v) for v in b["size"]) for b in self.manifest["buckets"]]
        self.latent_shapes = [tuple(int(v) for v in b["latent"]) for b in self.manifest["buckets"]]
        self.model_max_length = int(self.manifest["model_max_length"])
        self.caption_channels = int(self.manifest["caption_channels"])
        self.latent_channels = int(self.manifest["latent_channels"])
        self.dtype = str(self.manifest["dtype"])
        self._order = np.argsort(self.record_rows, kind="stable")
        self._source = None
        self._lock = threading.Lock()

    def _check_shards(self) -> None:
        """Every shard there with its record count, before a run takes its folder. A start-up opens the
        store three times (config check, encoders, loader): shards whose size and mtime this process has
        already found intact are not read again."""
        names = list(self.manifest["shards"])
        stats = []
        for name in names:
            try:
                st = os.stat(os.path.join(self.dir, name))
                stats.append((name, st.st_size, st.st_mtime_ns))
            except OSError:
                stats.append((name, None, None))
        key = (os.path.realpath(self.dir), tuple(stats))
        if key in _INTACT_SHARDS:
            return
        lengths = self.manifest.get("shard_lengths") or [None] * len(names)
        for name, n in zip(names, lengths):
            problem = shard_problem(os.path.join(self.dir, name), n)
            if problem:
                raise FeatureCacheError(
                    f"{self.dir}: shard {name} {problem}: run the same `python -m data_tools.precompute` command "
                    f"again to re-make it (or --overwrite to re-make the whole cache)")
        _INTACT_SHARDS.add(key)

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def __len__(self) -> int:
        return len(self.record_rows)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_source", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _source=None, _lock=threading.Lock())

    @property
    def source(self):
        """TFDS's own ArrayRecord data source over the shards (decodes the records to numpy)."""
        with self._lock:
            if self._source is None:
                import tensorflow_datasets as tfds

                self._source = tfds.builder_from_directory(self.dir).as_data_source(SPLIT)
            return self._source

    def groups(self) -> collections.OrderedDict[tuple, np.ndarray]:
        """bucket key → its table rows (ascending), in manifest order: the fixed assignment."""
        out = collections.OrderedDict()
        for i, key in enumerate(self.buckets):
            out[key] = np.sort(self.record_rows[self.record_bucket == i])
        return collections.OrderedDict((k, v) for k, v in out.items() if len(v))

    def records_of(self, rows: Sequence[int]) -> np.ndarray:
        """Table rows → record indices (a row absent from the cache is an error naming it)."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        pos = np.searchsorted(self.record_rows, rows, sorter=self._order)
        pos = np.minimum(pos, len(self._order) - 1)
        idx = self._order[pos]
        bad = rows[self.record_rows[idx] != rows]
        if len(bad):
            raise FeatureCacheError(f"{self.dir}: table row {int(bad[0])} has no record")
        return idx

    def read(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        idx = self.records_of(rows)
        try:
            recs = self.source.__getitems__([int(i) for i in idx])
        except Exception as e:  # a truncated or corrupt shard: name the folder, not a reader internals trace
            raise FeatureCacheError(f"{self.dir}: reading records {list(idx)[:4]}... failed ({type(e).__name__}: "
                                    f"{' '.join(str(e).split())[:200]}); rerun data_tools.precompute") from None
        for r, rec in zip(rows, recs):
            if int(rec["row"]) != int(r):
                raise FeatureCacheError(f"{self.dir}: the record of row {int(r)} holds row {int(rec['row'])} "
                                        "(assignment.npz does not match the shards)")
            t = rec["text"]
            rec["text"] = t.decode("utf-8") if isinstance(t, bytes) else str(t)
        return recs

    def text_inputs(self, recs: Sequence[Mapping]) -> dict:
        """Records → the step's cached text inputs: ids [b, L, D] float32 (the states, zeros past
        each caption's length) and text_mask [b, L] int32, as `train.build.TextInputs` gives them."""
        L, D = self.model_max_length, self.caption_channels
        y = np.zeros((len(recs), L, D), np.float32)
        mask = np.zeros((len(recs), L), np.int32)
        for i, rec in enumerate(recs):
            n = int(rec["length"])
            y[i, :n] = np.asarray(rec["y"], np.float32)
            mask[i, :n] = 1
        return dict(ids=y, text_mask=mask)


class _FeatureSource(_PlanSource):
    """Element k → the host share of the k-th planned batch, read from the feature records."""

    def __init__(self, store: FeatureStore, buckets: Buckets, *, seed: int, dp: int, process_index: int,
                 process_count: int, epoch: int, index: int, planner: plan_lib.Planner | None = None):
        self.store, self.buckets = store, buckets
        self.seed, self.dp, self.frame_interval = seed, dp, 1
        self.process_index, self.process_count = process_index, process_count
        self.start = (epoch, index)
        self._planner = planner
        self._segments: list = []
        self._lock = threading.RLock()

    @property
    def planner(self) -> plan_lib.Planner:
        with self._lock:
            if self._planner is None:
                self._planner = fixed_planner(self.store, self.buckets, self.seed, self.dp)
            return self._planner

    def __getitem__(self, k: int) -> dict:
        epoch, index, n = self.position(int(k))
        pb = self.planner.plan(epoch)[index]
        share = len(pb.rows) // self.process_count
        rows = np.asarray(pb.rows[self.process_index * share:(self.process_index + 1) * share], np.int64)
        recs = self.store.read(rows)
        t, h, w = pb.size
        return dict(
            self.store.text_inputs(recs), latents=np.stack([np.asarray(r["latent"]) for r in recs]),
            text=np.array([r["text"] for r in recs], object), fps=np.array([r["fps"] for r in recs], np.float32),
            height=np.full(len(rows), h, np.float32), width=np.full(len(rows), w, np.float32),
            num_frames=np.full(len(rows), t, np.int32), row=rows, skipped={}, epoch=epoch, index=index + 1,
            epoch_batches=n, bucket=(pb.bucket[0], t, h, w))


def fixed_planner(store: FeatureStore, buckets: Buckets, seed: int, dp: int) -> plan_lib.Planner:
    """The epoch plans of the cache's fixed assignment, with the run's batch sizes."""
    groups = store.groups()
    for key, size in zip(store.buckets, store.sizes):
        if key in groups and tuple(buckets.target_size(key)) != size:
            raise FeatureCacheError(f"{store.dir}: bucket {key} was encoded at (T, H, W) {size}, the run's buckets "
                                    f"give {tuple(buckets.target_size(key))}")
    return plan_lib.Planner(None, buckets, seed=seed, dp=dp, groups=groups)


def run_buckets(store: FeatureStore, bucket_config: Mapping, extra_resolutions: Mapping | None) -> Buckets:
    """The run's `Buckets` (its batch sizes), checked against the cache: every bucket the cache
    holds must be one the run's bucket config has, with a batch size."""
    buckets = Buckets(bucket_config, extra_resolutions)
    known = set(buckets.bucket_keys)
    lacking = [k for k in store.groups() if k not in known or not buckets.bucket_batch_size(k)]
    if lacking:
        raise FeatureCacheError(
            f"{store.dir}: the run's data.bucket_config has no batch size for {len(lacking)} bucket(s) the features "
            f"were encoded in, e.g. {lacking[0]} (use the bucket config the features were made with; only batch "
            "sizes may differ)")
    return buckets


class FeatureLoader(VideoLoader):
    """`VideoLoader`'s interface (plan, state, exact resume, the dataset-change refusal) over a
    feature directory: host batches carry `latents` [b, C, t, h, w] (the stored dtype) and the
    cached text states as `ids` [b, L, D] / `text_mask` instead of video and token ids.

    The fingerprint covers the cache's own fingerprint (its table, assignment, encoders and
    records), the batch sizes, the seed and the data-parallel size."""

    def __init__(self, directory: str, bucket_config: Mapping, *, seed: int, data_parallel_size: int,
                 process_index: int = 0, process_count: int = 1, num_workers: int = 0, decode_threads: int = 1,
                 extra_resolutions: Mapping | None = None, prefetch: int = 2):
        self.store = FeatureStore(directory)
        self.bucket_config = normalize_bucket_config(bucket_config)
        self.extra_resolutions = extra_resolutions
        self.buckets = run_buckets(self.store, self.bucket_config, extra_resolutions)
        self.seed, self.dp, self.frame_interval = int(seed), int(data_parallel_size), 1
        if self.dp % int(process_count):
            raise ValueError(f"data-parallel size {self.dp} is not a multiple of the process count {process_count}")
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.num_workers, self.decode_threads = int(num_workers), max(1, int(decode_threads))
        self.codec_threads = 1
        self.prefetch = max(1, int(prefetch))
        self.fingerprint = plan_lib.make_fingerprint(
            f"features:{self.store.fingerprint}",
            {k: {str(f): v for f, v in fr.items()} for k, fr in self.bucket_config.items()}, self.seed, self.dp, 1)
        self.epoch = self.index = 0
        self.skip_counts: dict[str, int] = {}
        self.text_inputs = None
        self._planner = fixed_planner(self.store, self.buckets, self.seed, self.dp)

    @property
    def num_rows(self) -> int:
        return len(self.store)

    def _plan_source(self) -> _FeatureSource:
        return _FeatureSource(self.store, self.buckets, seed=self.seed, dp=self.dp, process_index=self.process_index,
                              process_count=self.process_count, epoch=self.epoch, index=self.index,
                              planner=self._planner)
