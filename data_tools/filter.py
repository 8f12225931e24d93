"""`python -m data_tools.filter --input meta.csv --output kept.csv [ranges] [--remove-missing]`: keep the
rows within every range given.

Ranges (inclusive; give either end or both):
  --aes-min/--aes-max        aesthetic score, column `aes`
  --flow-min/--flow-max      motion score, column `flow`
  --ocr-min/--ocr-max        OCR score, column `ocr`
  --match-min/--match-max    text-match score, column `match`
  --frames-min/--frames-max  column `num_frames`
  --height-min/--height-max, --width-min/--width-max   pixels
  --fps-min/--fps-max        column `fps`
  --size-min/--size-max      file size, column `file_size` (bytes; data_tools.meta fills it), written
                             with a unit as people write it: 50MB = 50·10⁶ bytes, 50MiB (or 50M, as
                             GNU dd and ls -h read it) = 50·2²⁰; kB, GB, TB, KiB, GiB, TiB alike
  --words-min/--words-max    caption length in words (column `text`)
  --range COLUMN=LO:HI       any other numeric column (an end may be left empty: `aes=5:`)
A row whose value is empty or not a number fails its range (images have no fps: `--fps-min` drops
them), unless `--keep-empty`. A range on a column the table lacks is an error.
`--remove-missing` drops rows whose file does not exist (relative paths resolve against the table
file's folder). The report counts, for each criterion in the order above, the
rows it removed (a row counts once, for the first criterion it fails; files are checked last).

The table streams (`--chunk-size` rows at a time); it may be a folder or glob of shards, written
out as one table. Relative paths are rewritten to resolve from the output's folder.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable

import numpy as np

from data_tools import stream
from jaxsora.errors import BadInput

PROG = "filter"
# (flag stem, column, what it is)
RANGES = (
    ("aes", "aes", "aesthetic score"),
    ("flow", "flow", "motion score"),
    ("ocr", "ocr", "OCR score"),
    ("match", "match", "text-match score"),
    ("frames", "num_frames", "frames"),
    ("height", "height", "height"),
    ("width", "width", "width"),
    ("fps", "fps", "fps"),
    ("size", "file_size", "file size"),
    ("words", "text", "caption words"),
)
# Size units, as GNU coreutils reads them (dd, head -c): kB/MB/… powers of 1000, K/M/… and KiB/MiB/…
# powers of 1024. Case does not matter.
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", 1):
    _UNITS.update({f"{_p}b": 1000 ** _i, _p: 1024 ** _i, f"{_p}ib": 1024 ** _i})


def parse_size(text: str) -> float:
    """'50MB' → 50e6 bytes, '50MiB' or '50M' → 50·2²⁰, '1.5 GB', '1200' (bytes). For argparse's `type=`."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text), re.IGNORECASE)
    unit = m.group(2).lower() if m else None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write a number with a unit, e.g. 50MB (10⁶ bytes "
                                         f"each), 50MiB (2²⁰ bytes each) or 52428800 (bytes)")
    return float(m.group(1)) * _UNITS[unit]


def format_size(n: float) -> str:
    """Bytes as people read them: 50000000 → '50MB', 52428800 → '52.43MB (50MiB)'."""
    decimal = next((f"{n / 1000 ** i:.4g}{u}" for i, u in reversed(list(enumerate(["B", "kB", "MB", "GB", "TB"])))
                    if n >= 1000 ** i), f"{n:g}B")
    for i, u in reversed(list(enumerate(["KiB", "MiB", "GiB", "TiB"], 1))):
        if n >= 1024 ** i and (n / 1024 ** i).is_integer():
            return f"{decimal} ({n / 1024 ** i:g}{u})"
    return decimal


@dataclasses.dataclass
class Criterion:
    name: str  # how the report names it
    column: str
    lo: float | None
    hi: float | None
    words: bool = False  # count the words of a text column instead of reading a number
    removed: int = 0
    show: Callable[[float], str] = "{:g}".format  # how describe() writes a bound

    def passes(self, df, keep_empty: bool = False) -> np.ndarray:
        if self.words:
            v = df[self.column].fillna("").astype(str).str.split().str.len().to_numpy(np.float64)
        else:
            v = stream.numeric(df, self.column)
        empty = np.isnan(v)
        ok = ~empty
        if self.lo is not None:
            ok &= v >= self.lo
        if self.hi is not None:
            ok &= v <= self.hi
        return ok | empty if keep_empty else ok

    def describe(self) -> str:
        lo = "-inf" if self.lo is None else self.show(self.lo)
        hi = "inf" if self.hi is None else self.show(self.hi)
        return f"{self.name} in [{lo}, {hi}]"


def _parse_range(spec: str) -> tuple[str, float | None, float | None]:
    column, sep, bounds = spec.rpartition("=")
    lo, colon, hi = bounds.partition(":")
    if not sep or not column or not colon:
        raise BadInput(f"--range {spec!r}: expected COLUMN=LO:HI (an end may be empty, e.g. aes=5:)")
    try:
        return column, (float(lo) if lo.strip() else None), (float(hi) if hi.strip() else None)
    except ValueError as e:
        raise BadInput(f"--range {spec!r}: {e}") from e


def criteria_from_args(args) -> list[Criterion]:
    out = []
    for stem, column, what in RANGES:
        lo, hi = getattr(args, f"{stem}_min"), getattr(args, f"{stem}_max")
        if lo is not None or hi is not None:
            out.append(Criterion(what, column, lo, hi, words=stem == "words",
                                 show=format_size if stem == "size" else "{:g}".format))
    for spec in args.range or []:
        column, lo, hi = _parse_range(spec)
        out.append(Criterion(column, column, lo, hi))
    for c in out:
        for end, v in (("min", c.lo), ("max", c.hi)):
            if v is not None and math.isnan(v):
                raise BadInput(f"{c.name}: the {end} is NaN")
        if c.lo is not None and c.hi is not None and c.lo > c.hi:
            raise BadInput(f"{c.describe()}: the min is above the max")
    return out


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="table: CSV/parquet file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="the kept rows (.csv or .parquet)")
    for stem, column, what in RANGES:
        kind = dict(type=parse_size, metavar="SIZE") if stem == "size" else dict(type=float, metavar="X")
        ap.add_argument(f"--{stem}-min", default=None, **kind, help=f"lowest {what} kept (column {column})")
        ap.add_argument(f"--{stem}-max", default=None, **kind,
                        help=f"highest {what} kept" + (" (50MB: 50·10⁶ B, 50MiB: 50·2²⁰ B)" if stem == "size" else ""))
    ap.add_argument("--range", action="append", metavar="COLUMN=LO:HI", help="a range on any numeric column")
    ap.add_argument("--keep-empty", action="store_true", help="a row with an empty value passes that range")
    ap.add_argument("--remove-missing", action="store_true", help="drop rows whose file does not exist")
    ap.add_argument("--num-workers", type=int, default=16, help="threads checking files (--remove-missing)")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _filter(args), argv)


def _filter(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    criteria = criteria_from_args(args)
    if not criteria and not args.remove_missing:
        raise BadInput("nothing to filter by: give a range (e.g. --aes-min 5) or --remove-missing")
    files = stream.input_files(args.input)
    for c in criteria:
        stream.require_columns(files, [c.column], f"{c.describe()}")
    if args.remove_missing:
        stream.require_columns(files, ["path"], "--remove-missing")
    missing = 0
    total = 0
    with stream.TableWriter(args.output, stream.union_columns(files), args.overwrite) as out:
        for chunk in stream.iter_chunks(files, args.chunk_size, desc=PROG, progress=not args.no_progress):
            df = chunk.df
            total += len(df)
            keep = np.ones(len(df), bool)
            for c in criteria:
                ok = c.passes(df, args.keep_empty)
                c.removed += int(np.count_nonzero(keep & ~ok))
                keep &= ok
            if args.remove_missing and keep.any():
                rows = np.nonzero(keep)[0]
                paths = stream.resolve_paths(df["path"].iloc[rows].tolist(), chunk.base)
                exists = np.array(stream.thread_map(os.path.isfile, paths, args.num_workers), bool)
                missing += int(np.count_nonzero(~exists))
                keep[rows[~exists]] = False
            out.write(chunk, keep)
    print(f"{total} rows read")
    for c in criteria:
        print(f"  {c.describe():<40} removed {c.removed}")
    if args.remove_missing:
        print(f"  {'file missing':<40} removed {missing}")
    print(f"{out.rows} rows kept → {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
