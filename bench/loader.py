"""Loader throughput beside the raw PyAV decode rate of the same files (the ceiling), as a table.

    python bench/loader.py [--data DIR_or_CSV] [--workers 0,2,4] [--batches 20]

Without --data it writes a synthetic 240p set (426×240, 60-frame clips) first. The loader runs the
240p × 51-frame bucket (batch 4 per device, one device): decode + resize/crop to 240×426 (uint8; the
[-1, 1] mapping happens in the train step). "workers" are grain worker processes (0: decoding in
the main process); timing starts after one warm-up batch, so the pool's start-up is not counted.
It leaves nothing behind: the synthetic set and the table index are removed at exit, and the
loader unlinks the shared memory its batches arrive in (see `jaxsora.data.loader`).
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time


def raw_decode_rate(paths, max_files=8) -> float:
    """Frames/s of a plain single-process PyAV decode of whole files."""
    import av

    frames, t0 = 0, time.perf_counter()
    for p in paths[:max_files]:
        with av.open(p) as c:
            for f in c.decode(video=0):
                f.to_ndarray(format="rgb24")
                frames += 1
    return frames / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--batches", type=int, default=12)
    args = ap.parse_args(argv)
    from data_tools.synthetic import generate
    from jaxsora.data.loader import VideoLoader

    if args.data is None:
        d = tempfile.mkdtemp(prefix="jaxsora-bench-")
        atexit.register(shutil.rmtree, d, True)  # the synthetic set goes with the run
        generate(d, num_videos=16, num_images=0, sizes=[(240, 426)], frames=[60], fps=24, seed=0)
        table = os.path.join(d, "meta.csv")
    else:
        table = args.data if args.data.endswith((".csv", ".parquet")) else os.path.join(args.data, "meta.csv")
    buckets = {"240p": {51: (1.0, 4)}}
    loader0 = VideoLoader(table, buckets, seed=0, data_parallel_size=1, progress=False)
    paths = [p for p in loader0.table.paths() if p.endswith(".mp4")]
    ceiling = raw_decode_rate(paths)
    print(f"\n{'setup':<34} {'samples/s':>10} {'frames/s':>10} {'vs raw decode':>14}")
    print(f"{'raw PyAV decode, 1 process':<34} {'-':>10} {ceiling:>10.0f} {'1.00':>14}")
    for w in [int(x) for x in args.workers.split(",")]:
        loader = VideoLoader(table, buckets, seed=0, data_parallel_size=1, num_workers=w, progress=False)
        it = iter(loader)
        next(it)  # warm-up
        t0 = time.perf_counter()
        n = 0
        for _ in range(args.batches):
            b = next(it)
            n += b["video"].shape[0]
        dt = time.perf_counter() - t0
        it.close()  # stops the worker processes
        fps = n * 51 / dt
        print(f"{f'loader, {w} worker processes':<34} {n / dt:>10.2f} {fps:>10.0f} {fps / ceiling:>14.2f}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
