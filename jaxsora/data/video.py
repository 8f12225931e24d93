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

A file that cannot give what its bucket needs raises `DecodeError` with a `reason` (the loader
skips the row, counts it under that reason and draws a replacement; see `loader.py`):

- ``missing``: no file at the path; ``unreadable``: zero-length, truncated, corrupt, unsupported.
- ``too_short``: a video with fewer than the T·frame_interval frames a T-frame bucket needs (T = 1:
  one frame). N, the count the crop is drawn from, is the container's frame count (the table's
  when the container has none); a clip whose stream then ends before the crop's last frame is
  measured (N := frames it decoded) and cropped again, or skipped if too short. Frames are never
  repeated to fill a crop (the reference asserts the same).
- ``image_in_video_bucket``: an image file (one frame) in a bucket of T > 1 frames — its table row
  claims more frames than it has.
- ``animated_image``: an image file with several frames (animated GIF/WebP/APNG) in a T > 1
  bucket. Such files are not decoded as videos: their frame timing is per frame, not a rate. In an
  image bucket (T = 1), which is where `data_tools.meta` puts them (it records images as 1 frame),
  the first frame is the image.

Display orientation: phone clips store sensor-oriented frames plus a display matrix (mp4 `tkhd`,
read by FFmpeg as DISPLAYMATRIX side data, exposed by PyAV ≥ 13 as `VideoFrame.rotation`, degrees
counter-clockwise); photos carry an EXIF orientation. Samples are turned upright as a viewer shows
them, so a table's height/width (from `data_tools.meta`, which records the displayed size) and the
decoded frames agree. Display matrices with a mirror part are applied as their rotation only.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

from jaxsora.errors import UserError

VIDEO_EXTS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
# Open-Sora 1.2: IMG_FPS = 120 for images.
IMG_FPS = 120.0


class DecodeError(UserError, RuntimeError):
    """A sample that cannot be made; `reason` names why (see the module docstring)."""

    def __init__(self, message: str, reason: str = "unreadable"):
        super().__init__(message)
        self.reason = reason


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


def frames_needed(t: int, frame_interval: int) -> int:
    """The fewest frames a clip must have to fill a T-frame crop without repeating one."""
    return t * frame_interval if t > 1 else 1


def quarter_turns(rotation: float) -> int:
    """A display rotation in degrees counter-clockwise (`VideoFrame.rotation`) → k for
    `np.rot90(frame, k)` (which turns counter-clockwise too), in 0..3."""
    return int(round(rotation / 90.0)) % 4


def upright(frames: np.ndarray, rotation: float) -> np.ndarray:
    """[T, h, w, C] as stored → [T, h', w', C] as displayed (h', w' swapped for a quarter turn)."""
    k = quarter_turns(rotation)
    return np.ascontiguousarray(np.rot90(frames, k, axes=(1, 2))) if k else frames


def _load_image(path: str, t: int, h: int, w: int) -> tuple[np.ndarray, float]:
    from PIL import ImageOps

    try:
        with Image.open(path) as im:
            n = int(getattr(im, "n_frames", 1))
            if t == 1:  # the first frame of an animated image; EXIF orientation applied
                arr = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    except Exception as e:
        raise DecodeError(f"cannot read image {path}: {e}") from e
    if t > 1:
        if n > 1:
            raise DecodeError(f"{path}: an animated image ({n} frames) in a {t}-frame bucket", "animated_image")
        raise DecodeError(f"{path}: an image in a {t}-frame bucket (its table row claims more frames)",
                          "image_in_video_bucket")
    return channels_first(resize_crop(arr[None], h, w, Image.BICUBIC)), IMG_FPS


def _decode_frames(container, wanted: set, last: int) -> tuple[dict, int, float]:
    """Decode an open container forward from its start up to frame `last` → ({index: [h, w, 3]
    uint8} for the indices in `wanted`, frames decoded, rotation in degrees counter-clockwise)."""
    got, n, rotation = {}, 0, 0.0
    for frame in container.decode(container.streams.video[0]):
        if n == 0:
            rotation = float(getattr(frame, "rotation", 0) or 0)
        if n in wanted:
            got[n] = frame.to_ndarray(format="rgb24")
        n += 1
        if n > last:
            break
    return got, n, rotation


def load_sample(path: str, t: int, h: int, w: int, *, frame_interval: int, rng: np.random.Generator,
                num_frames_hint: int | None = None) -> tuple[np.ndarray, float]:
    """→ (video [3, T, H, W] uint8, fps). Raises DecodeError (with a `reason`) for a file that
    cannot give T frames of (H, W)."""
    if not os.path.exists(path):
        raise DecodeError(f"missing file: {path}", "missing")
    if os.path.getsize(path) == 0:
        raise DecodeError(f"zero-length file: {path}")
    if not is_video(path):
        return _load_image(path, t, h, w)
    import av

    need = frames_needed(t, frame_interval)
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 24.0
            total = stream.frames or num_frames_hint or 0
            if total <= 0:
                raise DecodeError(f"no frame count for {path}")
            for attempt in range(2):  # the declared count, then (if the stream ends early) the measured one
                if total < need:
                    raise DecodeError(f"{path}: {total} frames; a {t}-frame crop at interval {frame_interval} "
                                      f"needs {need}", "too_short")
                idx = temporal_indices(total, t, frame_interval, rng)
                wanted = set(idx.tolist())
                if attempt == 0:
                    got, decoded, rotation = _decode_frames(container, wanted, int(idx.max()))
                else:  # rare (the container or table overstates the length): decode again from the start
                    with av.open(path) as again:
                        got, decoded, rotation = _decode_frames(again, wanted, int(idx.max()))
                if len(got) == len(wanted):
                    break
                total = decoded  # the stream ended before the crop's last frame: its real length
            else:
                raise DecodeError(f"{path}: only {len(got)} of the {len(wanted)} needed frames decode")
    except DecodeError:
        raise
    except Exception as e:  # av errors: corrupt, truncated, unsupported
        raise DecodeError(f"cannot decode {path}: {e}") from e
    frames = upright(np.stack([got[i] for i in idx]), rotation)
    # fps fed to the model: video fps // frame_interval (a float floor, as the reference)
    return channels_first(resize_crop(frames, h, w)), float(fps // frame_interval)


def write_mp4(frames: np.ndarray, path: str, fps: float, crf: int = 18, display_rotation: float = 0.0) -> str:
    """Write [T, H, W, 3] uint8 as h264 mp4 with PyAV (odd sizes are edge-padded to even, as yuv420p
    needs). display_rotation: degrees counter-clockwise a player turns the frames by (the container's
    display matrix, as a phone writes it; −90 for a phone held upright). Returns the path."""
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
        if display_rotation:
            stream.set_display_rotation(display_rotation)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
