"""`python -m data_tools.shard --input X.csv --num-shards N [--output DIR]`: split a table into N
shards `X_0000.csv` … of contiguous rows (row order kept; sizes differ by at most one row). The
loader reads a folder or glob of shards as one table (`--data-path DIR` or `--data-path 'DIR/X_*.csv'`),
lazily per file, with row ids running across shards.

The input may itself be a folder or glob of shards (re-sharding): the shards are then named after the
folder (`DIR_0000.csv`; `part_0000.csv` for a glob) and written in the format of its first file. The
rows are counted first (parquet: from the metadata), then streamed (`--chunk-size` rows at a time)
into the shards one after the other. Relative paths are rewritten to resolve from the output
folder. Existing shards are refused unless `--overwrite`; a shard may not replace an input file.
To place rows by a hash of their path instead (train/val splits), see `python -m data_tools.split`.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from data_tools import stream
from jaxsora.cli import hidden_aliases
from jaxsora.errors import BadInput, OutputExists

PROG = "shard"


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="table: CSV/parquet file, folder or glob of shards")
    ap.add_argument("--num-shards", type=int, required=True, help="how many shards to write")
    hidden_aliases(ap, ap.add_argument(
        "--output", metavar="DIR", default=None, help="folder for the shards, made if missing (default: beside the "
        "input: a table file's folder, a folder's parent, a glob's folder)"), "--out-dir")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _shard(args), argv)


def shard_names(table: str, files, num_shards: int, out_dir: str) -> list[str]:
    """The shard files for the input `table` (a file, folder or glob; `files` its files)."""
    stem = os.path.splitext(os.path.basename(table.rstrip("/")))[0]
    stem = stem if stem and not any(c in stem for c in "*?[") else "part"
    ext = ".parquet" if files[0].endswith(".parquet") else ".csv"
    return [os.path.join(out_dir, f"{stem}_{i:04d}{ext}") for i in range(num_shards)]


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """Rows per shard, as `np.array_split` gives them: the first `rows % num_shards` get one more."""
    base, extra = divmod(rows, num_shards)
    return [base + (i < extra) for i in range(num_shards)]


def _shard(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    if args.num_shards < 1:
        raise BadInput(f"--num-shards must be ≥ 1, got {args.num_shards}")
    files = stream.input_files(args.input)
    if not files:
        raise BadInput(f"no table files in {args.input}")
    out_dir = os.path.abspath(args.output or os.path.dirname(os.path.abspath(args.input.rstrip("/"))))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OutputExists(f"--output {args.output} is a file; shard writes a folder of shards")
    names = shard_names(args.input, files, args.num_shards, out_dir)
    inputs = set(files)
    clash = [n for n in names if n in inputs]
    if clash:
        raise BadInput(f"the shard {clash[0]} would replace an input file; write the shards to another folder "
                       "(--output DIR)")
    existing = [n for n in names if os.path.lexists(n)]
    if existing and not args.overwrite:
        more = f" (and {len(existing) - 1} more shards)" if len(existing) > 1 else ""
        raise OutputExists(f"the output {existing[0]} exists{more}; pass --overwrite to replace it")
    for n in existing:
        stream.check_output(n, True)  # a folder in the way
    progress = not args.no_progress
    rows = sum(stream.count_rows(files, args.chunk_size, progress=progress))
    sizes = shard_sizes(rows, args.num_shards)
    columns = stream.union_columns(files)
    os.makedirs(out_dir, exist_ok=True)

    written: list[str] = []
    writer, i, left = None, -1, 0
    try:
        def next_shard():
            nonlocal writer, i, left
            if writer is not None:
                written.append(writer.close())
            i += 1
            writer, left = stream.TableWriter(names[i], columns, args.overwrite), sizes[i]

        next_shard()
        for chunk in stream.iter_chunks(files, args.chunk_size, desc=PROG, progress=progress):
            pos, n = 0, len(chunk.df)
            while pos < n:
                while left == 0 and i + 1 < len(names):
                    next_shard()
                if left == 0:
                    raise BadInput(f"{args.input} grew while it was read (counted {rows} rows); run again")
                take = min(left, n - pos)
                writer.write(chunk, np.arange(pos, pos + take))
                pos, left = pos + take, left - take
        while i + 1 < len(names):  # the rest (more shards than rows: empty ones)
            next_shard()
        if left:
            raise BadInput(f"{args.input} shrank while it was read (counted {rows} rows); run again")
        written.append(writer.close())
        writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        for path in written:  # no partial set of shards
            os.remove(path)
        raise
    print(f"{rows} rows → {args.num_shards} shards in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
