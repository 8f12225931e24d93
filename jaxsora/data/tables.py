"""Dataset tables: CSV or parquet with `path,text,num_frames,height,width,aspect_ratio,resolution,fps`
(spec §4.1). Relative paths resolve against the table's folder. A table may also be a folder or
a glob of shards (`meta_*.csv`), read in name order and concatenated (row ids run across shards)."""
from __future__ import annotations

import glob
import hashlib
import os

import numpy as np
import pandas as pd

REQUIRED = ("path", "text", "num_frames", "height", "width")
OPTIONAL = ("aspect_ratio", "resolution", "fps")


class TableError(ValueError):
    pass


def table_files(table: str) -> list[str]:
    if os.path.isdir(table):
        files = sorted(glob.glob(os.path.join(table, "*.csv")) + glob.glob(os.path.join(table, "*.parquet")))
    elif any(c in table for c in "*?["):
        files = sorted(glob.glob(table))
    else:
        files = [table]
    if not files:
        raise TableError(f"no table files found at {table}")
    for f in files:
        if not os.path.isfile(f):
            raise TableError(f"table not found: {f}")
    return files


def _read_one(path: str) -> pd.DataFrame:
    try:
        if path.endswith(".parquet"):
            df = pd.read_parquet(path)
        else:
            df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except Exception as e:
        raise TableError(f"cannot read table {path}: {e}") from e
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise TableError(f"table {path} lacks column(s) {missing}; it has {list(df.columns)}")
    base = os.path.dirname(os.path.abspath(path))
    df = df.copy()
    df["path"] = [p if os.path.isabs(str(p)) else os.path.join(base, str(p)) for p in df["path"]]
    df["text"] = df["text"].fillna("").astype(str)
    for c in ("num_frames", "height", "width"):
        bad = pd.to_numeric(df[c], errors="coerce").isna()
        if bad.any():
            row = int(np.nonzero(bad.values)[0][0])
            raise TableError(f"table {path}: column {c!r} has a non-numeric value in row {row}")
        df[c] = df[c].astype(int)
    if "fps" not in df.columns:
        df["fps"] = np.nan
    return df


def read_table(table: str) -> pd.DataFrame:
    """All shards concatenated; row ids 0..N−1 (they seed the bucket RNG)."""
    frames = [_read_one(f) for f in table_files(table)]
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    return df


def fingerprint(df: pd.DataFrame) -> str:
    """A hash of what decides the data order: paths, captions and the size columns, in order."""
    h = hashlib.sha256()
    for col in ("path", "text", "num_frames", "height", "width"):
        h.update(col.encode())
        h.update(pd.util.hash_pandas_object(df[col], index=False).values.tobytes())
    return h.hexdigest()[:16]
