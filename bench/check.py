"""How fast `data_tools.meta` and `data_tools.check` read real-size clips, per core, and what the tutorial's
data (OpenVid-1M and MiraData 330k) costs on a cluster at those rates. Prints tables.

    python bench/check.py                                   # 720p and 1080p clips of 5 s at 30 fps, 3 rounds
    python bench/check.py --res 1080p --rounds 5
    python bench/check.py --nodes 24 --cores-per-node 96    # the cluster the estimate is for

Sources: H.264 mp4 made on the spot with PyAV and cached in `<tmp>/jaxsora-bench-clips/`: a texture
panning across the frame with fresh grain in every frame (so the bitrate is a camera's, not a
screen recording's), libx264 preset `veryfast` (CABAC, B-frames, as downloaded clips have), `--crf`,
a keyframe every 2 s. The bitrate they come out at is printed: OpenVid-1M's 7.9 TB over 1M clips and
MiraData's 29 TB over 330k (the tutorial's figures) are about 8-10 Mbit/s for clips of 7-70 s.

Rows, timed in turns clip by clip, each one process with one decoder thread, as every worker of
`meta` and `check` is (they run one worker per core). The rate is frames per CPU second of this
process (`time.process_time`): what a core does when it is the process's own, which on a shared
machine the wall clock does not show (other processes take turns on the same cores):
  decode   PyAV's decode of every frame and nothing else: what `ffmpeg -v error -i CLIP -f null -`,
           the tutorial's check, costs (the same libavcodec decoder)
  meta     `data_tools.reading.probe`: open, count the frames by decoding them, size
  check    `data_tools.reading.check_clip`: the container's frame count, then the loader's
           `load_sample` of every frame (decode, swscale to 16×16), FFmpeg's log captured

The estimate: frames in all = OpenVid-1M's clips × `--openvid-frames` (its file names hold each
clip's frame range: a few hundred frames) + MiraData's clips × its 72 s mean duration (its README) ×
30 fps, at the per-core rate of `--res`'s clips (the 720p and 1080p rows bound it: the tutorial lists
MiraData at 720p and 1080p, OpenVid at various sizes, 433k of its clips 1080p), spread over
`--nodes` × `--cores-per-node` workers.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from loader import RESOLUTIONS, _texture  # noqa: E402  (bench/loader.py's picture)

OPENVID_CLIPS, MIRADATA_CLIPS = 1_000_000, 330_000  # the datasets as named: OpenVid-1M, MiraData 330k
MIRADATA_SECONDS, MIRADATA_FPS = 72.0, 30.0  # MiraData's mean clip duration (its README); most clips are 30 fps


def make_clip(path: str, h: int, w: int, seconds: float, fps: int, crf: int, grain: int, seed: int) -> str:
    """A panning texture with per-frame grain as H.264 (written once, then reused)."""
    import av

    if os.path.exists(path):
        return path
    n = int(round(seconds * fps))
    tex = _texture(h + n, w + 2 * n, seed)
    rng = np.random.default_rng(seed)
    tmp = path + ".part.mp4"
    with av.open(tmp, "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": "veryfast", "crf": str(crf), "g": str(2 * fps)}
        for i in range(n):
            frame = tex[i:i + h, 2 * i:2 * i + w].astype(np.int16) + rng.integers(-grain, grain + 1, (h, w, 1),
                                                                                 dtype=np.int16)
            frame = np.ascontiguousarray(np.clip(frame, 0, 255).astype(np.uint8))
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    os.replace(tmp, path)
    return path


def decode_only(path: str, n: int) -> int:
    import av

    k = 0
    with av.open(path) as c:
        s = c.streams.video[0]
        s.codec_context.thread_count = 1
        for _ in c.decode(s):
            k += 1
    return k


def meta_probe(path: str, n: int) -> int:
    from data_tools.reading import probe

    r = probe(path)
    assert "error" not in r, r
    return r["num_frames"]


def check_clip(path: str, n: int) -> int:
    from data_tools.reading import check_clip

    reason = check_clip(path, n)
    assert reason == "", reason
    return n


METHODS = {"decode": decode_only, "meta": meta_probe, "check": check_clip}


def measure(clips: list[tuple[str, int]], rounds: int) -> dict:
    """method → [frames per CPU second of each round]."""
    rates = {m: [] for m in METHODS}
    names = list(METHODS)
    for r in range(rounds):
        frames, seconds = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
        for i, (path, n) in enumerate(clips):
            order = names[(r + i) % len(names):] + names[:(r + i) % len(names)]  # turns: no method always first
            for m in order:
                t0 = time.process_time()
                frames[m] += METHODS[m](path, n)
                seconds[m] += time.process_time() - t0
        for m in names:
            rates[m].append(frames[m] / seconds[m])
    return rates


def span(values) -> str:
    return f"{min(values):.0f}–{max(values):.0f}" if len(values) > 1 else f"{values[0]:.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", default="720p,1080p", help="source sizes (%(default)s)")
    ap.add_argument("--seconds", type=float, default=5.0, help="clip length (%(default)s)")
    ap.add_argument("--fps", type=int, default=30, help="clip frame rate (%(default)s)")
    ap.add_argument("--clips", type=int, default=2, help="clips per size (%(default)s)")
    ap.add_argument("--crf", type=int, default=18, help="x264 quality; with --grain it sets the bitrate (%(default)s)")
    ap.add_argument("--grain", type=int, default=5, help="per-frame grain amplitude, levels (%(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (%(default)s)")
    ap.add_argument("--nodes", type=int, default=24, help="the estimate's nodes (the tutorial's 24)")
    ap.add_argument("--cores-per-node", type=int, default=96, help="the estimate's cores per node (%(default)s)")
    ap.add_argument("--openvid-frames", type=float, default=240.0,
                    help="mean frames of an OpenVid-1M clip, for the estimate (%(default)s)")
    args = ap.parse_args(argv)
    folder = os.path.join(tempfile.gettempdir(), "jaxsora-bench-clips")
    os.makedirs(folder, exist_ok=True)
    results = {}
    for res in args.res.split(","):
        h, w = RESOLUTIONS[res]
        clips = []
        for i in range(args.clips):
            name = f"grain{args.grain}-crf{args.crf}-{res}-{args.seconds:g}s-{args.fps}fps-{i}.mp4"
            path = os.path.join(folder, name)
            fresh = not os.path.exists(path)
            t0 = time.perf_counter()
            make_clip(path, h, w, args.seconds, args.fps, args.crf, args.grain, seed=i)
            if fresh:
                print(f"  made {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            clips.append((path, int(round(args.seconds * args.fps))))
        mbit = np.mean([os.path.getsize(p) * 8 / args.seconds / 1e6 for p, _ in clips])
        measure(clips[:1], 1)  # warm: imports, page cache
        results[res] = (measure(clips, args.rounds), mbit)

    print(f"\nper core (frames per CPU second, {args.rounds} rounds: min–max), {args.clips} clips of "
          f"{args.seconds:g} s at {args.fps} fps per size")
    print(f"{'source':<22}" + "".join(f"{m:>14}" for m in METHODS) + f"{'check ÷ decode':>16}")
    for res, (rates, mbit) in results.items():
        ratio = [c / d for c, d in zip(rates["check"], rates["decode"])]
        print(f"{res + f' ({mbit:.1f} Mbit/s)':<22}" + "".join(f"{span(rates[m]):>14}" for m in METHODS)
              + f"{min(ratio):>10.2f}–{max(ratio):.2f}")

    frames = OPENVID_CLIPS * args.openvid_frames + MIRADATA_CLIPS * MIRADATA_SECONDS * MIRADATA_FPS
    cores = args.nodes * args.cores_per_node
    print(f"\nOpenVid-1M ({OPENVID_CLIPS:,} clips × {args.openvid_frames:g} frames) + MiraData 330k "
          f"({MIRADATA_CLIPS:,} × {MIRADATA_SECONDS:g} s × {MIRADATA_FPS:g} fps) = {frames / 1e6:,.0f}M frames, "
          f"on {args.nodes} nodes × {args.cores_per_node} cores (one worker per core), hours:")
    print(f"{'at the rate of':<22}" + "".join(f"{m:>14}" for m in METHODS))
    for res, (rates, _) in results.items():
        hours = {m: [frames / (r * cores) / 3600 for r in rates[m]] for m in METHODS}
        print(f"{res:<22}" + "".join(f"{min(hours[m]):>8.1f}–{max(hours[m]):<5.1f}" for m in METHODS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
