"""Encode a table once into a feature cache (`jaxsora.data.features`): each row's VAE latents at
the size and length of its epoch-0 bucket, and its T5 caption states.

    python -m data_tools.precompute --latents --config configs/stage1.py --output DIR [--config.k=v ...]

The run's own config says everything: the table (`data.table`), buckets, seed and frame interval
(rows are assigned and cropped by the trainer's code, so the features are what the video loader
gives in epoch 0), the VAE and text encoder, and the mesh they run on. Each shard holds rows of
one bucket; a batch of a shard is decoded by a pool of threads, sharded over the mesh's
data-parallel devices, encoded by the frozen VAE and T5 in one jitted call, and written; a
finished shard is recorded in `progress/`, so running the same command again after an
interruption encodes only the shards that are missing.

With several processes (`jax.distributed`, started here from JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID or a detected cluster, as `jaxsora.train` starts), shard i is
encoded by process i mod P alone, on its own devices (the config's mesh with its `data` axis split
among the processes), into one folder all processes see; process 0 prepares the folder and writes
the metadata at the end. The cache does not depend on the process count or the batch size: each
row's VAE posterior is sampled with a key of (seed, row) only, so its fingerprint means one content.
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


def _process_mesh_shape(mesh_cfg, num_devices: int, num_processes: int) -> dict[str, int]:
    """{axis: size} of the mesh one process encodes its shards on: the config's mesh over all
    `num_devices` devices with its `data` axis split among the `num_processes` processes (fsdp and
    sequence stay whole, so they must fit in one process's devices)."""
    from jaxsora.parallel.mesh import MeshError, mesh_shape

    shape = mesh_shape(_plain(mesh_cfg), num_devices)
    if num_processes == 1:
        return shape
    if shape["data"] % num_processes:
        raise MeshError(f"precompute encodes each shard on one process's devices, so mesh.data must be a multiple of "
                        f"the {num_processes} processes; the mesh is {shape} (e.g. --config.mesh.data=-1 with "
                        f"mesh.fsdp x mesh.sequence at most one process's {num_devices // num_processes} devices)")
    return dict(shape, data=shape["data"] // num_processes)


def _shard_done(out: str, name: str) -> bool:
    """A shard recorded as written whose file holds its records; a damaged one (truncated, replaced,
    missing) is said and made again."""
    progress = os.path.join(out, F.PROGRESS, name + ".json")
    try:
        with open(progress) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return False
    problem = F.shard_problem(os.path.join(out, name), len(rows))
    if problem:
        print(f"[precompute] shard {name} {problem}: making it again", file=sys.stderr, flush=True)
        os.remove(progress)
        return False
    return True


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
                               "pass --overwrite to replace them, or choose another --output")
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
    or when `stop_after_shards` — a test's stand-in for an interruption: each process stops after
    encoding that many shards — ended the run early). Starts `jax.distributed` first when the
    environment asks for several processes (a no-op if it is already started).

    batch_size: rows per encoder call (default: the data-parallel size, one row per device);
    rounded up to a multiple of the data-parallel size; the VAE encodes each row as a batch of one
    (vmapped, for its per-row key), so its frame micro-batches hold rows-per-device times as many
    frames. store_dtype: of latents and text states
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
    from jaxsora.parallel.distributed import initialize
    from jaxsora.parallel.sharding import batch_sharding
    from jaxsora.train import build

    initialize()  # before jax's first device query: a multi-process command joins its processes here
    num_processes = jax.process_count()
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
    failure = None
    if is_main:
        try:
            _prepare_dir(out, plan_doc, overwrite)
        except Exception as e:  # re-raised below, once every process knows (none waits on a process that left)
            failure = e
    if num_processes > 1:
        from jax.experimental import multihost_utils

        # a barrier (the folder is ready) that also tells every process whether process 0 refused it
        if int(multihost_utils.broadcast_one_to_all(np.int32(failure is not None))) and not is_main:
            raise OutputExists(f"{out}: process 0 could not prepare the output folder (its error says why)")
    if failure is not None:
        raise failure

    # The frozen encoders on this process's devices (shard i belongs to process i mod P).
    enc_config = copy.deepcopy(config)
    with enc_config.unlocked():
        enc_config.data.text_cache = ""
        enc_config.data.features = ""
    mesh = mesh_lib.make_mesh(_process_mesh_shape(config.mesh, jax.device_count(), num_processes),
                              devices=jax.local_devices())
    rules = mesh_lib.logical_rules(mesh)
    encoders = build.build_encoders(enc_config, mesh, rules)
    dp = mesh_lib.data_parallel_size(mesh)
    per_call = max(dp, -(-max(int(batch_size), 1) // dp) * dp)

    def encode(weights, video, ids, mask, rows, key):
        """video [B, 3, t, h, w] uint8, ids/mask [B, L], rows [B] uint32 → latents [B, C, t', h', w'],
        text states [B, L, D]. Row r's posterior is sampled with fold_in(key, r), whatever batch it is in."""
        def one(v, r):
            return encoders.encode_video(weights, v[None], jax.random.fold_in(key, r))[0]

        return jax.vmap(one)(to_model_range(video), rows), encoders.encode_text(weights, ids, mask)

    encode = jax.jit(encode)
    base_key = jax.random.key(seed)
    L, D = encoders.model_max_length, encoders.caption_channels
    features = F.tfds_features(encoders.in_channels, D, store_dtype)
    n_units = len(units)
    mine = [i for i in range(n_units) if i % num_processes == jax.process_index()]
    todo = [i for i in mine if not _shard_done(out, F.shard_name(i, n_units))]
    if is_main and len(todo) < len(mine):
        print(f"[precompute] resuming: {len(mine) - len(todo)} of {len(mine)} shards already encoded", file=sys.stderr)
    bar = tqdm(total=sum(len(units[i][1]) for i in todo), desc="encoding clips", unit="clip",
               disable=not (progress and is_main))
    pool = ThreadPoolExecutor(max(1, int(workers)))
    done_now, stopped, failure = 0, False, None
    try:
        for i in todo:
            if stop_after_shards is not None and done_now >= stop_after_shards:
                stopped = True
                break
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
                    row_ids = np.array([r for r, *_ in good] + [good[-1][0]] * pad, np.uint32)
                    args = [jax.device_put(a, batch_sharding(mesh, a.ndim)) for a in (video, ids, mask, row_ids)]
                    with jax.set_mesh(mesh):
                        lat, y = encode(encoders.weights, *args, base_key)
                    lat = np.asarray(jax.device_get(lat.astype(jnp.float32)))
                    y = np.asarray(jax.device_get(y))
                    for j, (row, _, fps, _) in enumerate(good):
                        m = text_in["text_mask"][j].astype(bool)
                        n = int(m.sum())
                        writer.write(F.serialize_record(features, dict(
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
    except Exception as e:  # with peers: re-raised after the barrier below, which the peers must not wait at in vain
        if num_processes == 1:
            raise
        failure = e
    finally:
        pool.shutdown()
        bar.close()
    if num_processes > 1:
        # a barrier (every process is done) that also says which processes stopped early or failed: [P, 2]
        status = multihost_utils.process_allgather(np.array([stopped, failure is not None], np.int32))
        if failure is not None:
            raise failure
        if status[:, 1].any():
            raise RuntimeError(f"precompute: process {int(np.flatnonzero(status[:, 1])[0])} failed encoding its "
                               "shards (its error says why); the shards written so far are kept for a rerun")
        stopped = bool(status[:, 0].any())
    if stopped or not is_main:
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
