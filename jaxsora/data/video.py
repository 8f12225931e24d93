"""Decoding one sample with PyAV / PIL into the bucket's shape (Open-Sora 1.2's
`VariableVideoTextDataset.getitem`).

Videos: one container per sample, opened and closed in a `with` block (containers left to the
garbage collector froze the reference's training). Temporal crop: span = T·frame_interval, begin
drawn from [0, max(0, N − span − 1)], indices linspace(begin, end−1, T), where frame i is the i-th
frame a decode from the start puts out (display order). Then resize-to-cover (bilinear) and center
crop to (H, W). Images: resize-to-cover (bicubic), 1 frame, fps 120.

Samples leave the loader as uint8 [3, T, H, W] (a quarter of the float32 bytes through worker
shared memory, host RAM and the host→device copy); `to_model_range` — x / 127.5 − 1, the
reference's Normalize(0.5, 0.5) — maps them to [-1, 1], on the host here or inside the jitted
train step (`jaxsora.train.step.train_step`), with the same float32 result.

Only the frames a crop needs are decoded. For a constant-rate stream whose timing says so (a start
time, an average rate equal to the stream's rate, duration × rate = the frame count N) the decode
seeks to the keyframe at or before the crop's first frame, decodes forward and stops after its last
frame; each decoded frame's index comes from its timestamp, (pts − start) / frame duration. The
decode goes back to one from the start of the file, for the same crop, as soon as the timestamps
disagree with that: a timestamp off the frame grid, a frame missing or repeated. A seek that lands
after the crop's first frame (an open GOP: the keyframe's leading B-frames are dropped after a
seek) is tried once more 16 frames earlier (the most an H.264/HEVC decoder reorders), then from
the start. Variable-rate clips (many phones) and containers without that timing always decode from
the start, as before. Decoder threads: `threads` (FFmpeg's frame/slice threading, the same frames).
After a seek the decoder is let drop the non-reference frames (FFmpeg's skip_frame NONREF, packet by
packet from its timestamp) that no crop frame needs: before the crop's first frame, between its
frames at intervals > 1, after its last. No frame is predicted from those, so the frames decoded are
the same; the checks above still see them (a gap only dropped frames fill is no gap). With B-frames
(as cameras, phones and web video encode) that is about half the frames before a crop (x264's defaults).

Each needed frame is converted and scaled in one swscale call (YUV → planar RGB at the cover size,
bilinear) and center-cropped straight into the output: no full-size RGB frame is made (at 1080p →
144p–360p, 3–7× cheaper than full-size RGB + PIL, and no page faults on a fresh 6 MB array per
frame). A frame already at the cover size gets PyAV's rgb24 conversion, as before. The scaled
frames equal the full-size path (`to_ndarray("rgb24")` + `resize_crop`, which images still use)
within the spread of swscale's own YUV→RGB converters, measured on 720p/1080p h264 → 144p–720p:
mean |Δ| ≈ 2.3 levels (of 255), 99% within 9, max ≈ 20, of which ≈ 1.1 is a uniform offset — the
full-size converter `to_ndarray` uses comes out ≈ 1.1 levels darker than the frames that were
encoded, the scaled one within 0.05 of them; the same full-size frames converted with swscale's
`ACCURATE_RND` flag differ from `to_ndarray`'s by mean 2.0, max 16, too. The resampling filters
themselves agree (swscale vs PIL bilinear on one RGB frame: mean 0.2, max 3–6); the rest is how
each converter treats 4:2:0 chroma, so it grows with colour detail at the pixel scale.
`tests/data/test_video.py` holds the bound (mean ≤ 3, offset ≤ 1.5, 99% within 12).

Paths: a local path, or an fsspec URL (``s3://``, ``gs://``, ``memory://``, …), opened through fsspec
and read by PyAV/PIL from the file object; ``file://`` URLs are local paths.

A file that cannot give what its bucket needs raises `DecodeError` with a `reason` (the loader
skips the row, counts it under that reason and draws a replacement; see `loader.py`):

- ``missing``: no file at the path; ``unreadable``: zero-length, truncated, corrupt, unsupported
  (or a file system that refused to open it).
- ``too_short``: a video with fewer than the T·frame_interval frames a T-frame bucket needs (T = 1:
  one frame). N, the count the crop is drawn from, is the container's frame count (the table's
  when the container has none); a clip whose stream then ends before the crop's last frame is
  measured (N := frames it has) and cropped again, or skipped if too short. Frames are never
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

import contextlib
import os
from fractions import Fraction

import numpy as np
from PIL import Image

from jaxsora.errors import UserError

VIDEO_EXTS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
# Open-Sora 1.2: IMG_FPS = 120 for images.
IMG_FPS = 120.0
# The most frames an H.264/HEVC decoder holds back for reordering (the DPB): a seek this far before
# the first needed frame lands on a keyframe that is displayed no later than it.
MAX_REORDER = 16
# How far (in frames) a timestamp may sit from the frame grid and still name a frame (container
# time bases round: Matroska stores milliseconds).
GRID_TOLERANCE = 0.25


class DecodeError(UserError, RuntimeError):
    """A sample that cannot be made; `reason` names why (see the module docstring)."""

    def __init__(self, message: str, reason: str = "unreadable"):
        super().__init__(message)
        self.reason = reason


def is_video(path: str) -> bool:
    return str(path).lower().endswith(VIDEO_EXTS)


def is_url(path: str) -> bool:
    """Whether `path` is an fsspec URL (``protocol://…``, or a chain ``a::b://…``)."""
    return "://" in str(path)


def local_path(path: str) -> str | None:
    """The local file `path` names: itself, or a ``file://`` URL's path; None for other URLs."""
    path = str(path)
    if not is_url(path):
        return path
    if path.startswith("file://"):
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem._strip_protocol(path)
    return None


@contextlib.contextmanager
def open_source(path: str):
    """What PyAV and PIL open for `path`: the local path itself (the fast path), or for a URL an
    open binary fsspec file object (closed on exit). Raises DecodeError ``missing`` (no file there)
    or ``unreadable`` (zero-length, or the file system refused), and UserError (not skipped: it
    would fail every row) when the protocol's fsspec package (s3fs, gcsfs, …) is not installed."""
    local = local_path(path)
    if local is not None:
        if not os.path.exists(local):
            raise DecodeError(f"missing file: {path}", "missing")
        if os.path.getsize(local) == 0:
            raise DecodeError(f"zero-length file: {path}")
        yield local
        return
    import fsspec

    try:
        f = fsspec.open(path, "rb").open()
    except FileNotFoundError:
        raise DecodeError(f"missing file: {path}", "missing") from None
    except ImportError as e:  # a known protocol whose fsspec package is not installed: a setup error
        raise UserError(f"cannot open {path}: {e}") from None
    except Exception as e:  # bad URL, unknown protocol, credentials, network
        raise DecodeError(f"cannot open {path}: {type(e).__name__}: {e}") from e
    try:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            raise DecodeError(f"zero-length file: {path}")
        f.seek(0)
        yield f
    finally:
        f.close()


def temporal_indices(num_frames_total: int, t: int, frame_interval: int, rng: np.random.Generator) -> np.ndarray:
    span = t * frame_interval
    begin = int(rng.integers(0, max(0, num_frames_total - span - 1) + 1))
    end = min(begin + span, num_frames_total)
    return np.linspace(begin, end - 1, t).astype(int)


def resize_crop(frames: np.ndarray, h: int, w: int, resample=Image.BILINEAR) -> np.ndarray:
    """[T, h0, w0, 3] uint8 → [T, h, w, 3] uint8: scale to cover, then center crop."""
    h0, w0 = frames.shape[1:3]
    nh, nw, top, left = cover_size(h0, w0, h, w)
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


def cover_size(h0: int, w0: int, h: int, w: int) -> tuple[int, int, int, int]:
    """A (h0, w0) picture scaled to cover (h, w) → (scaled height, scaled width, crop top, crop
    left): the geometry `resize_crop` uses."""
    scale = max(h / h0, w / w0)
    nh, nw = max(h, round(h0 * scale)), max(w, round(w0 * scale))
    return nh, nw, int(round((nh - h) / 2.0)), int(round((nw - w) / 2.0))


def _load_image(src, path: str, t: int, h: int, w: int) -> tuple[np.ndarray, float]:
    from PIL import ImageOps

    try:
        with Image.open(src) as im:
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


class _FrameClock:
    """Frame index ↔ timestamp of a constant-rate stream: frame i at start + i·step (pts units)."""

    def __init__(self, start: int, step: Fraction):
        self.start, self.step = int(start), step
        self._num, self._den = step.numerator, step.denominator  # integer arithmetic per frame

    @classmethod
    def of(cls, container, stream, total: int) -> _FrameClock | None:
        """The clock of `stream` when its timing says it is constant-rate with `total` frames from
        its start time (average rate = the stream's rate, duration × rate = total); else None (the
        decode then starts at the beginning)."""
        rate, tb, start = stream.average_rate, stream.time_base, stream.start_time
        if not rate or not tb or start is None or total <= 0:
            return None
        guessed = stream.guessed_rate
        if guessed and Fraction(guessed) != Fraction(rate):
            return None
        if stream.duration:
            duration = stream.duration * Fraction(tb)
        elif container.duration:
            duration = Fraction(container.duration, 1_000_000)
        else:
            return None
        if abs(duration * Fraction(rate) - total) > Fraction(1, 2):
            return None
        step = 1 / (Fraction(rate) * Fraction(tb))
        return cls(start, step) if step >= 1 else None

    def pts(self, index: int) -> int:
        return self.start + round(index * self.step)

    def index(self, pts) -> int | None:
        """The frame a timestamp names, or None when it is off the frame grid."""
        if pts is None:
            return None
        x = (int(pts) - self.start) * self._den  # the frame index × step's numerator
        i = (2 * x + self._num) // (2 * self._num)  # round(x / num)
        return i if i >= 0 and abs(x - i * self._num) <= GRID_TOLERANCE * self._num else None


class _CoverCrop:
    """Decoded frames → RGB scaled to cover (H, W), turned upright, center-cropped, written into
    `out` [3, T, H, W]. Set up from the first frame it gets (size and display rotation).

    Scaled: one swscale call to planar RGB (gbrp) at the cover size. Already at the cover size:
    PyAV's rgb24 conversion (`to_ndarray`'s, so such frames equal the full-size path's exactly;
    swscale's unscaled YUV→gbrp converter gives garbage at some small widths)."""

    _GBRP_TO_RGB = ((0, 2), (1, 0), (2, 1))  # (output channel, gbrp plane): planes are G, B, R

    def __init__(self, out: np.ndarray, threads: int):
        self.out, self.threads = out, threads
        self.ready = False

    def _setup(self, frame) -> None:
        from av.video.reformatter import Interpolation, VideoReformatter

        _, _, h, w = self.out.shape
        self.k = quarter_turns(float(getattr(frame, "rotation", 0) or 0))
        sh, sw = frame.height, frame.width
        dh, dw = (sw, sh) if self.k % 2 else (sh, sw)  # as displayed
        nh, nw, self.top, self.left = cover_size(dh, dw, h, w)
        self.scaled = (nw, nh) if self.k % 2 else (nh, nw)  # (height, width) of the stored frame, scaled
        self.native = self.scaled == (sh, sw)
        self.reformatter, self.interpolation = VideoReformatter(), Interpolation.BILINEAR
        self.ready = True

    def _upright_crop(self, a: np.ndarray) -> np.ndarray:
        _, _, h, w = self.out.shape
        if self.k:
            a = np.rot90(a, self.k)
        return a[self.top:self.top + h, self.left:self.left + w]

    def __call__(self, frame, slots) -> None:
        if not self.ready:
            self._setup(frame)
        if self.native:
            rgb = self._upright_crop(self.reformatter.reformat(frame, format="rgb24", threads=self.threads)
                                     .to_ndarray())
            for s in slots:
                self.out[:, s] = np.moveaxis(rgb, 2, 0)
            return
        planar = self.reformatter.reformat(frame, self.scaled[1], self.scaled[0], "gbrp",
                                           interpolation=self.interpolation, threads=self.threads)
        planes = planar.planes  # a tuple built on each access
        for c, p in self._GBRP_TO_RGB:
            plane = planes[p]
            a = np.frombuffer(plane, np.uint8, plane.height * plane.line_size).reshape(plane.height, -1)
            a = self._upright_crop(a[:, :plane.width])
            for s in slots:
                self.out[c, s] = a


def _open_video(src, threads: int):
    """A fresh PyAV container on `src` (a path or a file object, read from its start), its video
    stream decoding with `threads` threads."""
    import av

    if not isinstance(src, str):
        src.seek(0)
    container = av.open(src)
    try:
        stream = container.streams.video[0]
        if threads > 1:
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = int(threads)
    except BaseException:
        container.close()
        raise
    return container


# A decode pass's outcome: every needed frame put; the stream ended first; the seek landed after the
# first needed frame; the timestamps disagree with the frame clock.
_DONE, _ENDED, _LATE, _OFF_CLOCK = "done", "ended", "late", "off_clock"


class _Dropped:
    """The frames a seek pass let the decoder drop: the indices their packets' timestamps name, and
    whether one of them could not be a frame a full decode puts out next (repeated, or behind a
    frame already out): the timestamps then do not count frames."""

    def __init__(self):
        self.indices: set = set()
        self.off_clock = False

    def add(self, i: int, prev: int) -> None:
        self.off_clock |= i in self.indices or i <= prev
        self.indices.add(i)

    def bridge(self, prev: int, i: int) -> bool:
        """Whether frame i may come out right after frame prev: the next one, or the next after
        dropped ones."""
        return i == prev + 1 or (i > prev + 1 and self.indices.issuperset(range(prev + 1, i)))

    def end(self, prev: int) -> int:
        """The frames a full decode would have put out when the stream ends after frame prev: prev
        + 1, plus the dropped frames right after it (-1 when they skip one: off the clock)."""
        after = sorted(i for i in self.indices if i > prev)
        return prev + 1 + len(after) if after == list(range(prev + 1, prev + 1 + len(after))) else -1


def _decode_dropping(container, stream, clock: _FrameClock, slots: dict, dropped: _Dropped, out: list):
    """The frames of a decode from the container's position, the decoder told to drop the
    non-reference frames (FFmpeg's skip_frame NONREF) of each packet whose timestamp names a frame
    no slot needs: before the crop's first frame, between its frames at intervals > 1, after its
    last. No frame is predicted from a dropped one, so every frame decoded is the same as in a full
    decode. Packets are demuxed before the frames they hold come out, so `dropped` knows a packet
    before any frame after it is checked; out[0] is the index of the last frame out."""
    ctx = stream.codec_context
    try:
        for packet in container.demux(stream):
            i = clock.index(packet.pts)
            drop = i is not None and i not in slots
            ctx.skip_frame = "NONREF" if drop else "DEFAULT"
            if drop:
                dropped.add(i, out[0])
            yield from packet.decode()
    finally:
        ctx.skip_frame = "DEFAULT"


def _decode_pass(container, slots: dict, first: int, last: int, put, clock: _FrameClock | None,
                 seek_to: int) -> tuple[str, int]:
    """Decode the container's video from its start (seek_to = 0: frame index = frames decoded so far)
    or from a seek to the keyframe before frame `seek_to` (index from the timestamp, by `clock`;
    non-reference frames no slot needs are dropped undecoded), calling put(frame, slots[i]) for
    each needed frame i, until frame `last`.
    → (outcome, frames in the stream when it ended early: the measured length)."""
    stream = container.streams.video[0]
    prev = [-1]  # the index of the last frame out (a list: the dropping decode reads it)
    if seek_to > 0:
        container.seek(clock.pts(seek_to), stream=stream, backward=True, any_frame=False)
        dropped = _Dropped()
        frames = _decode_dropping(container, stream, clock, slots, dropped, prev)
    else:
        frames = container.decode(stream)
    try:
        for frame in frames:
            if seek_to > 0:
                i = clock.index(frame.pts)
                if i is None or dropped.off_clock or (prev[0] >= 0 and not dropped.bridge(prev[0], i)):
                    return _OFF_CLOCK, 0
                if prev[0] < 0 and i > first:
                    return _LATE, 0
            else:
                i = prev[0] + 1
            prev[0] = i
            if i in slots:
                put(frame, slots[i])
            if i >= last:
                return _DONE, i + 1
    finally:
        if seek_to > 0:
            frames.close()  # the decoder's skip_frame back to DEFAULT
    if seek_to > 0:
        length = dropped.end(prev[0]) if not dropped.off_clock else -1
        return (_ENDED, length) if length >= 0 else (_OFF_CLOCK, 0)
    return _ENDED, prev[0] + 1


def _decode_crop(src, container, idx: np.ndarray, clock: _FrameClock | None, put, threads: int) -> tuple[bool, int]:
    """Decode the frames `idx` of a video (the open `container` first, fresh ones after) → (all
    decoded, the stream's measured length when it ended before the last one)."""
    slots: dict = {}
    for s, i in enumerate(idx.tolist()):
        slots.setdefault(int(i), []).append(s)
    first, last = min(slots), max(slots)
    plan = []  # where each pass starts: a seek to `first`, one MAX_REORDER earlier, then the start
    if clock is not None:
        plan += [s for s in (first, max(0, first - MAX_REORDER)) if s > 0 and s not in plan]
    plan.append(0)
    for seek_to in plan:
        with contextlib.ExitStack() as stack:
            c = container if container is not None else stack.enter_context(_open_video(src, threads))
            container = None  # the one given is used once, by the first pass (its owner closes it)
            outcome, length = _decode_pass(c, slots, first, last, put, clock, seek_to)
        if outcome == _DONE:
            return True, length
        if outcome == _ENDED and (seek_to == 0 or length > 0):
            return False, length
    raise AssertionError("unreachable: the pass from the start ends done or ended")


def _load_video(src, path: str, t: int, h: int, w: int, frame_interval: int, rng: np.random.Generator,
                num_frames_hint: int | None, threads: int) -> tuple[np.ndarray, float]:
    need = frames_needed(t, frame_interval)
    out = np.empty((3, t, h, w), np.uint8)
    put = _CoverCrop(out, threads)
    try:
        with _open_video(src, threads) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 24.0
            total = stream.frames or num_frames_hint or 0
            if total <= 0:
                raise DecodeError(f"no frame count for {path}")
            clock = _FrameClock.of(container, stream, total)
            for attempt in range(2):  # the declared count, then (if the stream ends early) the measured one
                if total < need:
                    raise DecodeError(f"{path}: {total} frames; a {t}-frame crop at interval {frame_interval} "
                                      f"needs {need}", "too_short")
                idx = temporal_indices(total, t, frame_interval, rng)
                # rare second attempt (the container or table overstates the length): fresh containers
                complete, measured = _decode_crop(src, container if attempt == 0 else None, idx, clock, put, threads)
                if complete:
                    break
                total, clock = measured, None  # the stream ended before the crop's last frame: its real length
            else:
                raise DecodeError(f"{path}: the stream ends after {total} frames, before the crop's last frame")
    except DecodeError:
        raise
    except Exception as e:  # av errors: corrupt, truncated, unsupported
        raise DecodeError(f"cannot decode {path}: {e}") from e
    # fps fed to the model: video fps // frame_interval (a float floor, as the reference)
    return out, float(fps // frame_interval)


def load_sample(path: str, t: int, h: int, w: int, *, frame_interval: int, rng: np.random.Generator,
                num_frames_hint: int | None = None, threads: int = 1) -> tuple[np.ndarray, float]:
    """→ (video [3, T, H, W] uint8, fps). Raises DecodeError (with a `reason`) for a file that
    cannot give T frames of (H, W). `path`: local, or an fsspec URL. threads: decoder (and
    swscale) threads for this sample — 1 where worker processes already use every core."""
    threads = max(1, int(threads))
    with open_source(path) as src:
        if not is_video(path):
            return _load_image(src, path, t, h, w)
        return _load_video(src, path, t, h, w, frame_interval, rng, num_frames_hint, threads)


def write_mp4(frames: np.ndarray, path: str, fps: float, crf: int = 18, display_rotation: float = 0.0) -> str:
    """Write [T, H, W, 3] uint8 as h264 mp4 with PyAV (odd sizes are edge-padded to even, as yuv420p
    needs). display_rotation: degrees counter-clockwise a player turns the frames by (the container's
    display matrix, as a phone writes it; −90 for a phone held upright). Returns the path.

    x264's macroblock-tree rate control is off (`mbtree=0`): with it, the same frames gave up to 13
    different files in 60 writes here (the last frames' pixels off by up to 11 levels; more often
    with jax imported, at any thread count), so a sampler's seed would not give the same file.
    Without it every write is the same, for slightly larger files at the same crf."""
    import av

    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    ph, pw = frames.shape[1] % 2, frames.shape[2] % 2
    if ph or pw:
        frames = np.pad(frames, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "x264-params": "mbtree=0"}
        if display_rotation:
            stream.set_display_rotation(display_rotation)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
