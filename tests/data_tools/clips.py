"""Real clips for the data tools' tests and the README walk, made with PyAV: good ones, and bad ones
made from good ones the ways downloads go bad."""

import av
import numpy as np


def encode(path, n, h=48, w=64, seed=0, faststart=True):
    """An h264 mp4 of `n` frames of moving texture (keyframe every 8; moov first with faststart, as
    downloaded clips usually are, so a cut past the header leaves a readable index)."""
    rng = np.random.default_rng(seed)
    tex = rng.integers(0, 256, (h + n, w + n, 3), dtype=np.uint8)
    with av.open(str(path), "w", options={"movflags": "faststart"} if faststart else {}) as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"crf": "28", "x264-params": "keyint=8:min-keyint=8:scenecut=0"}
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(tex[i:i + h, i:i + w]), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def truncate(path, keep=0.6):
    """Cut the file's bytes at `keep` of its length: the header (and its frame index) stay."""
    data = open(path, "rb").read()
    open(path, "wb").write(data[:int(len(data) * keep)])


def corrupt(path, nbytes=1500):
    """Overwrite `nbytes` in the middle of the stream with fixed junk (a few hundred bytes: the decoder
    conceals the damage and logs it, so the clip still decodes to its end; more: it fails)."""
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid:mid + nbytes] = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    open(path, "wb").write(bytes(data))


def oversize(path, size: int) -> str:
    """Grow the file to `size` bytes with zeros after its end (sparse: no disk is used). FFmpeg reads
    past them: the clip still decodes, it is only bigger."""
    with open(path, "r+b") as f:
        f.truncate(size)
    return str(path)
