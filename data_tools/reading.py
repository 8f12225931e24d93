"""What the data tools' worker processes run on one file (`data_tools.workers`): `probe` for
`data_tools.meta`, `check_clip` for `data_tools.check`. Only what reading needs is imported here,
so a worker starts in a fraction of a second.

`check_clip` decodes every frame of a clip with `jaxsora.data.video.load_sample`, the loader's own
reading path (opening, FFmpeg's decoder, the frame conversion), as one crop of all the clip's frames
(the container's count, or the table's `num_frames` where that is larger) at a small size, one
decoder thread, FFmpeg's log captured. The clip passes when that decode ends with all its frames and
FFmpeg logged no error (the tutorial's `ffmpeg -v error` rule). A clip that fails is decoded once
more, packet by packet, to name what went wrong (the reasons: `data_tools.check`).
"""
from __future__ import annotations

import math
import os
import re

import av
import av.logging
import numpy as np

from jaxsora.data.video import DecodeError, is_video, load_sample, open_source, quarter_turns

# The size check_clip converts frames to: the loader's conversion runs (scale to cover, crop) at the
# least cost; its swscale pass reads every source pixel whatever the output size.
CHECK_SIZE = 16


def probe(path: str) -> dict:
    """{num_frames, height, width, fps, file_size} or {error}."""
    try:
        with open_source(path) as src:
            size = os.path.getsize(src) if isinstance(src, str) else src.seek(0, os.SEEK_END)
            if is_video(path):
                if not isinstance(src, str):
                    src.seek(0)
                with av.open(src) as c:
                    s = c.streams.video[0]
                    fps = float(s.average_rate) if s.average_rate else math.nan
                    n, h, w, rotation = 0, s.codec_context.height, s.codec_context.width, 0.0
                    try:
                        for frame in c.decode(s):
                            if n == 0:
                                rotation = float(getattr(frame, "rotation", 0) or 0)
                            n += 1
                    except av.FFmpegError as e:  # name it as check does (truncated, decoder error at frame k)
                        listed = int(s.frames or 0)
                        try:
                            named = _diagnose(path, 0, listed)
                        except Exception:
                            named = None
                        return {"error": named or f"decoder error at frame {n}: {_av(e)}"}
                if n == 0:
                    return {"error": "no decodable frame"}
                if quarter_turns(rotation) % 2:
                    h, w = w, h
                return {"num_frames": n, "height": h, "width": w, "fps": fps, "file_size": size}
            from PIL import Image

            def image():
                if not isinstance(src, str):
                    src.seek(0)
                return Image.open(src)

            with image() as im:
                im.verify()  # must come right after open; the image is unusable afterwards
            with image() as im:
                w, h = im.size
                # EXIF orientations 5-8 include a quarter turn (TIFF/EXIF 2.3, tag 0x0112)
                if im.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                    h, w = w, h
            return {"num_frames": 1, "height": h, "width": w, "fps": math.nan, "file_size": size}
    except DecodeError as e:  # missing, zero-length, a file system that refused
        return {"error": _without(str(e), path)}
    except Exception as e:  # corrupt / truncated / unsupported
        return {"error": f"{type(e).__name__}: {_one_line(e)}"}


def check_clip(path: str, num_frames: int) -> str:
    """'' when every frame of the clip decodes as training reads it, else the reason it does not."""
    av.logging.set_level(av.logging.ERROR)  # FFmpeg's errors reach the Captures (`ffmpeg -v error`), not stderr
    video = is_video(path)
    listed = 0
    if video:
        try:
            with av.logging.Capture(local=False):
                listed = _listed_frames(path)
        except DecodeError as e:
            return _reason(e, path)
        except Exception as e:  # no video stream, a container FFmpeg cannot open
            return f"unreadable: {type(e).__name__}: {_without(_one_line(e), path)}"
    frames = max(num_frames, listed)
    failure = None
    with av.logging.Capture(local=False) as logs:
        try:
            load_sample(path, frames, CHECK_SIZE, CHECK_SIZE, frame_interval=1, rng=np.random.default_rng(0),
                        num_frames_hint=num_frames, threads=1)
        except DecodeError as e:
            failure = e
    errors = [_log_line(log) for log in logs if log[0] <= av.logging.ERROR]
    if failure is None and not errors:
        return ""
    if video:
        try:
            named = _diagnose(path, num_frames, listed)
        except Exception:  # the first reason stands
            named = None
        if named:
            return named
    return _reason(failure, path) if failure is not None else f"decoder error: {errors[0]}"


def _listed_frames(path: str) -> int:
    """The frame count the clip's container lists (0: none)."""
    with open_source(path) as src, av.open(src) as c:
        return int(c.streams.video[0].frames or 0)


def _diagnose(path: str, num_frames: int, listed: int) -> str | None:
    """Decode the clip packet by packet and name the first thing that goes wrong: the data ending
    before the frames its container lists (truncated), an error of the demuxer or decoder, or fewer
    frames than the table's `num_frames`. None when it finds nothing."""
    with open_source(path) as src:
        if isinstance(src, str):
            size = os.path.getsize(src)
        else:
            size = src.seek(0, os.SEEK_END)
            src.seek(0)
        of = f" of {listed}" if listed else ""
        with av.open(src) as c, av.logging.Capture(local=False) as logs:
            packets, k, seen = c.demux(c.streams.video[0]), 0, 0
            while True:
                try:
                    packet = next(packets)
                except StopIteration:
                    break
                except av.FFmpegError as e:  # the container's data is broken or missing
                    return f"truncated at frame {k}{of}" if listed > k else f"unreadable at frame {k}: {_av(e)}"
                ends_file = packet.pos is not None and packet.pos >= 0 and packet.pos + packet.size >= size > 0
                try:
                    decoded = len(packet.decode())
                except av.FFmpegError as e:
                    return f"truncated at frame {k}{of}" if ends_file else f"decoder error at frame {k}: {_av(e)}"
                errors = [_log_line(log) for log in logs[seen:] if log[0] <= av.logging.ERROR]
                seen = len(logs)
                if errors:
                    return f"truncated at frame {k}{of}" if ends_file else f"decoder error at frame {k}: {errors[0]}"
                k += decoded
    if listed and k < listed:
        return f"truncated at frame {k}{of}"
    if k < num_frames:
        return f"fewer frames than the table says: {k} of {num_frames}"
    return None


def _reason(e, path: str) -> str:
    """A DecodeError of the loader as a reason."""
    message = _without(str(e), path)
    if e.reason == "missing":
        return "missing file"
    if e.reason == "unreadable":
        return f"unreadable: {message}"
    return f"{e.reason.replace('_', ' ')}: {message}"


def _av(e) -> str:
    """An av error without its errno and call site: FFmpeg's own words."""
    text = _one_line(e)
    m = re.search(r"last error log: (.*)$", text)
    return m.group(1) if m else re.sub(r"^\[Errno -?\d+\] ", "", text)


def _log_line(log) -> str:
    return f"[{log[1]}] {_one_line(log[2])}" if log[1] else _one_line(log[2])


def _one_line(x) -> str:
    return " ".join(str(x).split())


def _without(message: str, path: str) -> str:
    """A message less the path it names (the reason sits beside the path already)."""
    return re.sub(r"\s+", " ", message.replace(f": {path}", "").replace(f" {path}:", ":").replace(path, "")).strip(
        " :")
