"""load_sample's frames and pixels, held to a plain statement of what it computes: decode every frame
of the file from its start (display order), draw the crop as Open-Sora does, turn each chosen frame
into the bucket with one swscale call (bilinear, planar RGB at the cover size), upright, center crop.
Real-size sources (720p, 1080p, a phone clip stored 1280×720 and shown upright), B-frames and open
seeks into the middle of a GOP, buckets of several aspect ratios, frame intervals 1–3, decoder
threads 1 and 2, and a clip whose container overstates its length (the crop drawn again on the
measured one). Any change to the decode path must keep these bit-equal."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxsora.data.video import load_sample


def _texture(n: int, h: int, w: int, seed: int) -> np.ndarray:
    """[n, h, w, 3] uint8: random colours every 16 pixels, bicubic between, panning 2 pixels a frame
    (as bench/loader.py's clips: every frame distinct, colour detail for the converter to get wrong)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 16 + 2, (w + 2 * n) // 16 + 2, 3), dtype=np.uint8)
    tex = np.asarray(Image.fromarray(small).resize((small.shape[1] * 16, small.shape[0] * 16), Image.BICUBIC))
    return np.stack([tex[:h, 2 * i:2 * i + w] for i in range(n)])


def _encode(path, frames, *, bframes: bool, rotation: float = 0.0) -> str:
    import av

    params = "keyint=12:min-keyint=12:scenecut=0" + (":bframes=3:b-adapt=0:b-pyramid=normal" if bframes else "")
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "23", "x264-params": params}
        if rotation:
            s.set_display_rotation(rotation)
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("pixels")
    return {  # name → (path, frames in the file, the frame count a table row gives)
        # P-frames only, as the bench's clips: long enough for a 240p × 51 crop
        "720p": (_encode(d / "720p.mp4", _texture(56, 720, 1280, 0), bframes=False), 56, 56),
        "1080p_b": (_encode(d / "1080p.mp4", _texture(24, 1080, 1920, 1), bframes=True), 24, 24),
        # a phone held upright: stored landscape, displayed 720 × 1280
        "720p_phone": (_encode(d / "phone.mp4", _texture(20, 720, 1280, 2), bframes=True, rotation=-90), 20, 20),
        # Matroska stores no frame count: the table's 28 overstates the 20 frames there are
        "720p_mkv": (_encode(d / "short.mkv", _texture(20, 720, 1280, 3), bframes=True), 20, 28),
    }


def _draw(rng: np.random.Generator, n: int, t: int, interval: int) -> list[int]:
    """Open-Sora 1.2's temporal crop of an n-frame clip."""
    span = t * interval
    begin = int(rng.integers(0, max(0, n - span - 1) + 1))
    return np.linspace(begin, min(begin + span, n) - 1, t).astype(int).tolist()


_DECODED: dict = {}


def _decode_all(path: str, hint: int) -> tuple[int, list]:
    """(the frame count the loader starts from: the container's, else the table's; every frame of a
    decode from the start), once per clip."""
    import av

    if path not in _DECODED:
        with av.open(path) as c:
            stream = c.streams.video[0]
            _DECODED[path] = (stream.frames or hint, list(c.decode(stream)))
    return _DECODED[path]


def _reference(path: str, t: int, h: int, w: int, interval: int, seed: int, hint: int) -> tuple[list, np.ndarray]:
    """(frame indices, [3, T, H, W] uint8) as load_sample gives them, from a decode of every frame."""
    declared, frames = _decode_all(path, hint)
    rng = np.random.default_rng(seed)
    idx = _draw(rng, declared, t, interval)
    if idx[-1] >= len(frames):  # the stream ended before the crop's last frame: drawn again on its length
        idx = _draw(rng, len(frames), t, interval)
    k = int(round(float(frames[0].rotation or 0) / 90)) % 4
    out = np.empty((3, t, h, w), np.uint8)
    for s, i in enumerate(idx):
        f = frames[i]
        sh, sw = f.height, f.width
        dh, dw = (sw, sh) if k % 2 else (sh, sw)  # as displayed
        scale = max(h / dh, w / dw)
        nh, nw = max(h, round(dh * scale)), max(w, round(dw * scale))
        top, left = int(round((nh - h) / 2)), int(round((nw - w) / 2))
        th, tw = (nw, nh) if k % 2 else (nh, nw)  # the stored frame's size, scaled
        if (th, tw) == (sh, sw):
            rgb = f.reformat(format="rgb24", threads=1).to_ndarray()
        else:
            rgb = f.reformat(tw, th, "gbrp", interpolation="BILINEAR", threads=1).to_ndarray()  # RGB order
        rgb = np.rot90(rgb, k)[top:top + h, left:left + w]
        out[:, s] = np.moveaxis(rgb, 2, 0)
    return idx, out


CASES = [  # clip, T, (H, W) (Open-Sora 1.2's 240p/144p buckets), frame interval, seed, threads
    ("720p", 51, (240, 426), 1, 0, 1),
    ("720p", 16, (240, 426), 1, 3, 2),
    ("720p", 8, (320, 320), 3, 1, 1),
    ("720p", 16, (144, 256), 2, 5, 1),
    ("1080p_b", 8, (240, 426), 1, 0, 1),
    ("1080p_b", 8, (240, 426), 1, 4, 2),
    ("1080p_b", 4, (426, 240), 3, 2, 1),
    ("1080p_b", 16, (320, 320), 1, 7, 1),
    ("1080p_b", 1, (196, 522), 1, 6, 1),
    ("720p_phone", 8, (426, 240), 1, 1, 1),
    ("720p_phone", 8, (276, 368), 2, 2, 1),
    ("720p_mkv", 16, (240, 426), 1, 0, 1),
    ("720p_mkv", 16, (240, 426), 1, 2, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_load_sample_gives_the_reference_frames_and_pixels(clips, case):
    name, t, (h, w), interval, seed, threads = case
    path, n, hint = clips[name]
    idx, want = _reference(path, t, h, w, interval, seed, hint)
    got, fps = load_sample(path, t, h, w, frame_interval=interval, rng=np.random.default_rng(seed),
                           num_frames_hint=hint, threads=threads)
    assert got.shape == want.shape and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want, err_msg=f"frames {idx}")
    assert fps == 30.0 // interval


def test_the_cases_seek_into_gops_and_redraw_short_clips(clips):
    """The cases above cover what they claim: crops that start inside a GOP (a seek, then frames
    dropped before the first), crops of the 720p clip's last frames, and the Matroska clip's
    redraw on its measured 20 frames."""
    starts = {name: [] for name in clips}
    for name, t, _, interval, seed, _ in CASES:
        n_declared = clips[name][2]
        starts[name].append(_draw(np.random.default_rng(seed), n_declared, t, interval))
    assert any(s[0] % 12 for s in starts["1080p_b"]) and any(s[0] % 12 for s in starts["720p"])
    assert any(s[-1] >= 20 for s in starts["720p_mkv"])  # drawn on 28, ends past the 20th: drawn again


def test_non_reference_frames_no_crop_needs_are_not_decoded(clips, monkeypatch):
    """The seek pass lets the decoder drop the non-reference frames (here x264's unreferenced
    B-frames) of packets no crop frame needs — before the crop, between frames at interval 3 —
    and still gives the reference's pixels (the cases above hold them)."""
    import jaxsora.data.video as video

    path, n, hint = clips["1080p_b"]
    out, dropped, real = [], [], video._decode_dropping

    def spy(container, stream, clock, slots, drops, prev):
        dropped.append(drops.indices)
        for frame in real(container, stream, clock, slots, drops, prev):
            out.append(clock.index(frame.pts))
            yield frame

    monkeypatch.setattr(video, "_decode_dropping", spy)
    rng = np.random.default_rng(2)
    idx = _draw(np.random.default_rng(2), n, 4, 3)
    got, _ = load_sample(path, 4, 240, 426, frame_interval=3, rng=rng, num_frames_hint=hint)
    np.testing.assert_array_equal(got, _reference(path, 4, 240, 426, 3, 2, hint)[1])
    assert set(idx) <= set(out)
    never = dropped[0] - set(out)  # packets let go that the decoder did not decode
    assert never and not never & set(idx), (sorted(dropped[0]), out, idx)
    assert any(idx[0] < i < idx[-1] for i in never), (sorted(never), idx)  # between the crop's frames too


def test_dropped_frames_keep_the_checks_of_a_full_decode():
    """What a full decode's frame-by-frame checks would have seen, with the dropped frames in: a
    gap bridged only by dropped frames, a dropped frame repeated or behind a frame already out is
    off the clock, and a stream that ends counts the dropped frames right after its last one."""
    from jaxsora.data.video import _Dropped

    d = _Dropped()
    for i in (4, 5, 9):
        d.add(i, prev=3)
    assert d.bridge(3, 4) and d.bridge(3, 6) and not d.bridge(6, 8) and not d.bridge(6, 6) and not d.bridge(6, 5)
    assert not d.off_clock and d.end(5) == -1 and d.end(8) == 10 and d.end(9) == 10
    d.add(7, prev=6)
    assert d.end(6) == -1  # 8 neither out nor dropped: a frame missing
    d.add(8, prev=6)
    assert d.end(6) == 10 and not d.off_clock
    repeated, late = _Dropped(), _Dropped()
    repeated.add(4, prev=3)
    repeated.add(4, prev=3)
    late.add(4, prev=5)
    assert repeated.off_clock and late.off_clock
