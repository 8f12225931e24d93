"""`python -m jaxsora.tools.search_bs --config configs/stage1.py [--config.k=v ...] [--data-path T]
[--fraction 0.9] [--output bucket_config.json]`: the largest per-device batch of every bucket that fits
in a fraction of the device memory, found by compiling the real train step (the config's model,
remat policy, mesh and encoders) — not by trial steps until out-of-memory, as Open-Sora's
`search_bs.py` does. Compiles of different buckets run side by side.

Each bucket config entry (resolution, frames) shares one batch size over all its aspect ratios, so
it is searched at the largest H×W among them: of the table's plan with `--data-path` (or
`data.table`), else of the resolution's whole aspect table. Keep probabilities are copied from the
config; the output JSON is a `data.bucket_config` — train with
`--config.data.bucket_config_file=bucket_config.json`.

With `model.remat="auto"` (the stage configs) every bucket is searched at full remat, the policy that fits
the most; training then picks, per bucket, the cheapest remat that fits the batch found.

The device memory is the device's own, or that of `--target` (e.g. `h100x8`, `tpu-v5p:2x2x2`: the search
compiles for those chips with their own compiler, from any machine; `jaxsora.parallel.targets`), or
`--config.train.device_memory_gib`. `--no-progress` hides the progress bar.
"""
from __future__ import annotations

import concurrent.futures
import json
import os


def search(config, *, fraction: float = 0.9, max_batch: int | None = None, use_table: bool = True,
           threads: int = 0, progress: bool = True) -> dict:
    """{"bucket_config": {...}, "rows": [...], "limit": bytes}; see the module docstring."""
    from jaxsora.config import ConfigError, load_bucket_config_file
    from jaxsora.data.aspect import resolution_tables
    from jaxsora.data.buckets import normalize_bucket_config
    from jaxsora.train.plan import memory
    from jaxsora.train.run.setup import default_loader, plain, setup_run

    device = memory.device_memory_limit(config)
    if device is None:
        raise ConfigError("the device reports no memory limit (CPU): search for a GPU or TPU with --target "
                          "(e.g. h100x8), or set --config.train.device_memory_gib")
    limit = int(device * fraction)
    load_bucket_config_file(config)  # data.bucket_config_file replaces data.bucket_config, as in the trainer
    setup = setup_run(config, abstract_encoders=True)
    buckets = normalize_bucket_config(plain(config.data.bucket_config))
    tables = resolution_tables(plain(config.data.resolutions) if config.data.get("resolutions") else None)
    # (res, frames) → the largest (H, W) to search at
    sizes: dict = {}
    if use_table and config.data.get("table") and os.path.exists(config.data.table):
        loader = default_loader(config, setup.data_parallel_size, None)
        for (res, t, h, w), _nb, _gb, _rows in loader.describe_plan(0):
            best = sizes.get((res, t))
            if best is None or h * w > best[0] * best[1]:
                sizes[(res, t)] = (h, w)
    for res, frames in buckets.items():
        for f, (_prob, bs) in frames.items():
            if bs is not None and (res, f) not in sizes:
                sizes[(res, f)] = max(tables[res][1].values(), key=lambda hw: hw[0] * hw[1])

    def one(item):
        (res, f), (h, w) = item
        start = buckets[res][f][1] or 1
        b = memory.largest_batch(setup, (f, h, w), limit, start, cap=max_batch)
        peak = memory.peak_bytes(setup, (f, h, w), max(b, 1) * setup.data_parallel_size)
        return dict(resolution=res, frames=f, height=h, width=w, tokens=setup.tokens_per_sample((f, h, w)),
                    config_batch=buckets[res][f][1], batch=b, peak_bytes=peak)

    from tqdm import tqdm

    items = sorted(sizes.items(), key=lambda kv: (kv[0][0], kv[0][1]))
    threads = threads or memory.compile_threads(config)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        rows = list(tqdm(pool.map(one, items), total=len(items), desc="searching batch sizes", unit="bucket",
                         disable=not progress))
    out_cfg = {res: {str(f): [list(p) if isinstance(p, tuple) else p, bs] for f, (p, bs) in frames.items()}
               for res, frames in buckets.items()}
    for r in rows:
        prob = out_cfg[r["resolution"]][str(r["frames"])][0]
        # a bucket where not even one sample fits is switched off (keep probability 0)
        out_cfg[r["resolution"]][str(r["frames"])] = [prob, r["batch"]] if r["batch"] else [0.0, None]
    return dict(bucket_config=out_cfg, rows=rows, limit=limit, device=device)


def format_rows(result: dict) -> str:
    gib = 1 << 30
    lines = [f"{'resolution':<10} {'frames':>6} {'H×W':>10} {'tokens':>7} {'config':>7} {'found':>6} {'peak GiB':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['resolution']:<10} {r['frames']:>6} {str(r['height']) + '×' + str(r['width']):>10} "
                     f"{r['tokens']:>7} {str(r['config_batch']):>7} {r['batch']:>6} {r['peak_bytes'] / gib:>9.2f}")
    lines.append(f"limit: {result['limit'] / gib:.2f} GiB per device ({result['limit'] / result['device']:.0%} of "
                 f"{result['device'] / gib:.2f})")
    return "\n".join(lines)


def _define_flags():
    from absl import flags

    flags.DEFINE_string("data_path", None, "dataset table: search the aspect ratios its plan uses")
    flags.DEFINE_float("fraction", 0.9, "fraction of the device memory a step may use")
    flags.DEFINE_string("output", "bucket_config.json", "where to write the bucket config (JSON)")
    flags.DEFINE_alias("out", "output")
    flags.DEFINE_integer("max_batch", None, "never search above this per-device batch")
    flags.DEFINE_bool("no_progress", False, "no progress bar")
    flags.DEFINE_string("target", None, "search for these chips, compiled here by their own compiler (h100x8, "
                        "h200x8, a100-80gx8, tpu-v5p:2x2x2, ...); sets train.target")


def _body() -> int:
    from absl import flags

    from jaxsora.config import ConfigError

    FLAGS = flags.FLAGS
    config = FLAGS.config
    if FLAGS.data_path:
        config.data.table = FLAGS.data_path
    if FLAGS.target is not None:
        from jaxsora.parallel import targets

        config.train.target = FLAGS.target
        targets.parse(FLAGS.target)  # a bad name: one line, before any work
    if not 0 < FLAGS.fraction <= 1:
        raise ConfigError(f"--fraction must lie in (0, 1], got {FLAGS.fraction}")
    result = search(config, fraction=FLAGS.fraction, max_batch=FLAGS.max_batch, progress=not FLAGS.no_progress)
    print(format_rows(result))
    with open(FLAGS.output, "w") as f:
        json.dump(result["bucket_config"], f, indent=1)
    print(f"wrote {FLAGS.output}: train with --config.data.bucket_config_file={FLAGS.output}")
    return 0


def main():
    from jaxsora.cli import config_app

    config_app("jaxsora.tools.search_bs", _define_flags, _body, dashed=("--data-path", "--max-batch", "--no-progress"))


if __name__ == "__main__":
    main()
