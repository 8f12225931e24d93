"""`python -m data_tools.split --input meta.csv --output DIR (--num-shards N | --fractions train=0.9,val=0.1)
[--seed S]`: split a table into parts.

--num-shards N         N tables `DIR/<name>_0000.csv` … (name: the input's, without extension)
--fractions A=F,B=G…   tables `DIR/A.csv`, `DIR/B.csv` … holding about those fractions of the rows
                       (they must add up to 1)

Where a row goes is decided by a hash of its path (as written in the table, normalized) and the
seed, not by its position: the split is the same on every run, streams, keeps every row with
the same path in the same part (no train/val leak), and a row keeps its part when rows are added
to or removed from the table. Row order is kept within each part. Parts are written in the input's
format (`--format` to change it); relative paths are rewritten to resolve from DIR.
`python -m data_tools.merge` puts the parts back together.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys

import numpy as np

from data_tools import stream
from jaxsora.errors import BadInput, OutputExists

PROG = "split"


def path_hashes(paths, seed: int) -> np.ndarray:
    """[N] uint64: a keyed hash of each (normalized) path; a missing path hashes as ''."""
    key = str(int(seed)).encode()
    out = np.empty(len(paths), np.uint64)
    for i, p in enumerate(paths):
        p = "" if stream.is_missing(p) else os.path.normpath(str(p))
        out[i] = int.from_bytes(hashlib.blake2b(p.encode("utf-8"), digest_size=8, key=key).digest(), "little")
    return out


def parse_fractions(spec: str) -> tuple[list[str], np.ndarray]:
    names, fracs = [], []
    for item in spec.split(","):
        name, sep, value = item.strip().partition("=")
        try:
            f = float(value)
        except ValueError:
            f = math.nan
        if not sep or not name or not f >= 0:
            raise BadInput(f"--fractions {spec!r}: expected NAME=FRACTION,… (e.g. train=0.9,val=0.1), got {item!r}")
        if name in names:
            raise BadInput(f"--fractions {spec!r}: {name!r} appears twice")
        if os.sep in name or name in (".", ".."):
            raise BadInput(f"--fractions {spec!r}: {name!r} is not a file name")
        names.append(name)
        fracs.append(f)
    if abs(sum(fracs) - 1.0) > 1e-6:
        raise BadInput(f"--fractions {spec!r}: the fractions add up to {sum(fracs):g}, not 1")
    return names, np.cumsum(fracs)


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="table: CSV/parquet file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="folder for the parts (made if missing)")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--num-shards", type=int, help="N parts of about equal size")
    how.add_argument("--fractions", help="named parts by fraction, e.g. train=0.9,val=0.1")
    ap.add_argument("--seed", type=int, default=0, help="changes which rows go where (default 0)")
    ap.add_argument("--format", choices=("csv", "parquet"), default=None, help="default: the input's")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _split(args), argv)


def _split(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    files = stream.input_files(args.input)
    stream.require_columns(files, ["path"], "split (rows are placed by a hash of their path)")
    if args.num_shards is not None:
        if args.num_shards < 1:
            raise BadInput(f"--num-shards must be ≥ 1, got {args.num_shards}")
        stem = os.path.splitext(os.path.basename(args.input.rstrip("/")))[0]
        stem = stem if stem and not any(c in stem for c in "*?[") else "part"
        names = [f"{stem}_{i:04d}" for i in range(args.num_shards)]
    else:
        names, bounds = parse_fractions(args.fractions)
    ext = "." + (args.format or ("parquet" if files[0].endswith(".parquet") else "csv"))
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise OutputExists(f"--output {args.output} is a file; split writes a folder of parts")
    columns = stream.union_columns(files)
    counts = np.zeros(len(names), np.int64)
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(stream.TableWriter(os.path.join(args.output, n + ext), columns, args.overwrite))
                   for n in names]
        for chunk in stream.iter_chunks(files, args.chunk_size, desc=PROG, progress=not args.no_progress):
            h = path_hashes(chunk.df["path"].tolist(), args.seed)
            if args.num_shards is not None:
                part = (h % np.uint64(len(names))).astype(np.int64)
            else:
                u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # uniform in [0, 1)
                part = np.minimum(np.searchsorted(bounds, u, side="right"), len(names) - 1)
            for i in np.unique(part):
                writers[i].write(chunk, part == i)
            counts += np.bincount(part, minlength=len(names))
    for n, c in zip(names, counts):
        print(f"  {n + ext}: {c} rows")
    print(f"{int(counts.sum())} rows → {len(names)} parts in {os.path.abspath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
