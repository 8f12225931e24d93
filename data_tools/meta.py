"""`python -m data_tools.meta --input X.csv --output Y.csv [--num-workers N]`: fill the metadata columns.

For each row's `path` (relative to the table file's folder, or absolute): num_frames, height,
width, aspect_ratio (= H/W), resolution (= H·W) and fps, read with PyAV (videos: frames counted
by decoding, as the reference's datautil does; images: PIL, 1 frame, fps NaN — an animated image
too, which the loader reads as its first frame). Height and width are as displayed: a clip whose
display matrix turns it a quarter turn (phone clips shot upright: PyAV's `VideoFrame.rotation`
±90) or a photo whose EXIF orientation does, has them swapped against the stored frames, as
`jaxsora.data.video.load_sample` turns its frames upright. Files that cannot be
read are listed in `<output>.unreadable.csv` (path and reason) and left out of the output — never
a crash. Parallel over processes, with a progress bar.

The input may be a folder or glob of shards, written out as one table; it streams (`--chunk-size`
rows at a time). Relative paths are rewritten to resolve from the output's folder. An existing
output (or sidecar) is refused unless `--overwrite`.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import math
import multiprocessing
import os
import sys

import numpy as np
import pandas as pd

from data_tools import stream
from jaxsora.data.video import is_video, quarter_turns
from jaxsora.errors import BadInput

PROG = "meta"
PROBED = ("num_frames", "height", "width", "fps")
COLUMNS = PROBED + ("aspect_ratio", "resolution")  # the columns meta fills


def probe(path: str) -> dict:
    """{num_frames, height, width, fps} or {error}."""
    try:
        if not os.path.exists(path):
            return {"error": "missing file"}
        if os.path.getsize(path) == 0:
            return {"error": "zero-length file"}
        if is_video(path):
            import av

            with av.open(path) as c:
                s = c.streams.video[0]
                fps = float(s.average_rate) if s.average_rate else math.nan
                n, h, w, rotation = 0, s.codec_context.height, s.codec_context.width, 0.0
                for frame in c.decode(s):
                    if n == 0:
                        rotation = float(getattr(frame, "rotation", 0) or 0)
                    n += 1
            if n == 0:
                return {"error": "no decodable frame"}
            if quarter_turns(rotation) % 2:
                h, w = w, h
            return {"num_frames": n, "height": h, "width": w, "fps": fps}
        from PIL import Image

        with Image.open(path) as im:
            im.verify()  # must come right after open; the image is unusable afterwards
        with Image.open(path) as im:
            w, h = im.size
            # EXIF orientations 5-8 include a quarter turn (TIFF/EXIF 2.3, tag 0x0112)
            if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                h, w = w, h
        return {"num_frames": 1, "height": h, "width": w, "fps": math.nan}
    except Exception as e:  # corrupt / truncated / unsupported
        return {"error": f"{type(e).__name__}: {e}"}


def sidecar_path(output: str) -> str:
    """Where the unreadable files of `output` are listed."""
    return output + ".unreadable.csv"


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="table with at least `path` (and usually `text`): CSV/parquet "
                    "file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="the readable rows with their metadata (.csv or .parquet); "
                    "the others go to <output>.unreadable.csv")
    ap.add_argument("--num-workers", type=int, default=os.cpu_count() or 1,
                    help="processes probing files (default: the number of CPUs, %(default)s here)")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _meta(args), argv)


def _meta(args) -> int:
    stream.check_chunk_size(args.chunk_size)
    if args.num_workers < 1:
        raise BadInput(f"--num-workers must be ≥ 1, got {args.num_workers}")
    files = stream.input_files(args.input)
    stream.require_columns(files, ["path"], "meta (the files it probes)")
    sidecar = sidecar_path(args.output)
    for path in (args.output, sidecar):  # both refused before any work
        stream.check_output(path, args.overwrite)
    total = sum(stream.count_rows(files, args.chunk_size, progress=not args.no_progress))
    columns = stream.union_columns(files)
    columns += [c for c in COLUMNS if c not in columns]
    from tqdm.auto import tqdm

    with contextlib.ExitStack() as stack:
        out = stack.enter_context(stream.TableWriter(args.output, columns, args.overwrite))
        bad = stack.enter_context(stream.TableWriter(sidecar, ["path", "reason"], args.overwrite))
        if args.num_workers > 1:
            # spawn, not fork: this process has imported JAX, which is multithreaded (fork can deadlock).
            ex = stack.enter_context(cf.ProcessPoolExecutor(args.num_workers,
                                                            mp_context=multiprocessing.get_context("spawn")))
            probe_all = lambda paths: ex.map(probe, paths, chunksize=8)  # noqa: E731
        else:
            probe_all = lambda paths: map(probe, paths)  # noqa: E731
        bar = stack.enter_context(tqdm(total=total, desc=PROG, unit="file", file=sys.stderr,
                                       disable=args.no_progress, dynamic_ncols=True))
        for chunk in stream.iter_chunks(files, args.chunk_size, progress=False):
            results = []
            for r in probe_all(stream.resolve_paths(chunk.df["path"].tolist(), chunk.base)):
                results.append(r)
                bar.update(1)
            ok = np.array(["error" not in r for r in results], bool)
            df = chunk.df[ok].copy()
            for col in PROBED:
                df[col] = [r[col] for r in results if "error" not in r]
            df["aspect_ratio"] = df["height"] / df["width"]
            df["resolution"] = df["height"] * df["width"]
            out.write(dataclasses.replace(chunk, df=df))
            unreadable = pd.DataFrame({"path": chunk.df["path"][~ok].tolist(),
                                       "reason": [r["error"] for r in results if "error" in r]})
            bad.write(dataclasses.replace(chunk, df=unreadable))
    print(f"{out.rows} rows → {out.path}; {bad.rows} unreadable → {bad.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
