"""Decoding one sample with PyAV / PIL into the bucket's shape (spec §4.2).

Videos: one container per sample, opened and closed in a `with` block (containers left to the
garbage collector froze the reference's training); frames are decoded forward only up to the last
one needed (no full decode). Temporal crop: span = T·frame_interval, begin drawn from
[0, max(0, N − span − 1)], indices linspace(begin, end−1, T). Then resize-to-cover (bilinear)
and center crop to (H, W). Images: resize-to-cover (bicubic), 1 frame, fps 120.

Samples leave the loader as uint8 [3, T, H, W] (a quarter of the float32 bytes through worker
shared memory, host RAM and the host→device copy); `to_model_range` — x / 127.5 − 1, the
reference's Normalize(0.5, 0.5) — maps them to [-1, 1], on the host here or inside the jitted
train step (`jaxsora.train.step`), with the same float32 result.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

VIDEO_EXTS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
# Open-Sora 1.2: IMG_FPS = 120 for images.
IMG_FPS = 120.0


class DecodeError(RuntimeError):
    pass


def is_video(path: str) -> bool:
    return path.lower().endswith(VIDEO_EXTS)


def temporal_indices(num_frames_total: int, t: int, frame_interval: int, rng: np.random.Generator) -> np.ndarray:
    span = t * frame_interval
    begin = int(rng.integers(0, max(0, num_frames_total - span - 1) + 1))
    end = min(begin + span, num_frames_total)
    return np.linspace(begin, end - 1, t).astype(int)


def resize_crop(frames: np.ndarray, h: int, w: int, resample=Image.BILINEAR) -> np.ndarray:
    """[T, h0, w0, 3] uint8 → [T, h, w, 3] uint8: scale to cover, then center crop."""
    h0, w0 = frames.shape[1:3]
    scale = max(h / h0, w / w0)
    nh, nw = max(h, round(h0 * scale)), max(w, round(w0 * scale))
    top, left = int(round((nh - h) / 2.0)), int(round((nw - w) / 2.0))
    if (nh, nw) == (h0, w0):  # already covering at this size: PIL's resize would return a copy
        return np.ascontiguousarray(frames[:, top:top + h, left:left + w])
    out = np.empty((frames.shape[0], h, w, 3), np.uint8)
    for i, f in enumerate(frames):
        img = Image.fromarray(f).resize((nw, nh), resample)
        out[i] = np.asarray(img)[top:top + h, left:left + w]
    return out


def to_model_range(video):
    """uint8 video (any layout, numpy or jax) → float32 in [-1, 1] (Normalize(0.5, 0.5))."""
    return video.astype(np.float32) / 127.5 - 1.0


def channels_first(frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] → [3, T, H, W] (contiguous)."""
    return np.ascontiguousarray(np.transpose(frames, (3, 0, 1, 2)))


def load_sample(path: str, t: int, h: int, w: int, *, frame_interval: int, rng: np.random.Generator,
                num_frames_hint: int | None = None) -> tuple[np.ndarray, float]:
    """→ (video [3, T, H, W] uint8, fps). Raises DecodeError for anything unreadable."""
    if not os.path.exists(path):
        raise DecodeError(f"missing file: {path}")
    if os.path.getsize(path) == 0:
        raise DecodeError(f"zero-length file: {path}")
    if not is_video(path):
        try:
            with Image.open(path) as im:
                arr = np.asarray(im.convert("RGB"))
        except Exception as e:
            raise DecodeError(f"cannot read image {path}: {e}") from e
        return channels_first(resize_crop(arr[None], h, w, Image.BICUBIC)), IMG_FPS
    import av

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 24.0
            total = stream.frames or num_frames_hint or 0
            if total <= 0:
                raise DecodeError(f"no frame count for {path}")
            idx = temporal_indices(total, t, frame_interval, rng)
            wanted = set(idx.tolist())
            last = int(idx.max())
            got = {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    got[i] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
    except DecodeError:
        raise
    except Exception as e:  # av errors: corrupt, truncated, unsupported
        raise DecodeError(f"cannot decode {path}: {e}") from e
    if len(got) < len(wanted):
        raise DecodeError(f"{path}: only {len(got)} of the {len(wanted)} needed frames decode (truncated?)")
    frames = np.stack([got[i] for i in idx])
    # fps fed to the model: video fps // frame_interval (a float floor, as the reference)
    return channels_first(resize_crop(frames, h, w)), float(fps // frame_interval)


def write_mp4(frames: np.ndarray, path: str, fps: float, crf: int = 18) -> str:
    """Write [T, H, W, 3] uint8 as h264 mp4 with PyAV (odd sizes are edge-padded to even, as yuv420p
    needs). Returns the path."""
    import av

    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    ph, pw = frames.shape[1] % 2, frames.shape[2] % 2
    if ph or pw:
        frames = np.pad(frames, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
