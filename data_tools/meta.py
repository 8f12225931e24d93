"""`python -m data_tools.meta --input X.csv --output Y.csv --num-workers N`: fill the metadata columns.

For each row's `path` (relative to the input table's folder, or absolute): num_frames, height,
width, aspect_ratio (= H/W), resolution (= H·W) and fps, read with PyAV (videos: frames counted
by decoding, as the reference's datautil does; images: PIL, 1 frame, fps NaN — an animated image
too, which the loader reads as its first frame). Height and width are as displayed: a clip whose
display matrix turns it a quarter turn (phone clips shot upright: PyAV's `VideoFrame.rotation`
±90) or a photo whose EXIF orientation does, has them swapped against the stored frames, as
`jaxsora.data.video.load_sample` turns its frames upright. Files that cannot be
read are listed in `<output>.unreadable.csv` (path and reason) and left out of the output — never
a crash. Parallel over processes, with a progress bar.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing
import os
import sys

import pandas as pd

from jaxsora.data.video import is_video, quarter_turns


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_tools.meta", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="table with at least `path` (and usually `text`)")
    ap.add_argument("--output", required=True)
    ap.add_argument("--num-workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    try:
        df = pd.read_parquet(args.input) if args.input.endswith(".parquet") else pd.read_csv(args.input)
    except Exception as e:
        print(f"cannot read table {args.input}: {e}", file=sys.stderr)
        return 2
    if "path" not in df.columns:
        print(f"table {args.input} has no 'path' column (columns: {list(df.columns)})", file=sys.stderr)
        return 2
    base = os.path.dirname(os.path.abspath(args.input))
    paths = [p if os.path.isabs(str(p)) else os.path.join(base, str(p)) for p in df["path"]]
    from tqdm.auto import tqdm

    if args.num_workers > 1:
        # spawn, not fork: this process has imported JAX, which is multithreaded (fork can deadlock).
        with cf.ProcessPoolExecutor(args.num_workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            results = list(tqdm(ex.map(probe, paths, chunksize=8), total=len(paths), desc="meta", unit="file"))
    else:
        results = [probe(p) for p in tqdm(paths, desc="meta", unit="file")]
    bad = [(df["path"][i], r["error"]) for i, r in enumerate(results) if "error" in r]
    ok = [i for i, r in enumerate(results) if "error" not in r]
    out = df.iloc[ok].copy()
    for col in ("num_frames", "height", "width", "fps"):
        out[col] = [results[i][col] for i in ok]
    out["aspect_ratio"] = out["height"] / out["width"]
    out["resolution"] = out["height"] * out["width"]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) or ".", exist_ok=True)
    if args.output.endswith(".parquet"):
        out.to_parquet(args.output, index=False)
    else:
        out.to_csv(args.output, index=False)
    sidecar = args.output + ".unreadable.csv"
    pd.DataFrame(bad, columns=["path", "reason"]).to_csv(sidecar, index=False)
    print(f"{len(out)} rows → {args.output}; {len(bad)} unreadable → {sidecar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
