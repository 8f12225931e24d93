"""Dataset tables: CSV or parquet with `path,text,num_frames,height,width,aspect_ratio,resolution,fps`
(spec §4.1). Relative paths resolve against the table's folder. A table may also be a folder or
a glob of shards (`meta_*.csv`), read in name order; row ids run across shards.

The loader does not keep the table in Python objects. `TableIndex.build` streams the shards one
at a time into a small folder of flat files — the size columns as `.npy`, paths and captions as
one UTF-8 blob each plus offsets — that every process (and every grain worker) memory-maps: the
bucket planner reads the size columns, a worker reads only the paths and captions of its rows,
and the OS shares the pages between processes. Millions of rows cost a few hundred MB of page
cache, not a copy of a DataFrame per worker.
"""
from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Optional, Sequence

import numpy as np
import pandas as pd

REQUIRED = ("path", "text", "num_frames", "height", "width")
OPTIONAL = ("aspect_ratio", "resolution", "fps")
SIZE_COLUMNS = ("num_frames", "height", "width")
INDEX_VERSION = 1


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


def read_table_file(path: str) -> pd.DataFrame:
    """One table file, checked: required columns present, sizes numeric, paths resolved."""
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
    df["path"] = [os.path.normpath(os.path.join(base, str(p))) for p in df["path"]]  # absolute ones stay
    df["text"] = df["text"].fillna("").astype(str)
    for c in SIZE_COLUMNS:
        bad = pd.to_numeric(df[c], errors="coerce").isna()
        if bad.any():
            row = int(np.nonzero(bad.values)[0][0])
            raise TableError(f"table {path}: column {c!r} has a non-numeric value in row {row}")
        df[c] = df[c].astype(np.int64)
    if "fps" not in df.columns:
        df["fps"] = np.nan
    return df


def read_table(table: str) -> pd.DataFrame:
    """All shards concatenated into one DataFrame (for tools and small tables; the loader uses
    `TableIndex`). Row ids 0..N−1."""
    frames = [read_table_file(f) for f in table_files(table)]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)


def _strings_to_blob(values: Sequence[str]) -> tuple[bytes, np.ndarray]:
    encoded = [v.encode("utf-8") for v in values]
    lengths = np.fromiter((len(b) for b in encoded), np.int64, len(encoded))
    return b"".join(encoded), lengths


def _common_folder(paths: Sequence[str]) -> str:
    """The deepest folder holding every path (normalized absolute paths)."""
    root = os.path.commonpath(paths)
    return os.path.dirname(root) if all(p == root for p in paths) else root


class TableIndex:
    """A read-only, memory-mapped table (see the module docstring). Pickles as its folder name, so
    grain workers reopen it instead of receiving a copy.

    num_frames/height/width: [N] int64; fps: [N] float64 (NaN where the table has none).
    """

    FILES = ("num_frames", "height", "width", "fps", "path_offsets", "text_offsets")

    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, "index.json")) as f:
            self.meta = json.load(f)
        if self.meta.get("version") != INDEX_VERSION:
            raise TableError(f"{directory}: table index version {self.meta.get('version')} ≠ {INDEX_VERSION}")
        self._arrays: dict = {}

    def __getstate__(self):
        return {"directory": self.directory}

    def __setstate__(self, state):
        self.__init__(state["directory"])

    def _array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            if name.endswith("_blob"):
                size = os.path.getsize(os.path.join(self.directory, name + ".bin"))
                self._arrays[name] = (np.memmap(os.path.join(self.directory, name + ".bin"), np.uint8, "r")
                                      if size else np.zeros(0, np.uint8))
            else:
                self._arrays[name] = np.load(os.path.join(self.directory, name + ".npy"), mmap_mode="r")
        return self._arrays[name]

    def __len__(self) -> int:
        return int(self.meta["num_rows"])

    @property
    def num_frames(self) -> np.ndarray:
        return self._array("num_frames")

    @property
    def height(self) -> np.ndarray:
        return self._array("height")

    @property
    def width(self) -> np.ndarray:
        return self._array("width")

    @property
    def fps(self) -> np.ndarray:
        return self._array("fps")

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def files(self) -> list[str]:
        return list(self.meta["files"])

    def _string(self, kind: str, row: int) -> str:
        off = self._array(kind + "_offsets")
        return bytes(self._array(kind + "_blob")[off[row]:off[row + 1]]).decode("utf-8")

    def path(self, row: int) -> str:
        return self._string("path", int(row))

    def text(self, row: int) -> str:
        return self._string("text", int(row))

    def paths(self, rows=None) -> list[str]:
        return [self.path(r) for r in (range(len(self)) if rows is None else rows)]

    def texts(self, rows=None) -> list[str]:
        return [self.text(r) for r in (range(len(self)) if rows is None else rows)]

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, table: str, directory: Optional[str] = None, progress: bool = True) -> "TableIndex":
        """Stream the table's shards into `directory` (default: a temporary folder removed at exit).
        A directory that already holds the index of the same files (names, sizes, modification
        times) is reused as it is — set `data.index_dir` to skip re-reading a large table on restarts."""
        files = [os.path.abspath(f) for f in table_files(table)]
        sources = [[f, os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]
        if directory is None:
            directory = tempfile.mkdtemp(prefix="jaxsora-table-")
            atexit.register(shutil.rmtree, directory, True)
        elif os.path.isfile(os.path.join(directory, "index.json")):
            try:
                existing = cls(directory)
                if existing.meta.get("sources") == sources:
                    return existing
            except (TableError, ValueError, OSError):
                pass
        os.makedirs(directory, exist_ok=True)
        for name in cls.FILES:  # a stale index: replaced (open memory maps elsewhere keep their old files)
            if os.path.exists(os.path.join(directory, name + ".npy")):
                os.remove(os.path.join(directory, name + ".npy"))
        if os.path.exists(os.path.join(directory, "index.json")):
            os.remove(os.path.join(directory, "index.json"))
        cols: dict[str, list] = {c: [] for c in SIZE_COLUMNS + ("fps",)}
        lengths: dict[str, list] = {"path": [], "text": []}
        roots, rows_per_file = [], []
        from tqdm.auto import tqdm

        for name in ("path_blob.bin", "text_blob.bin"):
            if os.path.exists(os.path.join(directory, name)):
                os.remove(os.path.join(directory, name))
        with open(os.path.join(directory, "path_blob.bin"), "wb") as pblob, \
                open(os.path.join(directory, "text_blob.bin"), "wb") as tblob:
            for f in tqdm(files, desc="reading table", unit="file", disable=not progress or len(files) < 2):
                df = read_table_file(f)
                rows_per_file.append(len(df))
                for c in SIZE_COLUMNS:
                    cols[c].append(df[c].to_numpy(np.int64))
                cols["fps"].append(pd.to_numeric(df["fps"], errors="coerce").to_numpy(np.float64))
                for kind, out in (("path", pblob), ("text", tblob)):
                    blob, n = _strings_to_blob(df[kind].tolist())
                    out.write(blob)
                    lengths[kind].append(n)
                if len(df):
                    roots.append(_common_folder(df["path"].tolist()))
                del df
        arrays = {c: np.concatenate(v) if v else np.zeros(0) for c, v in cols.items()}
        for kind in ("path", "text"):
            n = np.concatenate(lengths[kind]) if lengths[kind] else np.zeros(0, np.int64)
            arrays[kind + "_offsets"] = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        for name, a in arrays.items():
            np.save(os.path.join(directory, name + ".npy"), a)
        root = os.path.commonpath(roots) if roots else ""
        meta = dict(version=INDEX_VERSION, num_rows=int(sum(rows_per_file)), files=files, sources=sources,
                    rows_per_file=rows_per_file, root=root)
        meta["fingerprint"] = _fingerprint(directory, arrays, root)
        with open(os.path.join(directory, "index.json.tmp"), "w") as f:
            json.dump(meta, f)
        os.replace(os.path.join(directory, "index.json.tmp"), os.path.join(directory, "index.json"))  # complete
        return cls(directory)


def _fingerprint(directory: str, arrays: dict, root: str) -> str:
    """A hash of what decides the data order and the samples: the paths *relative to the dataset's
    common folder* (so a dataset moved or re-sharded as a whole keeps its fingerprint), the captions
    and the size columns, in row order."""
    h = hashlib.sha256()
    off = arrays["path_offsets"]
    paths = np.fromfile(os.path.join(directory, "path_blob.bin"), np.uint8)
    strip = len(root.encode("utf-8")) if root else 0
    if strip and len(off) > 1:  # drop each path's `root` prefix: a mask over the blob
        edges = np.bincount(off[:-1], minlength=len(paths) + 1) - np.bincount(off[:-1] + strip,
                                                                              minlength=len(paths) + 1)
        paths = paths[np.cumsum(edges)[:-1] == 0]
    h.update(b"path")
    h.update(paths.tobytes())
    h.update((np.diff(off) - strip).astype("<i8").tobytes())
    h.update(b"text")
    h.update(np.fromfile(os.path.join(directory, "text_blob.bin"), np.uint8).tobytes())
    h.update(np.diff(arrays["text_offsets"]).astype("<i8").tobytes())
    for c in SIZE_COLUMNS:
        h.update(c.encode())
        h.update(arrays[c].astype("<i8").tobytes())
    return h.hexdigest()[:16]


def fingerprint(table: str) -> str:
    """The fingerprint `TableIndex` computes, for a table path (folder, glob or file)."""
    index = TableIndex.build(table, progress=False)
    try:
        return index.fingerprint
    finally:
        shutil.rmtree(index.directory, ignore_errors=True)
