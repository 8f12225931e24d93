"""`python -m data_tools.meta --input X.csv --output Y.csv [--root DIR] [--num-workers N]`: fill the
metadata columns.

The input: our table (`path`, `text`, any other columns), or a dataset's table as it is downloaded:
OpenVid-1M's `OpenVid-1M.csv` or MiraData's `miradata_v1_330k.csv` (`data_tools.layouts` lists their
columns). `--layout` (default: recognised by its columns) names which; their columns become ours:
the clip's file → `path`, resolved under `--root` (the folder the clips were unpacked into; default:
the table's folder), the caption → `text` (`--caption`: another caption column; MiraData's default
is `dense_caption`), their scores → `aes` and `flow`. Their other columns are kept. Rows with an
empty caption are left out (counted, and listed with the unreadable files).

For each row's `path` (relative to `--root` or the table's folder, absolute, or an fsspec URL, opened
as the loader opens it): num_frames, height, width, aspect_ratio (= H/W), resolution (= H·W), fps
and file_size (bytes), read with PyAV (videos: frames counted by decoding, as the reference's
datautil does; images: PIL, 1 frame, fps NaN — an animated image too, which the loader reads as its
first frame). Height and width are as displayed: a clip whose display matrix turns it a quarter turn
(phone clips shot upright: PyAV's `VideoFrame.rotation` ±90) or a photo whose EXIF orientation does,
has them swapped against the stored frames, as `jaxsora.data.video.load_sample` turns its frames
upright. Files that cannot be read are listed in `<output>.unreadable.csv` (path and reason) and left
out of the output — never a crash. Each file is read in a worker process (one per core), with a time
limit (`--time-limit`): a read that hangs (a hung network mount) is cut off and listed as stalled.

Many hosts: `--shard K/N` (or `auto`) reads part K of N, as `data_tools.check` does (see there).

The input may be a folder or glob of shards, written out as one table; it streams (`--chunk-size`
rows at a time). Relative paths are rewritten to resolve from the output's folder. An existing
output (or sidecar) is refused unless `--overwrite`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import numpy as np
import pandas as pd

from data_tools import layouts, stream
from data_tools.reading import probe  # noqa: F401  (meta.probe: what the workers run)
from data_tools.workers import Workers
from jaxsora.errors import BadInput

PROG = "meta"
PROBED = ("num_frames", "height", "width", "fps", "file_size")
COLUMNS = PROBED + ("aspect_ratio", "resolution")  # the columns meta fills
DEFAULT_TIME_LIMIT = 600.0  # seconds for one file: a 2-minute 1080p clip decodes in about a minute on a core


def sidecar_path(output: str) -> str:
    """Where the unreadable files of `output` are listed."""
    return output + ".unreadable.csv"


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="our table (path, text), or OpenVid-1M's or MiraData's as "
                    "downloaded: CSV/parquet file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="the readable rows with their metadata (.csv or .parquet); "
                    "the others go to <output>.unreadable.csv")
    ap.add_argument("--layout", choices=["auto", *layouts.LAYOUTS], default="auto",
                    help="the input's columns: ours, OpenVid-1M's or MiraData's (auto: recognised by its columns)")
    ap.add_argument("--root", metavar="DIR", default=None,
                    help="the folder the clips were unpacked into: relative paths resolve against it (default: "
                    "the table's folder)")
    ap.add_argument("--caption", metavar="COLUMN", default=None,
                    help="the column that becomes `text` (default: the layout's: text, caption, dense_caption)")
    stream.add_reading_flags(ap, "read")
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, metavar="SECONDS",
                    help="the longest one file may take; a file that takes longer is listed as stalled")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _meta(args), argv)


def _meta(args) -> int:
    files, shard, output = stream.reading_tool_setup(args)
    in_columns = stream.union_columns(files)
    layout, renames = layouts.resolve(args.layout, in_columns, args.caption)
    root = None
    if args.root is not None:
        if not os.path.isdir(args.root):
            raise BadInput(f"--root {args.root}: no such folder")
        root = args.root if os.path.isabs(args.root) else os.path.abspath(args.root)
    sidecar = sidecar_path(output)
    for path in (output, sidecar):  # both refused before any work
        stream.check_output(path, args.overwrite)
    first, end, rows = stream.shard_rows(files, shard, args.chunk_size, progress=not args.no_progress)
    if args.shard:
        print(f"{args.input} part {shard[0]}/{shard[1]}: rows {first}–{end - 1} of {rows}")
    columns = [renames.get(c, c) for c in in_columns]
    columns += [c for c in COLUMNS if c not in columns]
    from tqdm.auto import tqdm

    if layout is not layouts.JAXSORA:
        named = ", ".join(f"{k} → {v}" for k, v in renames.items())
        print(f"{args.input}: {layout.title}'s layout ({named})")
    empty_captions = 0
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(stream.TableWriter(output, columns, args.overwrite))
        bad = stack.enter_context(stream.TableWriter(sidecar, ["path", "reason"], args.overwrite))
        workers = stack.enter_context(Workers("data_tools.reading:probe", args.num_workers))
        bar = stack.enter_context(tqdm(total=end - first, desc=PROG, unit="file", file=sys.stderr,
                                       disable=args.no_progress, dynamic_ncols=True))
        for chunk in stream.iter_chunks(files, args.chunk_size, progress=False):
            lo, hi = max(first, chunk.start), min(end, chunk.start + len(chunk.df))
            if lo >= hi:
                continue
            if (lo, hi) != (chunk.start, chunk.start + len(chunk.df)):  # the part's rows of this chunk
                chunk = dataclasses.replace(chunk, df=chunk.df.iloc[lo - chunk.start:hi - chunk.start])
            df = _rooted(chunk.df.rename(columns=renames), args.root, root, chunk.base)
            text = df["text"].fillna("").astype(str).str.strip()
            captioned = (text != "").to_numpy()
            empty_captions += int(np.count_nonzero(~captioned))
            paths = stream.resolve_paths(df["path"].tolist(), chunk.base)
            results: list = [{"error": "empty caption"} if not c else None for c in captioned]
            tasks = ((i, (p,), args.time_limit) for i, (p, c) in enumerate(zip(paths, captioned)) if c)
            bar.update(len(df) - int(np.count_nonzero(captioned)))
            for i, r in workers.run(tasks):
                results[i] = r if isinstance(r, dict) else {"error": str(r)}  # stalled / crashed
                bar.update(1)
            ok = np.array(["error" not in r for r in results], bool)
            kept = df[ok].copy()
            for col in PROBED:
                kept[col] = [r[col] for r in results if "error" not in r]
            kept["aspect_ratio"] = kept["height"] / kept["width"]
            kept["resolution"] = kept["height"] * kept["width"]
            out.write(dataclasses.replace(chunk, df=kept))
            left_out = pd.DataFrame({"path": df["path"][~ok].tolist(),
                                     "reason": [r["error"] for r in results if "error" in r]})
            bad.write(dataclasses.replace(chunk, df=left_out))
    unreadable = bad.rows - empty_captions
    print(f"{out.rows} rows → {out.path}; {unreadable} unreadable, {empty_captions} with an empty caption → {bad.path}")
    return 0


def _rooted(df: pd.DataFrame, root_arg: str | None, root: str | None, base: str) -> pd.DataFrame:
    """`df` with its relative paths (not URLs) rooted at `root` instead of the table's folder `base`:
    absolute when --root was given absolute, else relative to `base` (the writer re-roots those at
    the output's folder)."""
    if root is None:
        return df
    df = df.copy()
    relative_root = not os.path.isabs(root_arg)

    def rooted(p):
        if stream.is_missing(p) or os.path.isabs(str(p)) or "://" in str(p):
            return p
        full = os.path.normpath(os.path.join(root, str(p)))
        return os.path.relpath(full, base) if relative_root else full

    df["path"] = [rooted(p) for p in df["path"]]
    return df


if __name__ == "__main__":
    sys.exit(main())
