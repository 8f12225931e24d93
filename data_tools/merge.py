"""`python -m data_tools.merge --input a.csv b.parquet shards/ --output all.csv`: several tables → one.

The output has every column of any input (in order of first appearance; empty where a table lacks
it) and the rows of the inputs in the order given. Each input may be a file, a folder or a glob of
shards. Relative paths are rewritten to resolve from the output's folder, so the merged table
finds the same files wherever it is written. Streams (`--chunk-size` rows at a time).
"""
from __future__ import annotations

import sys

from data_tools import stream

PROG = "merge"


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, nargs="+", help="tables: CSV/parquet files, folders or globs")
    ap.add_argument("--output", required=True, help="the merged table (.csv or .parquet)")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _merge(args), argv)


def _merge(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    per_input = [stream.input_files(t) for t in args.input]
    files = [f for fs in per_input for f in fs]
    counts = [0] * len(files)
    with stream.TableWriter(args.output, stream.union_columns(files), args.overwrite) as out:
        for chunk in stream.iter_chunks(files, args.chunk_size, desc=PROG, progress=not args.no_progress):
            counts[chunk.index] += len(chunk.df)
            out.write(chunk)
    first = 0
    for table, fs in zip(args.input, per_input):
        n = sum(counts[first:first + len(fs)])
        first += len(fs)
        print(f"  {table}: {n} rows" + (f" ({len(fs)} files)" if len(fs) > 1 else ""))
    print(f"{out.rows} rows, {len(out.columns)} columns → {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
