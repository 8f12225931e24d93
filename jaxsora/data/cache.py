"""Pre-computed text-encoder states (T5 caption states) in ArrayRecord shards.

Open-Sora 1.2 runs the frozen T5-v1.1-XXL encoder on every caption of every step
(`scripts/train.py`). The encoder has ≈4.76B parameters, so one caption of 300 tokens costs ≈ 2 × 4.76e9 × 300
≈ 2.8 TFLOP (≈ 5–10 ms of an H100 in bf16) and its bf16 weights take ≈ 9.5 GB of device
memory beside STDiT3. Reading the cached states instead costs len × 4096 × 2 bytes (bf16): ≈ 0.4 MB for
a 50-token caption, 2.4 MB for a full 300-token one.

Caching pays off when

* the text encoder is frozen (it always is in Open-Sora 1.2) and the captions are fixed — any
  caption edit (cleaning, score text) means re-running `python -m data_tools.precompute`;
* the data is seen more than once: stages 1 and 3 of Open-Sora 1.2 run ≈ 2 epochs, so every
  caption would be encoded twice or more; a single pass over < 1 epoch (stage 2 ran ≈ 0.5 epoch)
  gains little beyond the freed device memory;
* device memory or step time is the bottleneck: without T5 on the accelerators the memory goes to
  bigger batches, and the step no longer waits for 24 T5 layers;

and it costs disk space (up to ≈ 2.4 MB × samples in bf16 for long LLM captions) and one full
encoding pass up front. CFG caption dropout is unaffected: it happens inside STDiT3
(`y_embedding`), after the lookup.

Layout of a cache directory (written by `data_tools.precompute`):

* `text_states-train.array_record-XXXXX-of-YYYYY`: ArrayRecord shards, contiguous row ranges in
  table order, so record index = table row. Each record is a serialized `tf.train.Example` with
  features `row` (int64), `key` (`"<row>:<caption hash>"`), `caption_hash`, `length` (int32, number
  of valid tokens, EOS included) and `y` (`[length, D]`, the valid tokens' states only, raw bytes of
  the stored dtype). These are TFDS `Tensor`/`Text`/`Scalar` features: the cache reads them as a
  TFDS dataset (`tfds.builder_from_directory(dir).as_data_source("train")`, no TensorFlow needed),
  and the same files read as `grain.sources.ArrayRecordDataSource` (raw bytes, which
  `parse_record` decodes with the same TFDS features).
* `dataset_info.json`, `features.json`: TFDS metadata.
* `manifest.json`: encoder config, table path and fingerprint, L (`model_max_length`), D
  (`caption_channels`), stored dtype, shards. Written last, so a cache without it is incomplete.

`TextStateCache(dir).lookup(rows, texts)` restores the padded `y [b, 1, L, D]` float32 (zeros at
padded token positions — STDiT3 only reads tokens where mask = 1) and `mask [b, L]` int32, and
checks each caption's hash against the table's current caption (`StaleCacheError` names the row).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxsora.errors import BadInput, MissingFile, UserError

MANIFEST = "manifest.json"
FORMAT = "jaxsora.text_states/1"
DATASET_NAME = "text_states"
SPLIT = "train"
# TFDS file naming, so `tfds.builder_from_directory` finds the shards.
FILENAME_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
STORE_DTYPES = ("float32", "bfloat16", "float16")


class StaleCacheError(UserError, ValueError):
    """The table's caption for a row differs from the one the cache was computed from."""


def caption_hash(text: str) -> str:
    """First 16 hex digits of sha1(utf-8 caption)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def table_fingerprint(texts: Sequence[str]) -> str:
    """sha256 over the ordered captions (row count included)."""
    h = hashlib.sha256(str(len(texts)).encode())
    for t in texts:
        h.update(b"\0" + t.encode("utf-8"))
    return h.hexdigest()


def np_dtype(name: str) -> np.dtype:
    if name not in STORE_DTYPES:
        raise BadInput(f"store dtype must be one of {STORE_DTYPES}, got {name!r}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def shard_names(num_shards: int) -> list[str]:
    return [f"{DATASET_NAME}-{SPLIT}.array_record-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]


# --------------------------------------------------------------------------------------------
# record format
# --------------------------------------------------------------------------------------------
def tfds_features(caption_channels: int, store_dtype: str):
    """The TFDS FeaturesDict of one record (needs tensorflow_datasets, not TensorFlow)."""
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict(
        {
            "row": tfds.features.Scalar(dtype=np.int64),
            "key": tfds.features.Text(),
            "caption_hash": tfds.features.Text(),
            "length": tfds.features.Scalar(dtype=np.int32),
            "y": tfds.features.Tensor(
                shape=(None, caption_channels),
                dtype=np_dtype(store_dtype),
                encoding=tfds.features.Encoding.BYTES,
            ),
        }
    )


def _decoded(ex: dict, caption_channels: int) -> dict[str, Any]:
    """A record as TFDS decodes it → {"row", "key", "caption_hash", "length", "y"} (str/int/array)."""
    text = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)  # noqa: E731
    y = np.asarray(ex["y"]).reshape(-1, caption_channels)
    length = int(ex["length"])
    if y.shape[0] != length:
        raise ValueError(f"text-state record for row {int(ex['row'])}: y has {y.shape[0]} tokens, length says {length}")
    return {"row": int(ex["row"]), "key": text(ex["key"]), "caption_hash": text(ex["caption_hash"]),
            "length": length, "y": y}


def parse_record(record: bytes, caption_channels: int, store_dtype: str) -> dict[str, Any]:
    """One serialized cache record (as `grain.sources.ArrayRecordDataSource` returns it) → {"row": int,
    "key": str, "caption_hash": str, "length": int, "y": [length, D] in the stored dtype}, decoded by
    TFDS's own features (no TensorFlow)."""
    ex = tfds_features(caption_channels, store_dtype).deserialize_example_np(record)
    return _decoded(ex, caption_channels)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
def write_cache(
    out_dir: str,
    texts: Sequence[str],
    encoder,
    *,
    encoder_config: dict,
    num_shards: int = 1,
    batch_size: int = 16,
    store_dtype: str | None = None,
    table_path: str | None = None,
    progress: bool = True,
) -> dict:
    """Encode `texts` (row i = table row i) with `encoder` (a `TextEncoder`) into `out_dir`.
    Returns the manifest. `store_dtype` defaults to bfloat16 for a bf16 encoder, else float32."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from tqdm import tqdm

    n = len(texts)
    if n == 0:
        raise BadInput("the table has no rows to encode")
    if not 1 <= num_shards <= n:
        raise BadInput(f"num_shards must be in [1, {n}] (rows), got {num_shards}")
    if batch_size < 1:
        raise BadInput(f"batch_size must be >= 1, got {batch_size}")
    if store_dtype is None:
        store_dtype = "bfloat16" if str(encoder_config.get("dtype", "float32")) == "bfloat16" else "float32"
    sdt = np_dtype(store_dtype)
    L, D = encoder.model_max_length, encoder.caption_channels
    features = tfds_features(D, store_dtype)
    names = shard_names(num_shards)
    bounds = np.linspace(0, n, num_shards + 1).round().astype(int)
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):  # a previous cache here is replaced (incomplete until the manifest)
        if old == MANIFEST or old.startswith(f"{DATASET_NAME}-{SPLIT}.array_record-"):
            os.remove(os.path.join(out_dir, old))
    lengths, shard_lengths = [], []
    bar = tqdm(total=n, desc="encoding captions", unit="caption", disable=not progress)
    for s, name in enumerate(names):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        writer = ArrayRecordWriter(os.path.join(out_dir, name), "group_size:1")
        try:
            for start in range(lo, hi, batch_size):
                batch = list(texts[start : min(hi, start + batch_size)])
                y, mask = encoder.encode(batch)
                for j, text in enumerate(batch):
                    row = start + j
                    m = mask[j].astype(bool)
                    length = int(m.sum())
                    if not np.all(m[:length]):
                        raise ValueError(f"row {row}: attention mask is not a prefix of ones")
                    h = caption_hash(text)
                    rec = {
                        "row": row,
                        "key": f"{row}:{h}",
                        "caption_hash": h,
                        "length": length,
                        "y": np.ascontiguousarray(y[j, 0, :length]).astype(sdt),
                    }
                    writer.write(features.serialize_example(rec))
                    lengths.append(length)
                bar.update(len(batch))
        finally:
            writer.close()
        shard_lengths.append(hi - lo)
    bar.close()
    write_tfds_metadata(out_dir, features, DATASET_NAME, names, shard_lengths,
                        "jaxsora T5 caption states (valid tokens only); see manifest.json")
    manifest = {
        "format": FORMAT,
        "encoder": encoder_config,
        "table": table_path,
        "table_fingerprint": table_fingerprint(texts),
        "num_rows": n,
        "model_max_length": L,
        "caption_channels": D,
        "dtype": store_dtype,
        "shards": names,
        "shard_lengths": shard_lengths,
        "mean_length": float(np.mean(lengths)),
    }
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return manifest


def write_tfds_metadata(out_dir: str, features, dataset_name: str, shards: Sequence[str],
                        shard_lengths: Sequence[int], description: str) -> None:
    """TFDS's `dataset_info.json`/`features.json` for ArrayRecord shards named by `FILENAME_TEMPLATE`
    (split `SPLIT`), so that `tfds.builder_from_directory(out_dir)` reads them — shared by the
    text-state cache and the feature cache (`jaxsora.data.features`)."""
    import tensorflow_datasets as tfds

    num_bytes = sum(os.path.getsize(os.path.join(out_dir, p)) for p in shards)
    template = tfds.core.ShardedFileTemplate(data_dir=out_dir, template=FILENAME_TEMPLATE, dataset_name=dataset_name,
                                             split=SPLIT, filetype_suffix="array_record")
    split = tfds.core.SplitInfo(name=SPLIT, shard_lengths=list(shard_lengths), num_bytes=num_bytes,
                                filename_template=template)
    tfds.folder_dataset.write_metadata(data_dir=out_dir, features=features, split_infos=[split],
                                       filename_template=FILENAME_TEMPLATE, check_data=False, description=description)


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------
class TextStateCache:
    """Random access to a cache directory written by `data_tools.precompute`.

    `lookup(rows [b] int, texts [b] str) -> (y [b, 1, L, D] float32, mask [b, L] int32)`.
    Picklable (the reader reopens lazily), so it can run inside grain workers.
    """

    def __init__(self, cache_dir: str):
        self.dir = cache_dir
        path = os.path.join(cache_dir, MANIFEST)
        if not os.path.exists(path):
            raise MissingFile(
                f"{cache_dir}: no {MANIFEST} (not a text-state cache, or precompute did not finish)"
            )
        with open(path) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise BadInput(f"{path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        for name in self.manifest["shards"]:
            if not os.path.exists(os.path.join(cache_dir, name)):
                raise FileNotFoundError(f"{cache_dir}: shard {name!r} listed in {MANIFEST} is missing")
        self.model_max_length = int(self.manifest["model_max_length"])
        self.caption_channels = int(self.manifest["caption_channels"])
        self.dtype = self.manifest["dtype"]
        self.num_rows = int(self.manifest["num_rows"])
        self._source = None

    def __len__(self) -> int:
        return self.num_rows

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_source"] = None
        return d

    @property
    def source(self):
        """TFDS's own ArrayRecord data source over the shards (records decoded to numpy)."""
        if self._source is None:
            import tensorflow_datasets as tfds

            self._source = tfds.builder_from_directory(self.dir).as_data_source(SPLIT)
        return self._source

    def check_table(self, texts: Sequence[str]) -> None:
        """Raise `StaleCacheError` unless `texts` is exactly the table the cache was made from."""
        if len(texts) != self.num_rows:
            raise StaleCacheError(f"{self.dir}: cache has {self.num_rows} rows, the table has {len(texts)}")
        if table_fingerprint(texts) != self.manifest["table_fingerprint"]:
            bad = next(
                (i for i, t in enumerate(texts) if caption_hash(t) != self.read(i)["caption_hash"]),
                None,
            )
            raise StaleCacheError(f"{self.dir}: table captions changed since precompute (first at row {bad})")

    def read(self, row: int) -> dict[str, Any]:
        """The stored record of one row (valid tokens only)."""
        return self.read_many([row])[0]

    def read_many(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        rows = [int(r) for r in rows]
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise IndexError(f"{self.dir}: row {r} out of range (cache has {self.num_rows} rows)")
        recs = [_decoded(ex, self.caption_channels) for ex in self.source.__getitems__(rows)]
        for r, rec in zip(rows, recs):
            if rec["row"] != r:
                raise ValueError(f"{self.dir}: record at index {r} holds row {rec['row']} (corrupt cache)")
        return recs

    def lookup(self, rows: np.ndarray, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows).reshape(-1)
        if len(texts) != len(rows):
            raise ValueError(f"lookup: {len(rows)} rows but {len(texts)} texts")
        L, D = self.model_max_length, self.caption_channels
        y = np.zeros((len(rows), 1, L, D), np.float32)
        mask = np.zeros((len(rows), L), np.int32)
        for i, (rec, text) in enumerate(zip(self.read_many(rows), texts)):
            if rec["caption_hash"] != caption_hash(str(text)):
                raise StaleCacheError(
                    f"{self.dir}: row {rec['row']}: caption differs from the one cached "
                    f"(hash {caption_hash(str(text))} vs {rec['caption_hash']}); "
                    "rerun data_tools.precompute"
                )
            n = rec["length"]
            y[i, 0, :n] = rec["y"].astype(np.float32)
            mask[i, :n] = 1
        return y, mask
