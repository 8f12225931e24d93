"""Encode a table once: its captions into a text-state cache (`jaxsora.data.cache`), or with
`--latents` its clips and captions into a feature cache (`jaxsora.data.features`).

    python -m data_tools.precompute --input meta.csv --text-encoder '{"kind": "tiny"}' --output DIR
    python -m data_tools.precompute --input meta.csv --text-encoder configs/stage1.py \\
        --output DIR --num-shards 64
    python -m data_tools.precompute --latents --config configs/stage1.py --output FEATURES \\
        [--input meta.csv] [--config.group.key=value ...] [--shard-size 256] [--batch-size N]

Feature cache (`--latents`): the training config gives the table, buckets, seed, VAE, text encoder
and mesh; train from it with `--config.data.features=FEATURES` (see `data_tools/latents.py`).
Interrupted, the same command resumes where it stopped.

`--text-encoder` is a JSON object, a `.json` file, or a config `.py` file whose `get_config()`
returns a text-encoder config or a config with a `text_encoder` field (as `build_text_encoder`
takes: `{"kind": "t5", "path": ..., "model_max_length": 300, "dtype": "bfloat16"}`).
Record i of the cache is table row i (CSV or parquet, column `--text-column`, default `text`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence

from jaxsora.cli import ArgumentParser, HelpFormatter, hidden_aliases
from jaxsora.errors import BadInput, MissingFile, OutputExists, UnknownKey


def load_encoder_config(spec: str) -> dict:
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise BadInput(f"--text-encoder is not valid JSON: {e}") from None
    if not os.path.exists(spec):
        raise MissingFile(f"--text-encoder: no such file {spec!r} (give JSON, a .json or a config .py)")
    if spec.endswith(".json"):
        with open(spec) as f:
            return json.load(f)
    if spec.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location("_text_encoder_config", spec)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        if not hasattr(mod, "get_config"):
            raise BadInput(f"{spec}: no get_config()")
        cfg = mod.get_config()
        if "text_encoder" in cfg:
            cfg = cfg["text_encoder"]
        return dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
    raise BadInput(f"--text-encoder {spec!r}: expected JSON, a .json file or a .py config")


def read_captions(table: str, column: str = "text") -> list[str]:
    import pandas as pd

    if not os.path.exists(table):
        raise MissingFile(f"table {table!r} does not exist")
    if table.endswith(".parquet"):
        df = pd.read_parquet(table, columns=None)
    elif table.endswith(".csv"):
        df = pd.read_csv(table, keep_default_na=False, dtype={column: str})
    else:
        raise BadInput(f"table {table!r}: expected .csv or .parquet")
    if column not in df.columns:
        raise UnknownKey(f"table {table!r} has no column {column!r} (columns: {list(df.columns)})")
    texts = df[column].tolist()
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise BadInput(f"table {table!r}: row {i} column {column!r} is {t!r}, not a caption string")
    return texts


def main(argv: Sequence[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m data_tools.precompute", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--latents", action="store_true",
                   help="a feature cache (VAE latents + text states per clip) from --config, not text states only")
    p.add_argument("--config", default=None, help="with --latents: the training config (.py); "
                   "--config.group.key=value overrides follow it")
    hidden_aliases(p, p.add_argument("--input", dest="table", default=None, help="CSV or parquet with a caption "
                                     "column (with --latents: replaces the config's data.table)"), "--table")
    p.add_argument("--text-encoder", default=None, help="JSON, .json or config .py (build_text_encoder config)")
    hidden_aliases(p, p.add_argument("--output", dest="out", required=True, help="output cache directory"), "--out")
    p.add_argument("--num-shards", type=int, default=1, help="text states: ArrayRecord shards")
    p.add_argument("--shard-size", type=int, default=256, help="--latents: rows per shard (the unit of resumption)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="rows per encoder call (text states: 16 if 0; --latents: the data-parallel size if 0)")
    hidden_aliases(p, p.add_argument("--num-workers", dest="workers", type=int, default=8,
                                     help="--latents: decoding threads"), "--workers")
    p.add_argument("--text-column", default="text")
    p.add_argument("--store-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 for a bf16 encoder, else float32")
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache in --output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, rest = p.parse_known_args(argv)
    if args.latents:
        return _latents(args, rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not args.table or not args.text_encoder:
        p.error("--input and --text-encoder are required (or --latents --config FILE)")

    from jaxsora.data.cache import MANIFEST, write_cache
    from jaxsora.models.t5 import build_text_encoder

    if os.path.exists(os.path.join(args.out, MANIFEST)) and not args.overwrite:
        raise OutputExists(f"{args.out} already holds a cache ({MANIFEST}); pass --overwrite to replace it")
    texts = read_captions(args.table, args.text_column)
    enc_cfg = load_encoder_config(args.text_encoder)
    encoder = build_text_encoder(enc_cfg)
    manifest = write_cache(
        args.out,
        texts,
        encoder,
        encoder_config=dict(encoder.config),
        num_shards=args.num_shards,
        batch_size=args.batch_size or 16,
        store_dtype=args.store_dtype,
        table_path=os.path.abspath(args.table),
        progress=not args.no_progress,
    )
    print(
        f"wrote {manifest['num_rows']} caption states (L={manifest['model_max_length']}, "
        f"D={manifest['caption_channels']}, {manifest['dtype']}, mean length "
        f"{manifest['mean_length']:.1f}) "
        f"in {len(manifest['shards'])} shard(s) to {args.out}",
        file=sys.stderr,
    )
    return manifest


def _latents(args, overrides: list[str]) -> dict | None:
    from data_tools.latents import precompute_features
    from data_tools.stats import load_config

    if not args.config:
        raise BadInput("--latents needs --config FILE (the training config: table, buckets, VAE, text encoder)")
    config = load_config(args.config, overrides)
    if args.table:
        with config.unlocked():
            config.data.table = args.table
    if not config.data.get("table"):
        raise BadInput("no table: set data.table in the config or pass --input")
    from jaxsora.config import need_table

    need_table(config.data.table, "data.table (--input)")
    manifest = precompute_features(config, args.out, shard_size=args.shard_size, batch_size=args.batch_size,
                                   store_dtype=args.store_dtype, workers=args.workers, overwrite=args.overwrite,
                                   progress=not args.no_progress)
    if manifest is not None:
        skipped = sum(manifest["skipped"].values())
        print(f"wrote {manifest['num_records']} clips' latents and text states in {len(manifest['buckets'])} "
              f"bucket(s), {len(manifest['shards'])} shard(s), {manifest['dtype']}, to {args.out}"
              + (f"; skipped {skipped} rows {manifest['skipped']}" if skipped else "")
              + f"\ntrain from them with --config.data.features={args.out}", file=sys.stderr)
    return manifest

if __name__ == "__main__":
    from jaxsora.errors import run_cli

    run_cli("data_tools.precompute", lambda: (main(), 0)[1])
