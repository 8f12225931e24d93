"""`python -m data_tools.stats --input meta.csv --config configs/stage1.py [--config.k=v ...]
[--num-devices N | --dp N] [--epoch E] [--png buckets.png] [--output buckets.csv]`: how a table
falls into the buckets of a training config, before training.

The bucket config is the run's (`data.bucket_config`, or `data.bucket_config_file`; `--config.x=v`
overrides as for `python -m jaxsora.train`), or `--bucket-config FILE.json` alone
({resolution: {frames: [keep_prob, batch]}}, as `jaxsora.tools.search_bs` writes). Rows are
assigned with the trainer's own code (`jaxsora.data.plan.assign_rows`: the same seed, epoch and
frame interval give the same buckets as the run), and for each bucket (resolution × frames ×
aspect ratio) the table shows its rows, the per-device and global batch (× the data-parallel
size), the steps it gives this epoch and the rows left over (short of a full global batch).
Then the totals, and the rows outside every bucket, split into those that fit no bucket at all
(too small or too short for every entry) and those left out this epoch by a keep probability.

The data-parallel size is the config mesh's data × fsdp on `--num-devices` devices (default 1),
or `--dp`. Only the size columns of the table are read, streaming; `--input` defaults to the
config's `data.table`. `--png` draws the per-bucket counts as a bar chart; `--output` writes the
per-bucket table as CSV (or JSON if the name ends in .json).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from data_tools import stream
from jaxsora.errors import BadInput, MissingFile, UserError

PROG = "stats"
SIZE_COLUMNS = ("num_frames", "height", "width")


# ---- the run's data setup -----------------------------------------------------------------------
def _plain(cfg):
    return json.loads(cfg.to_json_best_effort()) if hasattr(cfg, "to_json_best_effort") else dict(cfg or {})


def load_config(path: str, overrides: list[str]):
    """The config as `python -m jaxsora.train` loads it: `get_config()` of the file, with
    `--config.a.b=v` overrides applied and `data.bucket_config_file` read."""
    from absl import flags
    from ml_collections import config_flags

    from jaxsora.cli import _unknown_override
    from jaxsora.config import load_bucket_config_file
    from jaxsora.config_files import register_configs_package

    if not os.path.isfile(path.split(":")[0]):
        raise MissingFile(f"no such config file: {path.split(':')[0]}")
    bad = [a for a in overrides if a.startswith("-") and not a.startswith("--config.")]
    if bad:
        raise BadInput(f"unknown flag(s) {bad} (config overrides are --config.group.key=value)")
    fv = flags.FlagValues()
    from jaxsora.opensora_config import is_opensora_config, translate_train

    if is_opensora_config(path):  # an Open-Sora 1.2 train config, read as `python -m jaxsora.train` reads it
        argv = [PROG, *overrides]
        config_flags.DEFINE_config_dict("config", translate_train(path).config(), "config", flag_values=fv,
                                        lock_config=True, sys_argv=argv)
    else:
        register_configs_package(path.split(":")[0])
        argv = [PROG, f"--config={path}", *overrides]
        # sys_argv: the overrides are found in the argv given, not in the process's sys.argv
        config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv, lock_config=True,
                                        sys_argv=argv)
    try:
        rest = fv(argv)
        config = fv.config
    except flags.Error as e:
        msg = str(e).replace("Unknown command line flag 'config.", "unknown config key '")
        raise BadInput(msg) from e
    except UserError:
        raise
    except Exception as e:  # an override of a key the config lacks, or the file itself raised
        msg = _unknown_override(e, argv) or f"config file {path} does not load: {type(e).__name__}: {e}"
        raise BadInput(msg) from e
    if len(rest) > 1:
        raise BadInput(f"unknown argument(s) {rest[1:]}")
    if "data" not in config:
        raise BadInput(f"config {path} has no 'data' group")
    load_bucket_config_file(config)
    return config


def data_setup(args) -> dict:
    """{table, bucket_config, extra_resolutions, seed, frame_interval, dp, source} from the flags."""
    if args.config:
        config = load_config(args.config, args.overrides)
        dcfg = config.data
        bucket_config = _plain(dcfg.bucket_config)
        extra = _plain(dcfg.resolutions) if dcfg.get("resolutions") else None
        seed = int(dcfg.get("seed", config.get("train", {}).get("seed", 0)))
        frame_interval = int(dcfg.get("frame_interval", 1))
        override = int(dcfg.get("batch_size_override", 0) or 0)
        table = args.input or dcfg.get("table") or None
        if args.dp is None:
            from jaxsora.parallel.mesh import mesh_shape

            shape = mesh_shape(_plain(config.get("mesh", {})), args.num_devices)
            dp = shape["data"] * shape["fsdp"]
        else:
            dp = args.dp
        source = args.config
    else:
        if args.overrides:
            raise BadInput(f"unknown argument(s) {args.overrides}")
        if not os.path.isfile(args.bucket_config):
            raise MissingFile(f"no such bucket config file: {args.bucket_config}")
        try:
            with open(args.bucket_config) as f:
                bucket_config = json.load(f)
        except ValueError as e:
            raise BadInput(f"--bucket-config {args.bucket_config}: not JSON ({e})") from e
        if not isinstance(bucket_config, dict):
            raise BadInput(f"--bucket-config {args.bucket_config}: expected {{resolution: {{frames: [keep_prob, "
                           f"batch]}}}}")
        extra, seed, frame_interval, override, table = None, 42, 1, 0, args.input
        dp = args.dp if args.dp is not None else args.num_devices
        source = args.bucket_config
    if table is None:
        raise BadInput("no table: give --input (the config's data.table is empty)")
    from jaxsora.data.buckets import normalize_bucket_config

    try:
        bucket_config = normalize_bucket_config(bucket_config)
    except (ValueError, TypeError, AttributeError) as e:
        raise BadInput(f"bucket config of {source}: {e}") from e
    if override > 0:  # as the trainer's loader applies data.batch_size_override
        bucket_config = {r: {f: (p, None if b is None else override) for f, (p, b) in fr.items()}
                         for r, fr in bucket_config.items()}
    seed = args.seed if args.seed is not None else seed
    frame_interval = args.frame_interval if args.frame_interval is not None else frame_interval
    if dp < 1 or frame_interval < 1 or args.epoch < 0:
        raise BadInput("--dp, --num-devices and --frame-interval must be ≥ 1, --epoch ≥ 0")
    return dict(table=table, bucket_config=bucket_config, extra_resolutions=extra, seed=seed,
                frame_interval=frame_interval, dp=dp, source=source)


def make_buckets(bucket_config: dict, extra):
    from jaxsora.data.buckets import Buckets

    try:
        return Buckets(bucket_config, extra)
    except (ValueError, TypeError, KeyError) as e:
        raise BadInput(f"bucket config: {e}") from e


def reachable_config(bucket_config: dict) -> dict:
    """The bucket config with every keep probability above 0 raised to 1 (0 stays 0: "never
    here"): a row it assigns nowhere fits no bucket under any draw."""
    def one(p):
        return tuple(1.0 if x > 0 else 0.0 for x in p) if isinstance(p, tuple) else (1.0 if p > 0 else 0.0)

    return {r: {f: (one(p), b) for f, (p, b) in fr.items()} for r, fr in bucket_config.items()}


# ---- the table ----------------------------------------------------------------------------------
def read_sizes(files, chunk_rows: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_frames, height, width) of every row, [N] int64 each, streamed column by column."""
    stream.require_columns(files, SIZE_COLUMNS, "stats (bucket assignment)")
    parts: dict[str, list] = {c: [] for c in SIZE_COLUMNS}
    for chunk in stream.iter_chunks(files, chunk_rows, columns=SIZE_COLUMNS, desc=PROG, progress=progress):
        for c in SIZE_COLUMNS:
            v = stream.numeric(chunk.df, c)
            bad = np.isnan(v)
            if bad.any():
                row = int(np.nonzero(bad)[0][0]) + chunk.start
                raise BadInput(f"table {chunk.file}: column {c!r} has an empty or non-numeric value in row {row} "
                               f"(counted across the table's files)")
            parts[c].append(v.astype(np.int64))
    return tuple(np.concatenate(parts[c]) if parts[c] else np.zeros(0, np.int64) for c in SIZE_COLUMNS)


# ---- the statistics -----------------------------------------------------------------------------
def bucket_stats(sizes, bucket_config: dict, *, seed: int, epoch: int, dp: int, frame_interval: int = 1,
                 extra_resolutions=None) -> dict:
    """{"buckets": [per-bucket dict], "total": {...}} for the epoch; buckets in the config's order
    (resolution by pixels, then frames, descending; aspect ratios in the table's order)."""
    from jaxsora.data.plan import assign_rows

    buckets = make_buckets(bucket_config, extra_resolutions)
    groups = assign_rows(sizes, buckets, seed=seed, epoch=epoch, frame_interval=frame_interval)
    reach = assign_rows(sizes, make_buckets(reachable_config(bucket_config), extra_resolutions), seed=seed,
                        epoch=epoch, frame_interval=frame_interval)
    order = {k: i for i, k in enumerate(buckets.bucket_keys)}
    rows = []
    for b in sorted(groups, key=order.__getitem__):
        n = len(groups[b])
        t, h, w = buckets.target_size(b)
        bs = buckets.bucket_batch_size(b)
        rows.append(dict(resolution=b[0], frames=t, aspect=b[2], height=h, width=w, rows=n, batch=bs,
                         global_batch=bs * dp, steps=n // (bs * dp), left_over=n % (bs * dp)))
    num_rows = len(np.asarray(sizes[0]))
    assigned = sum(r["rows"] for r in rows)
    fits_none = num_rows - sum(len(g) for g in reach.values())
    total = dict(rows=num_rows, in_buckets=assigned, steps=sum(r["steps"] for r in rows),
                 left_over=sum(r["left_over"] for r in rows), fits_no_bucket=fits_none,
                 left_out_by_keep_prob=num_rows - assigned - fits_none)
    return dict(buckets=rows, total=total)


def format_stats(stats: dict) -> str:
    head = (f"{'resolution':<10} {'frames':>6} {'aspect':>6} {'H×W':>10} {'rows':>9} {'batch':>6} {'global':>7} "
            f"{'steps':>7} {'left over':>9}")
    lines = [head, "-" * len(head)]
    for r in stats["buckets"]:
        hw = f"{r['height']}×{r['width']}"
        lines.append(f"{r['resolution']:<10} {r['frames']:>6} {r['aspect']:>6} {hw:>10} "
                     f"{r['rows']:>9} {r['batch']:>6} {r['global_batch']:>7} {r['steps']:>7} {r['left_over']:>9}")
    t = stats["total"]
    lines.append("-" * len(head))
    lines.append(f"{'total':<35} {t['in_buckets']:>9} {'':>6} {'':>7} {t['steps']:>7} {t['left_over']:>9}")
    lines.append(f"rows in the table: {t['rows']}; in a bucket: {t['in_buckets']}; fit no bucket (too small or too "
                 f"short for every entry): {t['fits_no_bucket']}; left out this epoch by keep probabilities: "
                 f"{t['left_out_by_keep_prob']}")
    lines.append(f"steps per epoch: {t['steps']}")
    return "\n".join(lines)


def draw_png(stats: dict, path: str, title: str) -> None:
    """A horizontal bar per bucket (its rows), coloured by resolution, drawn with PIL."""
    from PIL import Image, ImageDraw, ImageFont

    rows = stats["buckets"]
    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    bar_h, gap, top, width = 16, 4, 40, 640
    # "x", not "×": the default bitmap font has no glyph for it
    labels = [f"{r['resolution']} {r['frames']}f {r['aspect']} ({r['height']}x{r['width']})" for r in rows]
    left = 20 + int(max([font.getlength(s) for s in labels] + [0]))
    img_w = max(left + width + 90, 20 + int(font.getlength(title)))
    img = Image.new("RGB", (img_w, top + max(len(rows), 1) * (bar_h + gap) + 20), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), title, fill="black", font=font)
    if not rows:
        d.text((10, top), "no row falls into any bucket", fill="black", font=font)
    peak = max([r["rows"] for r in rows] + [1])
    palette = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]
    colours: dict = {}
    for i, (r, label) in enumerate(zip(rows, labels)):
        y = top + i * (bar_h + gap)
        colour = colours.setdefault(r["resolution"], palette[len(colours) % len(palette)])
        d.text((10, y + 1), label, fill="black", font=font)
        w = max(1, round(width * r["rows"] / peak))
        d.rectangle([left, y, left + w, y + bar_h], fill=colour)
        d.text((left + w + 6, y + 1), str(r["rows"]), fill="black", font=font)
    img.save(path)


def write_table(stats: dict, path: str) -> None:
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(stats, f, indent=1)
        return
    import pandas as pd

    pd.DataFrame(stats["buckets"], columns=["resolution", "frames", "aspect", "height", "width", "rows", "batch",
                                            "global_batch", "steps", "left_over"]).to_csv(path, index=False)


# ---- command line -------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", default=None, help="table (default: the config's data.table)")
    ap.add_argument("--output", default=None, help="write the per-bucket table here (.csv or .json)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="training config file, e.g. configs/stage1.py (--config.k=v overrides)")
    src.add_argument("--bucket-config", help="a bucket config JSON instead of a training config")
    ap.add_argument("--num-devices", type=int, default=1, help="devices of the run: the mesh gives the "
                                                               "data-parallel size (default 1)")
    ap.add_argument("--dp", type=int, default=None, help="the data-parallel size itself")
    ap.add_argument("--epoch", type=int, default=0, help="keep-probability draws of this epoch (default 0)")
    ap.add_argument("--seed", type=int, default=None, help="default: the config's data.seed (42 with --bucket-config)")
    ap.add_argument("--frame-interval", type=int, default=None, help="default: the config's (1)")
    ap.add_argument("--png", default=None, help="draw the per-bucket counts here (PNG)")
    args, args.overrides = stream.parse_args(ap, argv, known=True)
    return stream.run(PROG, lambda: _stats(args), argv)


def _stats(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    for out in (args.output, args.png):
        if out:
            stream.check_output(out, args.overwrite)
    setup = data_setup(args)
    files = stream.input_files(setup["table"])
    sizes = read_sizes(files, args.chunk_size, progress=not args.no_progress)
    stats = bucket_stats(sizes, setup["bucket_config"], seed=setup["seed"], epoch=args.epoch, dp=setup["dp"],
                         frame_interval=setup["frame_interval"], extra_resolutions=setup["extra_resolutions"])
    title = (f"{setup['table']} with {setup['source']}: epoch {args.epoch}, seed {setup['seed']}, "
             f"data-parallel size {setup['dp']}, frame interval {setup['frame_interval']}")
    print(title)
    print(format_stats(stats))
    for out, write in ((args.output, write_table), (args.png, lambda s, p: draw_png(s, p, title))):
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            write(stats, out)
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
