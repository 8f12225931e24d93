"""Dataset tables: CSV or parquet with `path,text,num_frames,height,width,aspect_ratio,resolution,fps`
(Open-Sora 1.2's columns). Relative paths resolve against the table's folder. A table may also be a folder or
a glob of shards (`meta_*.csv`), read in name order; row ids run across shards.

Beyond the local disk: a row's path may be an fsspec URL (``s3://``, ``gs://``, ``memory://``, …; read
through fsspec by `video.load_sample`), and so may the table, its folder or glob — relative paths
then resolve against the table's URL folder. ``file://`` URLs are taken as the local paths they
name (the fast path). A URL table's index is reused while each file's size and fsspec `ukey`
(modification time or ETag) stay the same.

The loader does not keep the table in Python objects. `TableIndex.build` streams the shards one
at a time into a small folder of flat files — the size columns as `.npy`, paths and captions as
one UTF-8 blob each plus offsets — that every process (and every grain worker) memory-maps: the
bucket planner reads the size columns, a worker reads only the paths and captions of its rows,
and the OS shares the pages between processes. Millions of rows cost a few hundred MB of page
cache, not a copy of a DataFrame per worker.

Where the index lives: a given folder (the train loop passes `<run folder>/table_index`) is reused
while the table files are unchanged (names, sizes, modification times) and rebuilt otherwise.
Without one, a temporary folder `jaxsora-table-<pid>-*` is made, removed at normal exit, and held
by an exclusive `flock` on its `owner.lock` for the life of the process; every temporary build
first removes the `jaxsora-table-*` folders whose lock is free (their owner died, kill -9
included). The lock, not the pid, is the test, so a reused pid keeps no stale folder alive and
no live folder is taken; the pid in the name is for people. (Folders named by older versions,
without a pid, are left alone: nothing tells whether their owner still runs.)
"""
from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
import pandas as pd

from jaxsora.data.video import is_url, local_path
from jaxsora.errors import UserError

REQUIRED = ("path", "text", "num_frames", "height", "width")
OPTIONAL = ("aspect_ratio", "resolution", "fps")
SIZE_COLUMNS = ("num_frames", "height", "width")
INDEX_VERSION = 1
TEMP_PREFIX = "jaxsora-table-"
OWNER_LOCK = "owner.lock"
_owned_temp_dirs: dict = {}  # temporary index folder → its open, locked owner.lock


class TableError(UserError, ValueError):
    pass


def _url_table_files(table: str) -> list[str]:
    """`table_files` for a URL: the file, or the CSV/parquet files of a folder or glob, as URLs."""
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(table)
        if "::" in table:  # a chained URL (simplecache::s3://…) names one file; no listing
            files, urls = [path], [table]
        else:
            if fs.isdir(path):
                files = sorted(fs.glob(path.rstrip("/") + "/*.csv") + fs.glob(path.rstrip("/") + "/*.parquet"))
            elif any(c in path for c in "*?["):
                files = sorted(fs.glob(path))
            else:
                files = [path]
            urls = [table] if files == [path] else [fs.unstrip_protocol(f) for f in files]
        if not files:
            raise TableError(f"no table files found at {table}")
        for f, u in zip(files, urls):
            if not fs.isfile(f):
                raise TableError(f"table not found: {u}")
    except TableError:
        raise
    except Exception as e:
        raise TableError(f"cannot list table {table}: {type(e).__name__}: {e}") from e
    return urls


def _join(base: str, path: str) -> str:
    """A table row's path resolved against the table's folder `base` (a local folder or a URL one):
    URLs stay as they are (``file://`` ones become local paths), absolute local paths too."""
    path = str(path)
    if is_url(path):
        return local_path(path) or path
    if is_url(base) and not path.startswith("/"):
        head, rest = base.rsplit("://", 1)
        return f"{head}://{posixpath.normpath(posixpath.join(rest, path))}"
    return os.path.normpath(os.path.join(base, path))  # absolute ones stay


def _source_stamp(f: str) -> list:
    """[file, size, change stamp] of a table file: the modification time of a local file, fsspec's
    `ukey` (a hash of its info: mtime, ETag, …) of a URL."""
    if not is_url(f):
        return [f, os.path.getsize(f), os.stat(f).st_mtime_ns]
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(f)
    return [f, int(fs.size(path)), str(fs.ukey(path))]


def table_files(table: str) -> list[str]:
    table = str(table)
    local = local_path(table)
    if local is None:
        return _url_table_files(table)
    table = local
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


_CHECKED: dict = {}  # check_table's answers: (file, size, mtime) of each local table file → row count


def check_table(table: str) -> int:
    """Cheap checks before a run takes its folder: every file exists and reads, has the required
    columns, and the table has at least one row. Reads headers and row counts only (parquet
    metadata; a CSV is scanned without parsing its values). Returns the row count. A local table
    checked before in this process, its files unchanged, is not read again (the trainer's command
    line checks it before importing jax, and the run once more)."""
    files = table_files(table)
    key = None
    if not any(is_url(f) for f in files):
        stats = [os.stat(f) for f in files]
        key = tuple((f, st.st_size, st.st_mtime_ns) for f, st in zip(files, stats))
        if key in _CHECKED:
            return _CHECKED[key]
    rows = _check_table_files(table, files)
    if key is not None:
        _CHECKED[key] = rows
    return rows


def _check_table_files(table: str, files: list) -> int:
    rows = 0
    for f in files:
        try:
            if f.endswith(".parquet"):
                import pyarrow.parquet as pq

                if is_url(f):
                    import fsspec

                    with fsspec.open(f, "rb") as fo:
                        meta = pq.ParquetFile(fo)
                        cols, n = meta.schema_arrow.names, meta.metadata.num_rows
                else:
                    meta = pq.ParquetFile(f)
                    cols, n = meta.schema_arrow.names, meta.metadata.num_rows
            else:
                cols = list(pd.read_csv(f, nrows=0).columns)
                n = _csv_rows(f)
        except Exception as e:
            raise TableError(f"cannot read table {f}: {type(e).__name__}: {e}") from e
        missing = [c for c in REQUIRED if c not in cols]
        if missing:
            raise TableError(f"table {f} lacks column(s) {missing}; it has {cols}")
        rows += n
    if rows == 0:
        raise TableError(f"the table {table} has no rows")
    return rows


def _csv_rows(path: str) -> int:
    """Data rows of a CSV (quoted newlines in captions counted correctly)."""
    return sum(len(chunk) for chunk in pd.read_csv(path, usecols=[0], chunksize=1 << 18, dtype=str,
                                                   keep_default_na=False))


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
    base = path.rsplit("/", 1)[0] if is_url(path) else os.path.dirname(os.path.abspath(path))
    df = df.copy()
    df["path"] = [_join(base, p) for p in df["path"]]  # absolute ones and URLs stay
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


def _common_prefix(paths: Sequence[str]) -> str:
    """The longest run of whole '/'-separated parts every path (URL) starts with."""
    parts = [p.split("/") for p in paths]
    common = []
    for column in zip(*parts):
        if any(c != column[0] for c in column):
            break
        common.append(column[0])
    return "/".join(common)


def _common_folder(paths: Sequence[str]) -> str:
    """The deepest folder holding every path (normalized absolute paths or URLs)."""
    if any(is_url(p) for p in paths):
        root = _common_prefix(paths)
        return root.rsplit("/", 1)[0] if all(p == root for p in paths) else root
    root = os.path.commonpath(paths)
    return os.path.dirname(root) if all(p == root for p in paths) else root


def _common_root(roots: Sequence[str]) -> str:
    """The common folder of the shards' folders."""
    if not roots:
        return ""
    return _common_prefix(roots) if any(is_url(r) for r in roots) else os.path.commonpath(roots)


def _stale_temp_dir(path: str) -> bool:
    """Whether a `jaxsora-table-<pid>-*` folder's owner is gone (its lock is free, or it died
    before taking it)."""
    m = re.fullmatch(re.escape(TEMP_PREFIX) + r"(\d+)-.*", os.path.basename(path))
    if m is None or path in _owned_temp_dirs:
        return False
    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDONLY)
    except FileNotFoundError:  # made but not yet (or never) locked: stale only if its process is gone
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            pass
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held: the owner runs
        return False
    finally:
        os.close(fd)


def sweep_stale_temp_dirs(root: str | None = None) -> list[str]:
    """Remove the temporary index folders of dead processes under `root` (default: the system
    temp folder). → the folders removed."""
    removed = []
    for path in sorted(glob.glob(os.path.join(root or tempfile.gettempdir(), TEMP_PREFIX + "*"))):
        if os.path.isdir(path) and _stale_temp_dir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_temp_dir() -> str:
    """A fresh `jaxsora-table-<pid>-*` folder, locked for this process and removed at its exit."""
    sweep_stale_temp_dirs()
    directory = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
    lock = os.path.join(directory, OWNER_LOCK)
    fd = os.open(lock + ".tmp", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel when this process ends, however it ends
    os.replace(lock + ".tmp", lock)  # appears already locked: a sweep never sees it free while we live
    _owned_temp_dirs[directory] = fd
    atexit.register(remove_temp_dir, directory)
    return directory


def remove_temp_dir(directory: str) -> None:
    """Remove a temporary index folder this process made (no-op for any other folder)."""
    fd = _owned_temp_dirs.pop(directory, None)
    if fd is None:
        return
    shutil.rmtree(directory, ignore_errors=True)
    os.close(fd)


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
    def build(cls, table: str, directory: str | None = None, progress: bool = True) -> TableIndex:
        """Stream the table's shards into `directory` (default: a temporary folder removed at exit,
        see the module docstring). A directory that already holds the index of the same files
        (names, sizes, modification times) is reused as it is — set `data.index_dir` to skip
        re-reading a large table on restarts."""
        files = [f if is_url(f) else os.path.abspath(f) for f in table_files(table)]
        sources = [_source_stamp(f) for f in files]
        if directory is None:
            directory = _make_temp_dir()
        elif os.path.isfile(os.path.join(directory, "index.json")):
            try:
                existing = cls(directory)
                if existing.meta.get("sources") == sources:
                    return existing
            except (TableError, ValueError, OSError):
                pass
        os.makedirs(directory, exist_ok=True)
        # A stale index: replaced (open memory maps elsewhere keep their old files). index.json goes
        # first and comes back last, so an index killed mid-build is never taken as complete.
        if os.path.exists(os.path.join(directory, "index.json")):
            os.remove(os.path.join(directory, "index.json"))
        for name in cls.FILES:
            if os.path.exists(os.path.join(directory, name + ".npy")):
                os.remove(os.path.join(directory, name + ".npy"))
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
        root = _common_root(roots)
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
        remove_temp_dir(index.directory)
