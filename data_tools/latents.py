"""Encode a table once into a feature cache (`jaxsora.data.features`): each row's VAE latents at
the size and length of its epoch-0 bucket, and its T5 caption states.

    python -m data_tools.precompute --latents --config configs/stage1.py --out DIR [--config.k=v ...]

The run's own config says everything: the table (`data.table`), buckets, seed and frame interval
(rows are assigned and cropped by the trainer's code, so the features are what the video loader
gives in epoch 0), the VAE and text encoder, and the mesh they run on. Each shard holds rows of
one bucket; a batch of a shard is decoded by a pool of threads, sharded over the mesh's
data-parallel devices, encoded by the frozen VAE and T5 in one jitted call, and written; a
finished shard is recorded in `progress/`, so running the same command again after an
interruption encodes only the shards that are missing. With several processes, shard i is
encoded by process i mod P on its own devices, and process 0 writes the metadata at the end.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxsora.data import features as F
from jaxsora.data.cache import np_dtype
from jaxsora.errors import OutputExists

# Rows per shard: a few hundred MB of 720p latents; the unit of resumption.
DEFAULT_SHARD_SIZE = 256


def _plain(cfg):
    return json.loads(cfg.to_json_best_effort()) if hasattr(cfg, "to_json_best_effort") else dict(cfg or {})


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _units(groups, shard_size: int) -> list[tuple[tuple, np.ndarray]]:
    """[(bucket key, rows)] per shard: each bucket's rows (ascending) in chunks of shard_size."""
    return [(key, rows[i:i + shard_size]) for key, rows in groups.items() for i in range(0, len(rows), shard_size)]


def _prepare_dir(out: str, plan_doc: dict, overwrite: bool) -> None:
    """A new directory, the same plan again (resume), or — with overwrite — a cleared one."""
    path = os.path.join(out, F.PLAN)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old == plan_doc and not overwrite:
            return
        if not overwrite:
            changed = sorted(k for k in set(old) | set(plan_doc) if old.get(k) != plan_doc.get(k))
            raise OutputExists(f"{out} holds features of another setup (changed: {', '.join(changed)}); "
                               "pass --overwrite to replace them, or choose another --out")
    elif os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise OutputExists(f"{out} exists and is not a feature cache; pass --overwrite to replace it")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, F.PROGRESS))
    with open(path + ".tmp", "w") as f:
        json.dump(plan_doc, f, indent=1)
    os.replace(path + ".tmp", path)


def precompute_features(config, out: str, *, shard_size: int = DEFAULT_SHARD_SIZE, batch_size: int = 0,
                        store_dtype: str | None = None, workers: int = 8, overwrite: bool = False,
                        progress: bool = True, stop_after_shards: int | None = None) -> dict | None:
    """Encode `config.data.table` into `out`. Returns the manifest (None on processes other than 0,
    or when `stop_after_shards` — a test's stand-in for an interruption — ended the run early).

    batch_size: rows per encoder call (default: the data-parallel size, one row per device);
    rounded up to a multiple of the data-parallel size. store_dtype: of latents and text states
    (default: bfloat16 if the VAE runs in bf16, else float32)."""
    import jax
    import jax.numpy as jnp
    from array_record.python.array_record_module import ArrayRecordWriter
    from tqdm import tqdm

    from jaxsora.data.buckets import Buckets, normalize_bucket_config
    from jaxsora.data.plan import assign_rows
    from jaxsora.data.tables import TableIndex
    from jaxsora.data.video import DecodeError, load_sample, to_model_range
    from jaxsora.parallel import mesh as mesh_lib
    from jaxsora.parallel.sharding import batch_sharding
    from jaxsora.train import build

    dcfg = config.data
    extra = _plain(dcfg.resolutions) if dcfg.get("resolutions") else None
    bucket_config = normalize_bucket_config(_plain(dcfg.bucket_config))
    seed, frame_interval = int(dcfg.seed), int(dcfg.frame_interval)
    encoders_cfg = build.frozen_encoder_configs(config)
    if store_dtype is None:
        store_dtype = "bfloat16" if str(encoders_cfg["vae"].get("dtype", "float32")) == "bfloat16" else "float32"
    sdt = np_dtype(store_dtype)
    if shard_size < 1:
        from jaxsora.errors import BadInput

        raise BadInput(f"--shard-size must be >= 1, got {shard_size}")

    is_main = jax.process_index() == 0
    table = TableIndex.build(str(dcfg.table), progress=progress and is_main)
    buckets = Buckets(bucket_config, extra)
    sizes = (table.num_frames, table.height, table.width)
    groups = assign_rows(sizes, buckets, seed=seed, epoch=0, frame_interval=frame_interval)
    units = _units(groups, int(shard_size))
    keys = list(groups)
    plan_doc = dict(format=F.FORMAT, table=os.path.abspath(str(dcfg.table)) if "://" not in str(dcfg.table)
                    else str(dcfg.table), table_fingerprint=table.fingerprint, bucket_config=_hash(bucket_config),
                    resolutions=extra, seed=seed, frame_interval=frame_interval, shard_size=int(shard_size),
                    dtype=store_dtype, **encoders_cfg)
    plan_doc = json.loads(json.dumps(plan_doc, default=str))  # as it reads back from plan.json (tuples → lists)
    if is_main:
        _prepare_dir(out, plan_doc, overwrite)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxsora precompute: folder ready")

    # The frozen encoders on this process's devices (shard i belongs to process i mod P).
    enc_config = copy.deepcopy(config)
    with enc_config.unlocked():
        enc_config.data.text_cache = ""
        enc_config.data.features = ""
    mesh = mesh_lib.make_mesh(_plain(config.mesh), devices=jax.local_devices())
    rules = mesh_lib.logical_rules(mesh)
    encoders = build.build_encoders(enc_config, mesh, rules)
    dp = mesh_lib.data_parallel_size(mesh)
    per_call = max(dp, -(-max(int(batch_size), 1) // dp) * dp)

    def encode(weights, video, ids, mask, key):
        latents = encoders.encode_video(weights, to_model_range(video), key)
        return latents, encoders.encode_text(weights, ids, mask)

    encode = jax.jit(encode)
    base_key = jax.random.key(seed)
    L, D = encoders.model_max_length, encoders.caption_channels
    features = F.tfds_features(encoders.in_channels, D, store_dtype)
    n_units = len(units)
    mine = [i for i in range(n_units) if i % jax.process_count() == jax.process_index()]
    todo = [i for i in mine if not os.path.exists(os.path.join(out, F.PROGRESS, F.shard_name(i, n_units) + ".json"))]
    if is_main and len(todo) < len(mine):
        print(f"[precompute] resuming: {len(mine) - len(todo)} of {len(mine)} shards already encoded", file=sys.stderr)
    bar = tqdm(total=sum(len(units[i][1]) for i in todo), desc="encoding clips", unit="clip",
               disable=not (progress and is_main))
    pool = ThreadPoolExecutor(max(1, int(workers)))
    done_now = 0
    try:
        for i in todo:
            if stop_after_shards is not None and done_now >= stop_after_shards:
                return None
            key, rows = units[i]
            t, h, w = buckets.target_size(key)

            def decode(row, t=t, h=h, w=w):
                try:
                    if not table.text(row).strip():
                        raise DecodeError(f"empty caption for {table.path(row)}", "empty_caption")
                    rng = np.random.default_rng([seed, 0, int(row), 1])  # the loader's epoch-0 crop of this row
                    video, fps = load_sample(table.path(row), t, h, w, frame_interval=frame_interval, rng=rng,
                                             num_frames_hint=int(table.num_frames[row]))
                    if video.shape != (3, t, h, w):
                        raise DecodeError(f"{table.path(row)} decoded to {video.shape}, not {(3, t, h, w)}",
                                          "bad_shape")
                    return int(row), video, float(fps), None
                except DecodeError as e:
                    print(f"[precompute] skipped row {row} ({e.reason}): {' '.join(str(e).split())}",
                          file=sys.stderr, flush=True)
                    return int(row), None, 0.0, e.reason

            name = F.shard_name(i, n_units)
            tmp = os.path.join(out, name + ".tmp")
            writer = ArrayRecordWriter(tmp, "group_size:1")
            kept, skipped = [], {}
            try:
                for start in range(0, len(rows), per_call):
                    decoded = list(pool.map(decode, rows[start:start + per_call]))
                    for row, _, _, reason in decoded:
                        if reason:
                            skipped.setdefault(reason, []).append(row)
                    good = [d for d in decoded if d[3] is None]
                    if not good:
                        bar.update(len(decoded))
                        continue
                    texts = [table.text(r) for r, *_ in good]
                    text_in = encoders.text_inputs(texts, np.array([r for r, *_ in good]))
                    pad = (-len(good)) % dp  # whole rows per device: repeat the last one, dropped after
                    video = np.stack([v for _, v, _, _ in good] + [good[-1][1]] * pad)
                    ids = np.concatenate([text_in["ids"], np.repeat(text_in["ids"][-1:], pad, 0)])
                    mask = np.concatenate([text_in["text_mask"], np.repeat(text_in["text_mask"][-1:], pad, 0)])
                    args = [jax.device_put(a, batch_sharding(mesh, a.ndim)) for a in (video, ids, mask)]
                    with jax.set_mesh(mesh):
                        lat, y = encode(encoders.weights, *args, jax.random.fold_in(base_key, i * 1_000_003 + start))
                    lat = np.asarray(jax.device_get(lat.astype(jnp.float32)))
                    y = np.asarray(jax.device_get(y))
                    for j, (row, _, fps, _) in enumerate(good):
                        m = text_in["text_mask"][j].astype(bool)
                        n = int(m.sum())
                        writer.write(features.serialize_example(dict(
                            row=row, bucket=keys.index(key), text=table.text(row), length=n,
                            latent=lat[j].astype(sdt), y=y[j, :n].astype(sdt), fps=fps, num_frames=t, height=h,
                            width=w)))
                        kept.append(row)
                    bar.update(len(decoded))
            finally:
                writer.close()
            os.replace(tmp, os.path.join(out, name))
            rec = dict(shard=name, bucket=keys.index(key), rows=kept, skipped=skipped,
                       latent=list(encoders.latent_size((t, h, w))))
            ptmp = os.path.join(out, F.PROGRESS, name + ".json.tmp")
            with open(ptmp, "w") as f:
                json.dump(rec, f)
            os.replace(ptmp, os.path.join(out, F.PROGRESS, name + ".json"))
            done_now += 1
    finally:
        pool.shutdown()
        bar.close()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxsora precompute: shards done")
    if not is_main:
        return None
    return _finish(out, plan_doc, units, keys, buckets, features, n_units,
                   dict(latent_channels=encoders.in_channels, caption_channels=D, model_max_length=L))


def _finish(out, plan_doc, units, keys, buckets, features, n_units, dims) -> dict:
    """All shards written: the assignment, the TFDS metadata and, last, the manifest."""
    from jaxsora.data.cache import write_tfds_metadata

    names = [F.shard_name(i, n_units) for i in range(n_units)]
    recs = []
    for name in names:
        with open(os.path.join(out, F.PROGRESS, name + ".json")) as f:
            recs.append(json.load(f))
    rows = np.array([r for rec in recs for r in rec["rows"]], np.int64)
    bucket = np.array([rec["bucket"] for rec in recs for _ in rec["rows"]], np.int32)
    np.savez(os.path.join(out, F.ASSIGNMENT), rows=rows, bucket=bucket)
    skipped: dict = {}
    for rec in recs:
        for reason, rs in rec["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + len(rs)
    shard_lengths = [len(rec["rows"]) for rec in recs]
    write_tfds_metadata(out, features, F.DATASET_NAME, names, shard_lengths,
                        "jaxsora feature cache (VAE latents, T5 states): see manifest.json")
    latent_of = {rec["bucket"]: rec["latent"] for rec in recs}
    bucket_entries = [dict(key=list(k), size=list(buckets.target_size(k)), latent=[dims["latent_channels"],
                           *latent_of.get(i, [0, 0, 0])], records=int((bucket == i).sum()))
                      for i, k in enumerate(keys)]
    manifest = dict(plan_doc, **dims, buckets=bucket_entries, num_records=int(len(rows)), skipped=skipped,
                    shards=names, shard_lengths=shard_lengths,
                    fingerprint=_hash([plan_doc, [rec["rows"] for rec in recs]])[:32])
    tmp = os.path.join(out, F.MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out, F.MANIFEST))
    return manifest
