"""Streaming tables for the data tools (`filter`, `dedup`, `merge`, `split`, `stats`).

A table is what `jaxsora.data.tables` accepts: a CSV or parquet file, a folder of them or a glob
(`meta_*.csv`), read in name order. Nothing here holds a whole table: `iter_chunks` reads a CSV
with pandas' `chunksize` and a parquet file with pyarrow's `iter_batches`, with one tqdm bar on
stderr over the bytes of all the files, and `TableWriter` appends chunk by chunk.

Paths: a relative `path` resolves against the folder of the table file that holds it. A writer
re-roots relative paths at its own folder (absolute ones stay absolute), so every output still
loads with `jaxsora.data.tables` wherever it is written.

CSV values pass through as text (`24` stays `24`, `007` stays `007`, a caption `NA` stays `NA`);
the tools read numbers from them where they compare them. A CSV written to parquet gets numeric
columns where every value of a column is a number. Outputs are written to a temporary file beside
the output and renamed into place at the end: a failed run leaves no half-written table, and
`--output` may name an input (with `--overwrite`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from jaxsora.cli import ArgumentParser, HelpFormatter  # noqa: F401  (the data tools' --help; parser() uses it)
from jaxsora.errors import BadInput, OutputExists, UnknownKey, UserError, run_cli

DEFAULT_CHUNK_ROWS = 100_000
STRING_COLUMNS = ("path", "text")  # never turned into numbers


# ---- command line -------------------------------------------------------------------------------


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser; the tool adds its flags, then `parse_args` adds the common ones and parses."""
    return ArgumentParser(prog=f"python -m data_tools.{prog}", description=doc, allow_abbrev=False,
                                   formatter_class=HelpFormatter)


def parse_args(ap: argparse.ArgumentParser, argv: Sequence[str] | None, known: bool = False):
    """Parse with the flags every tool has; `known`: also return the arguments left over."""
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output")
    ap.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_ROWS, metavar="ROWS",
                    help="rows read and written at a time")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    return ap.parse_known_args(argv) if known else ap.parse_args(argv)


def run(prog: str, body: Callable[[], int], argv: Sequence[str] | None) -> int:
    """A tool's body under `run_cli`: a user error is one line on stderr and exit code 2."""
    return run_cli(f"data_tools.{prog}", body, sys.argv if argv is None else list(argv))


def check_chunk_size(n: int) -> int:
    if n < 1:
        raise BadInput(f"--chunk-size must be ≥ 1, got {n}")
    return n


# ---- reading ------------------------------------------------------------------------------------
def input_files(tables: str | Sequence[str]) -> list[str]:
    """The files of one or several tables (each a file, folder or glob), in order."""
    from jaxsora.data.tables import table_files

    tables = [tables] if isinstance(tables, str) else list(tables)
    files = []
    for t in tables:
        if not any(c in t for c in "*?[") and not os.path.exists(t):
            raise BadInput(f"no such table: {t}")
        files += [os.path.abspath(f) for f in table_files(t)]
    return files


def file_columns(path: str) -> list[str]:
    """A table file's column names (its header or parquet schema only)."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(path).schema_arrow.names)
        return list(pd.read_csv(path, nrows=0).columns)
    except Exception as e:
        raise BadInput(f"cannot read table {path}: {type(e).__name__}: {one_line_error(e)}") from e


def union_columns(files: Sequence[str]) -> list[str]:
    """Every column of the files, in order of first appearance."""
    out: dict[str, None] = {}
    for f in files:
        out.update(dict.fromkeys(file_columns(f)))
    return list(out)


def require_columns(files: Sequence[str], columns: Sequence[str], why: str = "") -> None:
    """UnknownKey naming the first file that lacks one of `columns`, and the columns it has."""
    for f in files:
        have = file_columns(f)
        missing = [c for c in columns if c not in have]
        if missing:
            what = f" (needed by {why})" if why else ""
            raise UnknownKey(f"table {f} has no column {', '.join(map(repr, missing))}{what}; its columns: {have}")


def count_rows(files: Sequence[str], chunk_rows: int = DEFAULT_CHUNK_ROWS, progress: bool = True,
               desc: str = "counting rows") -> list[int]:
    """The number of rows of each file: a parquet file's from its metadata, a CSV file's by parsing
    it (quoted newlines in captions count right), one column at a time."""
    from tqdm.auto import tqdm

    check_chunk_size(chunk_rows)
    csv = [f for f in files if not f.endswith(".parquet")]
    bar = tqdm(total=sum(os.path.getsize(f) for f in csv), desc=desc, unit="B", unit_scale=True, file=sys.stderr,
               disable=not progress or not csv, dynamic_ncols=True)
    counts = []
    try:
        for f in files:
            try:
                if f.endswith(".parquet"):
                    import pyarrow.parquet as pq

                    counts.append(pq.ParquetFile(f).metadata.num_rows)
                    continue
                n, done = 0, bar.n
                with open(f, "rb") as fh:
                    for df in pd.read_csv(fh, chunksize=chunk_rows, usecols=[0], dtype=str, keep_default_na=False,
                                          na_values=[""]):
                        n += len(df)
                        bar.update(done + fh.tell() - bar.n)
                counts.append(n)
                bar.update(done + os.path.getsize(f) - bar.n)
            except Exception as e:
                raise BadInput(f"cannot read table {f}: {type(e).__name__}: {one_line_error(e)}") from e
    finally:
        bar.close()
    return counts


@dataclasses.dataclass
class Chunk:
    file: str  # absolute path of the table file
    index: int  # its position in the list of files read
    base: str  # its folder: where its relative paths resolve
    df: pd.DataFrame
    start: int  # row id of the chunk's first row, counted across all the files
    raw: bool  # values as CSV text (not typed)


def one_line_error(e: BaseException) -> str:
    return " ".join(str(e).split())


def iter_chunks(files: Sequence[str], chunk_rows: int = DEFAULT_CHUNK_ROWS, columns: Sequence[str] | None = None,
                desc: str = "reading", progress: bool = True) -> Iterator[Chunk]:
    """The rows of the files, `chunk_rows` at a time (a chunk never spans two files). `columns`: read
    only these (each file must have them). Progress: one bar over the bytes of all files."""
    from tqdm.auto import tqdm

    check_chunk_size(chunk_rows)
    sizes = [os.path.getsize(f) for f in files]
    bar = tqdm(total=sum(sizes), desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    start, done = 0, 0
    try:
        for i, (f, size) in enumerate(zip(files, sizes)):
            base = os.path.dirname(f)
            try:
                for df, fraction in _file_chunks(f, chunk_rows, columns):
                    bar.update(done + int(size * fraction) - bar.n)
                    bar.set_postfix_str(f"{start + len(df):,} rows", refresh=False)
                    yield Chunk(f, i, base, df, start, raw=not f.endswith(".parquet"))
                    start += len(df)
            except (UserError, GeneratorExit):
                raise
            except Exception as e:  # a malformed line, a truncated parquet file, ...
                raise BadInput(f"cannot read table {f}: {type(e).__name__}: {one_line_error(e)}") from e
            done += size
            bar.update(done - bar.n)
    finally:
        bar.close()


def _file_chunks(path: str, chunk_rows: int, columns: Sequence[str] | None):
    """(DataFrame, fraction of the file read so far) per chunk of one file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        total, seen = max(pf.metadata.num_rows, 1), 0
        for batch in pf.iter_batches(batch_size=chunk_rows, columns=list(columns) if columns else None):
            seen += batch.num_rows
            yield batch.to_pandas(), seen / total
        return
    size = max(os.path.getsize(path), 1)
    with open(path, "rb") as fh:
        # keep_default_na=False: a caption "NA" or "null" stays a caption (as jaxsora.data.tables reads it)
        reader = pd.read_csv(fh, chunksize=chunk_rows, usecols=list(columns) if columns else None, dtype=str,
                             keep_default_na=False, na_values=[""])
        for df in reader:
            yield df, min(fh.tell() / size, 1.0)


def is_missing(p) -> bool:
    return p is None or (isinstance(p, float) and np.isnan(p)) or p is pd.NA


def resolve_paths(values, base: str) -> list[str]:
    """Normalized absolute paths: relative ones resolve against `base` (a missing value gives ''); URLs
    (`s3://…`) as they are, `file://` ones as the local paths they name."""
    from jaxsora.data.video import is_url, local_path

    return ["" if is_missing(p) else (local_path(str(p)) or str(p)) if is_url(str(p))
            else os.path.normpath(os.path.join(base, str(p))) for p in values]


def rebase_paths(values, src: str, dst: str) -> list:
    """Relative paths that resolved against folder `src` rewritten to resolve from `dst`; absolute
    paths, URLs and missing values as they are."""
    if os.path.normpath(src) == os.path.normpath(dst):
        return list(values)
    return [p if is_missing(p) or os.path.isabs(str(p)) or "://" in str(p)
            else os.path.relpath(os.path.join(src, str(p)), dst) for p in values]


def numeric(df: pd.DataFrame, column: str) -> np.ndarray:
    """A column as float64 (a value that is not a number: NaN)."""
    return pd.to_numeric(df[column], errors="coerce").to_numpy(np.float64)


# ---- writing ------------------------------------------------------------------------------------
def check_output(path: str, overwrite: bool) -> None:
    if os.path.isdir(path):
        raise OutputExists(f"the output {path} is a folder; name a .csv or .parquet file")
    if os.path.exists(path) and not overwrite:
        raise OutputExists(f"the output {path} exists; pass --overwrite to replace it")


class TableWriter:
    """One output table (CSV, or parquet if the name ends in .parquet) written chunk by chunk.

    `columns`: the output's columns in order; a chunk lacking one gets it empty. `write(chunk, rows)`
    re-roots the chunk's relative paths from its file's folder to the output's folder. The file appears at
    `close()` (renamed from a temporary file); `abort()` (or leaving the `with` block on an error)
    removes what was written.
    """

    def __init__(self, path: str, columns: Sequence[str], overwrite: bool = False):
        check_output(path, overwrite)
        self.path = os.path.abspath(path)
        self.folder = os.path.dirname(self.path)
        self.columns = list(columns)
        self.parquet = path.endswith(".parquet")
        self.rows = 0
        os.makedirs(self.folder, exist_ok=True)
        name = os.path.basename(self.path)
        self._tmp = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=self.folder)
        self._parts: list[str] = []
        self._csv = None
        if not self.parquet:
            self._csv = open(os.path.join(self._tmp, name), "w", newline="", encoding="utf-8")  # noqa: SIM115 (closed in close())
            pd.DataFrame(columns=self.columns).to_csv(self._csv, index=False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def write(self, chunk: Chunk, rows: np.ndarray | None = None) -> None:
        """The chunk's rows (all, or those of a boolean mask / index array), paths re-rooted here."""
        df = chunk.df if rows is None else chunk.df[rows] if np.asarray(rows).dtype == bool else chunk.df.iloc[rows]
        if not len(df):
            return
        df = df.reindex(columns=self.columns)
        if "path" in df.columns:
            df["path"] = rebase_paths(df["path"].tolist(), chunk.base, self.folder)
        self.rows += len(df)
        if self._csv is not None:
            df.to_csv(self._csv, index=False, header=False)
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        if chunk.raw:
            df = _numbers_from_text(df)
        part = os.path.join(self._tmp, f"part{len(self._parts):06d}.parquet")
        t = pa.Table.from_pandas(df, preserve_index=False)
        # a column empty throughout the chunk has no type of its own: the other chunks give it one
        t = pa.table([pa.nulls(len(t)) if c.null_count == len(t) else c for c in t.columns], names=t.column_names)
        pq.write_table(t, part)
        self._parts.append(part)

    def close(self) -> str:
        try:
            if self._csv is not None:
                self._csv.close()
                os.replace(self._csv.name, self.path)
            else:
                self._finish_parquet()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        if self._csv is not None:
            self._csv.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _finish_parquet(self) -> None:
        """The parts (one per chunk, each with the types pandas gave it) → one file with one schema:
        int and float → float, a column empty in some chunks → the type of the others, a column
        both text and numbers → text."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        schemas = [pq.read_schema(p) for p in self._parts]
        schema = pa.schema([pa.field(c, _unify_types([s.field(c).type for s in schemas if c in s.names]))
                            for c in self.columns])
        out = os.path.join(self._tmp, "table.parquet")
        with pq.ParquetWriter(out, schema) as w:
            for p in self._parts:
                t = pq.read_table(p)
                arrays = [_cast(t.column(c), f.type) if c in t.column_names else pa.nulls(len(t), f.type)
                          for c, f in zip(self.columns, schema)]
                w.write_table(pa.Table.from_arrays(arrays, schema=schema))
                os.remove(p)
        os.replace(out, self.path)


def _numbers_from_text(df: pd.DataFrame) -> pd.DataFrame:
    """CSV text columns whose every value is a number (or empty) as numbers (not path or text)."""
    df = df.copy()
    for c in df.columns:
        if c in STRING_COLUMNS or df[c].isna().all():
            continue
        with contextlib.suppress(ValueError, TypeError):
            df[c] = pd.to_numeric(df[c])
    return df


def _unify_types(types):
    """One type for a column's types in the chunks; as pandas reads a whole column at once, integers
    with missing values (a chunk where the column is empty) become floats."""
    import pyarrow as pa

    known = [t for t in types if not pa.types.is_null(t)]
    if not known:
        return pa.string()
    try:
        t = pa.unify_schemas([pa.schema([("c", t)]) for t in known], promote_options="permissive").field("c").type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pa.large_string()
    return pa.float64() if pa.types.is_integer(t) and len(known) < len(types) else t


def _cast(column, target):
    if column.type == target:
        return column
    return column.cast(target)


# ---- one part of a table, for one host of many ----------------------------------------------------------
SHARD_ENV = (("JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "jaxsora.cluster launch"),
             ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "a SLURM job array"),
             ("SLURM_PROCID", "SLURM_NTASKS", "srun"))


def parse_shard(spec: str) -> tuple[int, int] | str:
    """`--shard K/N` (part K of N, counted from 0) → (K, N), or "auto" (`shard_from_env` reads them when
    the command runs). For argparse's `type=`."""
    return spec if spec == "auto" else _shard_numbers(spec, spec)


def shard_from_env(environ=os.environ) -> tuple[int, int]:
    """`--shard auto`: (K, N) from what the launcher set: JAX_PROCESS_ID/JAX_NUM_PROCESSES (`jaxsora.cluster
    launch` on each host), a SLURM job array's task (SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN of
    SLURM_ARRAY_TASK_COUNT), or srun's SLURM_PROCID/SLURM_NTASKS."""
    for k_name, n_name, what in SHARD_ENV:
        if environ.get(k_name) and environ.get(n_name):
            k, n = environ[k_name], environ[n_name]
            shown = f"--shard auto ({what}: {k_name}={k}, {n_name}={n})"
            try:
                if k_name == "SLURM_ARRAY_TASK_ID":
                    k = str(int(k) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0")))
                return _shard_numbers(f"{k}/{n}", shown)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise BadInput(str(e)) from None
    names = ", ".join(f"{k}/{n}" for k, n, _ in SHARD_ENV)
    raise BadInput(f"--shard auto: none of {names} is set (give --shard K/N)")


def _shard_numbers(spec: str, shown: str) -> tuple[int, int]:
    k, sep, n = spec.partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown}: expected K/N, part K of N counted from 0 (e.g. 0/24)") from None
    if not sep or n < 1 or not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"{shown}: expected K/N with 0 ≤ K < N (e.g. 0/24 … 23/24)")
    return k, n


def shard_output(path: str, shard: tuple[int, int]) -> str:
    """Part K of N's own output beside `path`: `ok.csv` → `ok_0003-of-0024.csv`. In name order the parts
    are in table order, so `data_tools.merge --input 'ok_*-of-0024.csv'` puts them back together."""
    stem, ext = os.path.splitext(path)
    return f"{stem}_{shard[0]:04d}-of-{shard[1]:04d}{ext}"


def add_reading_flags(ap: argparse.ArgumentParser, verb: str) -> None:
    """--shard and --num-workers of a tool that reads every file of a table in workers (`meta`, `check`);
    `verb`: what it does to a part ("read", "check")."""
    from data_tools.workers import default_workers

    ap.add_argument("--shard", type=parse_shard, default=None, metavar="K/N",
                    help=f"{verb} part K of N of the table (0 ≤ K < N), or `auto` (from jaxsora.cluster launch or "
                    "SLURM); writes <output stem>_KKKK-of-NNNN<ext> (default: all of it)")
    ap.add_argument("--num-workers", type=int, default=default_workers(),
                    help="worker processes reading files (default: the cores this process may use, %(default)s here)")


def reading_tool_setup(args, columns: Sequence[str] = (), why: str = "") -> tuple[list[str], tuple[int, int], str]:
    """For a tool that reads every file of a table in timed workers (`meta`, `check`): its common flags
    checked (--chunk-size, --num-workers, --time-limit), the table's files (with `columns`, needed by `why`),
    the part it reads (--shard K/N or auto; all of it: (0, 1)) and that part's output."""
    check_chunk_size(args.chunk_size)
    if args.num_workers < 1:
        raise BadInput(f"--num-workers must be ≥ 1, got {args.num_workers}")
    if not args.time_limit > 0:
        raise BadInput(f"--time-limit must be > 0 seconds, got {args.time_limit:g}")
    files = input_files(args.input)
    if not files:
        raise BadInput(f"no table files in {args.input}")
    if columns:
        require_columns(files, columns, why)
    shard = shard_from_env() if args.shard == "auto" else args.shard or (0, 1)
    return files, shard, shard_output(args.output, shard) if args.shard else args.output


SHARD_COST = ("num_frames", "height", "width")


def shard_rows(files: Sequence[str], shard: tuple[int, int], chunk_rows: int = DEFAULT_CHUNK_ROWS,
               progress: bool = True) -> tuple[int, int, int]:
    """(first row, end row, rows in all) of part K of N: contiguous rows, so the parts in order are the
    table. Balanced by the work of decoding them, num_frames × height × width of each row (a row
    without those: the mean of the others), when every file has those columns; else by row count.
    The same table gives every host the same parts."""
    k, n = shard
    if all(c in file_columns(f) for f in files for c in SHARD_COST):
        costs = []
        for chunk in iter_chunks(files, chunk_rows, columns=SHARD_COST, desc="dividing the work", progress=progress):
            v = np.prod([numeric(chunk.df, c) for c in SHARD_COST], axis=0)
            costs.append(np.where(np.isfinite(v) & (v > 0), v, np.nan))
        cost = np.concatenate(costs) if costs else np.zeros(0)
        rows = len(cost)
        if rows and np.isfinite(cost).any():
            cost = np.where(np.isnan(cost), np.nanmean(cost), cost)
            cum = np.cumsum(cost)
            middle = cum - cost / 2  # a row belongs to the part its cost's middle falls in
            bounds = np.searchsorted(middle, cum[-1] * np.arange(n + 1) / n, side="left")
            bounds[-1] = rows
            return int(bounds[k]), int(bounds[k + 1]), rows
    else:
        rows = sum(count_rows(files, chunk_rows, progress=progress))
    first = k * (rows // n) + min(k, rows % n)  # as np.array_split (data_tools.shard)
    return first, first + rows // n + (k < rows % n), rows


def thread_map(fn: Callable, items: Sequence, workers: int) -> list:
    """`[fn(x) for x in items]`, in order, over `workers` threads (file checks and reads wait on I/O)."""
    if workers <= 1 or len(items) < 2:
        return [fn(x) for x in items]
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(min(workers, len(items))) as ex:
        return list(ex.map(fn, items))
