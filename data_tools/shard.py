"""`python -m data_tools.shard --input X.csv --num-shards N [--out-dir DIR]`: split a table into N
shards `X_0000.csv` … (row order kept). The loader reads a folder or glob of shards as one table
(`--data-path DIR` or `--data-path 'DIR/X_*.csv'`), lazily per file, with row ids running across shards."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pandas as pd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.shard", description=__doc__)
    ap.add_argument("--input", required=True)
    ap.add_argument("--num-shards", type=int, required=True)
    ap.add_argument("--out-dir", default=None, help="default: beside the input")
    args = ap.parse_args(argv)
    if args.num_shards < 1:
        ap.error("--num-shards must be ≥ 1")
    try:
        df = pd.read_parquet(args.input) if args.input.endswith(".parquet") else pd.read_csv(args.input)
    except Exception as e:
        print(f"cannot read table {args.input}: {e}", file=sys.stderr)
        return 2
    stem, ext = os.path.splitext(os.path.basename(args.input))
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.input))
    os.makedirs(out_dir, exist_ok=True)
    base_in = os.path.dirname(os.path.abspath(args.input))
    if "path" in df.columns and os.path.abspath(out_dir) != base_in:  # relative paths, re-rooted at out_dir
        df["path"] = [p if os.path.isabs(str(p)) else os.path.relpath(os.path.join(base_in, str(p)), out_dir)
                      for p in df["path"]]
    from tqdm.auto import tqdm

    for i, idx in enumerate(tqdm(np.array_split(np.arange(len(df)), args.num_shards), desc="shards")):
        part = df.iloc[idx]
        path = os.path.join(out_dir, f"{stem}_{i:04d}{ext}")
        part.to_parquet(path, index=False) if ext == ".parquet" else part.to_csv(path, index=False)
    print(f"{len(df)} rows → {args.num_shards} shards in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
