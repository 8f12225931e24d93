"""Loader speed on real-size video: one worker's decode of a bucket's samples beside the bare decoder
on the same frames, and what that means for a stage-1 step on 8 H100s. Prints tables.

    python bench/loader.py                                   # 720p and 1080p clips of 12 s → 240p × 51
    python bench/loader.py --res 720p,1080p --preset ultrafast,medium --rounds 3 --threads 1,2
    python bench/loader.py --step-seconds 2.5                # a measured step time instead of the estimate
    python bench/loader.py --data /path/meta.csv             # your own clips (their video rows)
    python bench/loader.py --workers 0,2                     # also the whole grain loader, N worker processes

Sources: h264 mp4 clips made on the spot with PyAV (a panned random texture, a keyframe every `--gop`
frames, `--fps`), for each libx264 `--preset`: `ultrafast` (P-frames only, CAVLC, no deblocking: the
cheapest h264 there is to decode) and `medium` (B-frames, CABAC, deblocking: how cameras, phones and
web video encode). Cached in `<tmp>/jaxsora-bench-clips/` for the next run (remove the folder to drop
them; the medium clips take minutes to make). Each sample is a random crop of `--bucket`'s frames
from one clip, as the loader draws it, turned into the bucket's (H, W) for the clip's aspect ratio.

Rows, timed side by side: in each of `--rounds` rounds every method decodes every sample, the
methods taking turns sample by sample (who goes first rotates), so a busy machine slows all alike:
  decoder alone   the reference: seek to the keyframe before the crop's first frame, decode forward
                  to its last, the frames as PyAV gives them (YUV); no RGB, no resize. FFmpeg's
                  default threading (one thread on single-slice clips such as these)
  + swscale       the same, plus the one swscale call per needed frame that load_sample makes
                  (bilinear, planar RGB at the cover size): the least an exact load_sample can cost
  load_sample     `jaxsora.data.video.load_sample` (seek, exact frame indices, non-reference frames
                  no crop needs dropped undecoded, scaled conversion into [3, T, H, W] uint8) with
                  `threads` decoder/swscale threads
  raw PyAV        the decoder alone plus `to_ndarray("rgb24")` of the crop's frames at full size
  before          an old load_sample: decode from the start of the file, full-size RGB, PIL resize
A worker process runs `load_sample` one sample after another: its rate is the one-thread row.

Columns: clips/s from each sample's fastest round, in wall time and in CPU time (the process's
user + system seconds: what a core gives when it is not shared), and the rate ÷ the decoder alone's:
the median of the rounds' ratios and their range, wall and CPU. The ratios are the figures to
compare across machines and hours; the rates move with the load.

The step: per-device batch from Open-Sora 1.2's stage-1 bucket config × 8 GPUs = clips one host
needs per step. The step time is `--step-seconds`, or the model FLOPs of STDiT3-XL/2 at the bucket's
latent shape (`jaxsora.train.plan.mfu`, forward + backward) at `--mfu` (45%) of an H100's 989 TFLOP/s
bf16 (VAE and T5 not counted: a real step is longer, so this errs toward more workers). Workers
decode while the step runs, so a host keeps up with W = ceil(clips per step / (rate × step))
workers, one core each (the CPU-time rate: a core of its own); with fewer, a step waits
max(0, clips / (W · rate) − step) for data, and "data wait" is that share of the step's wall time.
"""
from __future__ import annotations

import argparse
import atexit
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

RESOLUTIONS = {"144p": (144, 256), "240p": (240, 426), "360p": (360, 640), "480p": (480, 854),
               "720p": (720, 1280), "1080p": (1080, 1920)}
H100_BF16 = 989e12
GPUS_PER_HOST = 8


# ---- sources --------------------------------------------------------------------------------------

def _texture(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random picture with fine grain, [h, w, 3] uint8 (compresses like footage, not noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(small).resize(((w // 16 + 2) * 16, (h // 16 + 2) * 16), Image.BICUBIC))
    grain = rng.integers(-5, 6, big.shape, dtype=np.int16)
    return np.clip(big.astype(np.int16) + grain, 0, 255).astype(np.uint8)[:h, :w]


def make_clip(path: str, h: int, w: int, seconds: float, fps: int, gop: int, preset: str, seed: int) -> str:
    """An h264 mp4 of a texture panning across the frame, `seconds` long (written once, then reused)."""
    import av

    if os.path.exists(path):
        return path
    n = int(round(seconds * fps))
    tex = _texture(h + n, w + 2 * n, seed)
    tmp = path + ".part.mp4"
    with av.open(tmp, "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": preset, "crf": "23", "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0"}
        for i in range(n):
            frame = np.ascontiguousarray(tex[i:i + h, 2 * i:2 * i + w])
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    os.replace(tmp, path)
    return path


def make_sources(res: str, preset: str, args) -> list[dict]:
    h, w = RESOLUTIONS[res]
    folder = os.path.join(tempfile.gettempdir(), "jaxsora-bench-clips")
    os.makedirs(folder, exist_ok=True)
    out = []
    for i in range(args.clips):
        name = f"{res}-{args.seconds:g}s-{args.fps}fps-gop{args.gop}-{preset}-{i}.mp4"
        t0 = time.perf_counter()
        fresh = not os.path.exists(os.path.join(folder, name))
        path = make_clip(os.path.join(folder, name), h, w, args.seconds, args.fps, args.gop, preset, seed=i)
        if fresh:
            print(f"  made {path} ({os.path.getsize(path) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr)
        out.append(dict(path=path, num_frames=int(round(args.seconds * args.fps)), height=h, width=w))
    return out


def table_sources(data: str) -> list[dict]:
    from jaxsora.data.tables import read_table
    from jaxsora.data.video import is_video

    table = data if data.endswith((".csv", ".parquet")) else os.path.join(data, "meta.csv")
    df = read_table(table)
    df = df[np.array([is_video(p) for p in df["path"]], bool) & (df["num_frames"] > 1).to_numpy()]
    return [dict(path=r.path, num_frames=int(r.num_frames), height=int(r.height), width=int(r.width))
            for r in df.itertuples()][:64]


# ---- the decoders timed ---------------------------------------------------------------------------

def raw_pyav(path: str, idx: np.ndarray, rgb: bool = True, scale_to: tuple[int, int] | None = None) -> list:
    """The ceiling: seek to the keyframe before frame idx[0], decode forward to idx[-1], rgb24 arrays of
    the crop's frames (frame index from the timestamp; the generated clips are constant-rate). rgb=False:
    the decoder alone (the frames as PyAV gives them, YUV); scale_to=(h, w) with it: plus load_sample's
    one swscale call per needed frame (bilinear, planar RGB at the cover size of (h, w)), kept nowhere."""
    import av
    from av.video.reformatter import Interpolation, VideoReformatter

    from jaxsora.data.video import cover_size

    wanted, last, out = set(idx.tolist()), int(idx.max()), []
    reformatter = VideoReformatter()
    with av.open(path) as c:
        s = c.streams.video[0]
        step = 1 / (s.average_rate * s.time_base)
        start = s.start_time or 0
        first = int(idx.min())
        if first:
            c.seek(start + round(first * step), stream=s, backward=True)
        for f in c.decode(s):
            i = round((f.pts - start) / step)
            if i in wanted:
                if rgb:
                    out.append(f.to_ndarray(format="rgb24", threads=1))
                elif scale_to:
                    nh, nw, _, _ = cover_size(f.height, f.width, *scale_to)
                    reformatter.reformat(f, nw, nh, "gbrp", interpolation=Interpolation.BILINEAR, threads=1)
            if i >= last:
                break
    return out


def before(path: str, idx: np.ndarray, h: int, w: int) -> np.ndarray:
    """The previous load_sample: decode from the start up to the crop's last frame, full-size rgb24 of
    the crop's frames, upright, PIL bilinear resize-to-cover and center crop."""
    import av

    from jaxsora.data.video import channels_first, resize_crop, upright

    wanted, last, got, rotation = set(idx.tolist()), int(idx.max()), {}, 0.0
    with av.open(path) as c:
        for n, f in enumerate(c.decode(c.streams.video[0])):
            if n == 0:
                rotation = float(getattr(f, "rotation", 0) or 0)
            if n in wanted:
                got[n] = f.to_ndarray(format="rgb24")
            if n >= last:
                break
    return channels_first(resize_crop(upright(np.stack([got[i] for i in idx]), rotation), h, w))


def bucket_size(res: str, height: int, width: int) -> tuple[int, int]:
    from jaxsora.data.aspect import closest_ratio_key, resolution_tables

    table = resolution_tables()[res][1]
    return table[closest_ratio_key(height, width, table)]


def time_methods(sources: list[dict], args, t: int) -> tuple[dict, tuple[int, int]]:
    """{method: (wall seconds, CPU seconds)}, each [rounds, samples]: every round times every method on
    every sample, the methods taking turns sample by sample (the first one rotating)."""
    from jaxsora.data.video import load_sample, temporal_indices

    threads = [int(x) for x in args.threads.split(",") if x]
    methods = {DECODER: "decode", "+ swscale, nothing else": "scale"}
    methods.update({f"load_sample, {n} thread{'s' if n > 1 else ''}": n for n in threads})
    methods["raw PyAV: + full-size rgb24"] = "rgb"
    if not args.skip_before:
        methods["before: from the start + PIL"] = "before"
    names = list(methods)
    wall = {m: np.zeros((args.rounds, args.samples)) for m in names}
    cpu = {m: np.zeros((args.rounds, args.samples)) for m in names}
    hw = None
    for r in range(args.rounds):
        for k in range(args.samples):
            src = sources[k % len(sources)]
            h, w = bucket_size(args.res_bucket, src["height"], src["width"])
            hw = (h, w)
            idx = temporal_indices(src["num_frames"], t, args.frame_interval, np.random.default_rng([k]))
            turn = (k + r) % len(names)
            for m in names[turn:] + names[:turn]:
                how = methods[m]
                t0, c0 = time.perf_counter(), time.process_time()
                if how == "decode":
                    raw_pyav(src["path"], idx, rgb=False)
                elif how == "scale":
                    raw_pyav(src["path"], idx, rgb=False, scale_to=(h, w))
                elif how == "rgb":
                    raw_pyav(src["path"], idx)
                elif how == "before":
                    before(src["path"], idx, h, w)
                else:
                    load_sample(src["path"], t, h, w, frame_interval=args.frame_interval,
                                rng=np.random.default_rng([k]), num_frames_hint=src["num_frames"], threads=how)
                wall[m][r, k] = time.perf_counter() - t0
                cpu[m][r, k] = time.process_time() - c0
    return {m: (wall[m], cpu[m]) for m in names}, hw


def ratio(seconds: np.ndarray, reference: np.ndarray) -> tuple[float, float, float]:
    """A method's rate ÷ the reference's, per round (total seconds over the round's samples): (median,
    lowest, highest)."""
    per_round = reference.sum(axis=1) / seconds.sum(axis=1)
    return float(np.median(per_round)), float(per_round.min()), float(per_round.max())


def best_rate(seconds: np.ndarray) -> float:
    """Clips/s from each sample's fastest round."""
    return seconds.shape[1] / float(seconds.min(axis=0).sum())


DECODER = "decoder alone: seek + decode, no RGB"


# ---- the step -------------------------------------------------------------------------------------

def stage1_batch(res: str, t: int) -> int:
    from configs.base import STAGE1_BUCKETS

    entry = STAGE1_BUCKETS.get(res, {}).get(t)
    if entry is None:
        raise SystemExit(f"bucket {res} × {t} frames is not in the stage-1 bucket config")
    return int(entry[1])


def step_seconds(args, t: int, hw: tuple[int, int], per_device: int) -> tuple[float, str]:
    if args.step_seconds:
        return float(args.step_seconds), "given (--step-seconds)"
    from jaxsora.models.presets import get_model_config
    from jaxsora.models.vae import latent_frames
    from jaxsora.train.plan.mfu import train_flops_per_sample

    cfg = get_model_config("STDiT3-XL/2")
    latent = (latent_frames(t), hw[0] // 8, hw[1] // 8)
    flops = train_flops_per_sample(cfg, latent)
    s = per_device * flops / (args.mfu * H100_BF16)
    return s, (f"STDiT3-XL/2 at latent {latent[0]}×{latent[1]}×{latent[2]}: {flops / 1e12:.1f} TFLOP per clip "
               f"(fwd+bwd) × {per_device} per GPU at {args.mfu:.0%} MFU of 989 TFLOP/s")


def data_wait(clips: int, workers: int, rate: float, step: float) -> float:
    load = clips / (workers * rate)
    wait = max(0.0, load - step)
    return wait / (step + wait)


# ---- the grain loader -----------------------------------------------------------------------------

def grain_rows(sources: list[dict], args, t: int) -> list[tuple[str, float]]:
    """The whole loader (plan, grain workers, shared memory) over a table of the sources."""
    import pandas as pd

    from jaxsora.data.loader import VideoLoader

    d = tempfile.mkdtemp(prefix="jaxsora-bench-table-")
    atexit.register(shutil.rmtree, d, True)
    rows = [dict(path=s["path"], text=f"clip {i}", num_frames=s["num_frames"], height=s["height"], width=s["width"],
                 aspect_ratio=s["height"] / s["width"], resolution=s["height"] * s["width"], fps=float(args.fps))
            for i, s in enumerate(sources * max(1, 32 // len(sources)))]
    pd.DataFrame(rows).to_csv(os.path.join(d, "meta.csv"), index=False)
    buckets = {args.res_bucket: {t: (1.0, args.loader_batch)}}
    out = []
    for w in [int(x) for x in args.workers.split(",") if x]:
        loader = VideoLoader(os.path.join(d, "meta.csv"), buckets, seed=0, data_parallel_size=1, num_workers=w,
                             frame_interval=args.frame_interval, progress=False)
        it = iter(loader)
        for _ in range(1 + loader.prefetch * max(1, w)):  # start-up, and the batches buffered meanwhile
            next(it)
        t0, n = time.perf_counter(), 0
        for _ in range(args.batches):
            n += next(it)["video"].shape[0]
        dt = time.perf_counter() - t0
        it.close()
        out.append((f"VideoLoader, {w} worker processes (whole host)", n / dt))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", default="720p,1080p", help="generated source sizes ({})".format(",".join(RESOLUTIONS)))
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--gop", type=int, default=60, help="frames between keyframes (60: 2 s at 30 fps)")
    ap.add_argument("--preset", default="ultrafast,medium", help="libx264 presets of the generated clips")
    ap.add_argument("--clips", type=int, default=3, help="clips per source size")
    ap.add_argument("--data", default=None, help="a table (or its folder): time its video rows instead")
    ap.add_argument("--bucket", default="240p:51", help="RES:FRAMES of the stage-1 bucket config")
    ap.add_argument("--frame-interval", type=int, default=1)
    ap.add_argument("--samples", type=int, default=12, help="crops timed per source, method and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds: every method on every crop, in turns")
    ap.add_argument("--threads", default="1,2", help="load_sample decoder/swscale threads to time")
    ap.add_argument("--skip-before", action="store_true", help="do not time the previous load_sample")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="the step time (default: estimated)")
    ap.add_argument("--mfu", type=float, default=0.45)
    ap.add_argument("--host-workers", default="8,16,32,64", help="worker counts for the data-wait column")
    ap.add_argument("--workers", default="", help="also time the grain VideoLoader with these worker counts")
    ap.add_argument("--loader-batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4, help="batches timed per --workers count")
    args = ap.parse_args(argv)
    args.res_bucket, t = args.bucket.split(":")[0], int(args.bucket.split(":")[1])
    presets = [x for x in args.preset.split(",") if x]
    groups = {"data": table_sources(args.data)} if args.data else {
        f"{r} {p}": make_sources(r, p, args) for r in args.res.split(",") if r for p in presets}
    per_device = stage1_batch(args.res_bucket, t)
    clips_per_step = per_device * GPUS_PER_HOST
    host_workers = [int(x) for x in args.host_workers.split(",") if x]
    from jaxsora.data.loader import host_cores

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {host_cores()} cores for this process, load average {load:.1f} at the start "
          "(other processes slow every row alike; compare ratios, not absolute rates)")
    summary = []
    for name, sources in groups.items():
        seconds, hw = time_methods(sources, args, t)
        s0 = sources[0]
        what = (f"{s0['width']}×{s0['height']} h264, {args.fps} fps, {args.seconds:g} s, GOP {args.gop}"
                if name != "data" else f"{len(sources)} clips of {args.data}")
        print(f"\n{name} sources ({what}) → {args.res_bucket} × {t} frames ({hw[0]}×{hw[1]}), "
              f"frame interval {args.frame_interval}; {args.samples} crops × {args.rounds} rounds, one process")
        print(f"{'':<46} {'clips/s':>8} {'frames/s':>9} {'CPU clips/s':>12}   "
              f"{'÷ decoder alone (rounds)':>25} {'CPU: ÷ decoder (rounds)':>24}")
        ref_wall, ref_cpu = seconds[DECODER]
        for m, (wall, cpu) in seconds.items():
            r, rc = best_rate(wall), best_rate(cpu)
            (a, lo, hi), (ac, loc, hic) = ratio(wall, ref_wall), ratio(cpu, ref_cpu)
            print(f"{m:<46} {r:>8.2f} {r * t:>9.0f} {rc:>12.2f}   {a:>9.2f} ({lo:.2f}–{hi:.2f})"
                  f"{'':>4} {ac:>10.2f} ({loc:.2f}–{hic:.2f})")
        if args.workers:
            for label, r in grain_rows(sources, args, t):
                print(f"{label:<46} {r:>8.2f} {r * t:>9.0f}")
        one = "load_sample, 1 thread" if "load_sample, 1 thread" in seconds else next(
            m for m in seconds if m.startswith("load_sample"))
        summary.append((name, one, best_rate(seconds[one][0]), best_rate(seconds[one][1]),
                        ratio(seconds[one][0], ref_wall), ratio(seconds[one][1], ref_cpu)))
    print(f"\n{'source':<16} {'load_sample ÷ decoder alone: wall, CPU (median of rounds, range)':<66}")
    for name, one, _, _, (a, lo, hi), (ac, loc, hic) in summary:
        print(f"{name:<16} {a:.2f} ({lo:.2f}–{hi:.2f}), {ac:.2f} ({loc:.2f}–{hic:.2f})   [{one}]")
    step, how = step_seconds(args, t, hw, per_device)
    print(f"\nstage-1 step at {args.res_bucket} × {t}: {per_device} clips per GPU × {GPUS_PER_HOST} H100 = "
          f"{clips_per_step} clips per host per step; step {step:.2f} s ({how})")
    cols = " ".join(f"{f'{w} workers':>11}" for w in host_workers)
    print(f"{'source':<16} {'clips/s/worker':>15} {'workers (cores) to feed 8 H100s':>32}   data wait with: {cols}")
    print(f"{'':<16} {'wall, CPU':>15} {'= ceil(clips / (CPU rate × step))':>32}")
    for name, _, rate, rate_cpu, _, _ in summary:
        need = math.ceil(clips_per_step / (rate_cpu * step))
        waits = " ".join(f"{data_wait(clips_per_step, w, rate_cpu, step):>11.0%}" for w in host_workers)
        print(f"{name:<16} {f'{rate:.2f}, {rate_cpu:.2f}':>15} {need:>32d}   {'':>15} {waits}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/
    sys.exit(main())
