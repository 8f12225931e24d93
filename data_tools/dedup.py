"""`python -m data_tools.dedup --input meta.csv --output unique.csv [--by path|content]`: drop repeated
rows, keeping the first occurrence.

--by path     the same file: rows whose paths are equal once made absolute (relative paths resolve
              against the table file's folder) and normalized (`a/./b/../c.mp4` = `a/c.mp4`).
--by content  the same bytes: the sha256 of each file, read in 1 MiB blocks by `--num-workers`
              threads. A file that cannot be read is kept (and counted): use
              `python -m data_tools.filter --remove-missing` to drop those.

The table streams (`--chunk-size` rows at a time): only the set of keys seen so far stays in
memory. Relative paths are rewritten to resolve from the output's folder.
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

from data_tools import stream

PROG = "dedup"
BLOCK = 1 << 20


def file_sha256(path: str):
    """The file's sha256 digest (bytes), or None if it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(BLOCK):
                h.update(block)
    except OSError:
        return None
    return h.digest()


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="table: CSV/parquet file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="the first occurrence of each file (.csv or .parquet)")
    ap.add_argument("--by", choices=("path", "content"), default="path", help="what makes two rows the same")
    ap.add_argument("--num-workers", type=int, default=8, help="threads hashing files (--by content)")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _dedup(args), argv)


def _dedup(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    files = stream.input_files(args.input)
    stream.require_columns(files, ["path"], f"dedup --by {args.by}")
    seen: set = set()
    total = duplicates = unkeyed = 0
    with stream.TableWriter(args.output, stream.union_columns(files), args.overwrite) as out:
        for chunk in stream.iter_chunks(files, args.chunk_size, desc=f"{PROG} by {args.by}",
                                        progress=not args.no_progress):
            paths = stream.resolve_paths(chunk.df["path"].tolist(), chunk.base)
            if args.by == "path":
                keys = [p or None for p in paths]
            else:
                keys = stream.thread_map(lambda p: file_sha256(p) if p else None, paths, args.num_workers)
            keep = np.ones(len(paths), bool)
            for i, key in enumerate(keys):
                if key is None:  # no path, or an unreadable file: never a duplicate
                    unkeyed += 1
                elif key in seen:
                    keep[i] = False
                else:
                    seen.add(key)
            total += len(keep)
            duplicates += int(np.count_nonzero(~keep))
            out.write(chunk, keep)
    print(f"{total} rows read; {duplicates} duplicates (same {'file' if args.by == 'path' else 'bytes'}) removed; "
          f"{out.rows} rows kept → {out.path}")
    if unkeyed:
        print(f"{unkeyed} rows kept as they are: " + ("no path" if args.by == "path" else
                                                      "no path, or the file could not be read"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
