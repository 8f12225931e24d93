"""Decoding one sample: rows that cannot fill their bucket raise with a reason (never repeated
frames, never a wrong shape); display rotation and EXIF orientation come out as a viewer shows
them, and data_tools.meta records the displayed size."""
import struct

import numpy as np
import pytest
from PIL import Image

from data_tools import meta
from jaxsora.data.video import DecodeError, load_sample, temporal_indices, write_mp4

LEVELS = np.arange(10) * 20 + 10  # frame i is a flat gray of level 10 + 20·i: its index is readable after h264


def _gray_clip(n, h=16, w=16):
    """[n, h, w, 3] uint8, frame i flat gray LEVELS[i]."""
    return np.broadcast_to(LEVELS[:n, None, None, None].astype(np.uint8), (n, h, w, 3)).copy()


def _frame_indices(video):
    """[3, T, H, W] of a gray clip → the source frame index of each of its T frames."""
    return np.rint((video.mean(axis=(0, 2, 3)) - 10) / 20).astype(int)


def _write_mkv(frames, path):
    """h264 in Matroska, which stores no frame count: the loader falls back on the table's."""
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=8)
        s.width, s.height, s.pix_fmt, s.options = frames.shape[2], frames.shape[1], "yuv420p", {"crf": "0"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def test_a_clip_shorter_than_declared_is_skipped_never_padded(tmp_path):
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    one = write_mp4(_gray_clip(1), str(tmp_path / "one.mp4"), 8, crf=0)  # 1 real frame, table says 12
    with pytest.raises(DecodeError) as e:
        load_sample(one, 8, 16, 16, frame_interval=1, rng=rng(), num_frames_hint=12)
    assert e.value.reason == "too_short"
    # Matroska has no frame count: 10 real frames, the table says 20.
    ten = _write_mkv(_gray_clip(10), tmp_path / "ten.mkv")
    with pytest.raises(DecodeError) as e:  # 16 frames can never come out of 10
        load_sample(ten, 16, 16, 16, frame_interval=1, rng=rng(), num_frames_hint=20)
    assert e.value.reason == "too_short"
    with pytest.raises(DecodeError) as e:  # 4 frames at interval 3 need 12
        load_sample(ten, 4, 16, 16, frame_interval=3, rng=rng(), num_frames_hint=20)
    assert e.value.reason == "too_short"
    for seed in range(8):  # 8 frames do fit in 10: the crop is redrawn on the measured length
        video, _ = load_sample(ten, 8, 16, 16, frame_interval=1, rng=np.random.default_rng(seed), num_frames_hint=20)
        got = _frame_indices(video)
        assert video.shape == (3, 8, 16, 16)
        assert (np.diff(got) == 1).all() and got[-1] <= 9, got  # 8 distinct consecutive real frames


def test_images_in_a_video_bucket_are_refused_with_their_reason(tmp_path):
    still = np.zeros((16, 16, 3), np.uint8)
    Image.fromarray(still).save(tmp_path / "still.png")
    frames = [Image.fromarray(np.full((16, 16, 3), v, np.uint8)) for v in (200, 20, 90)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    kw = dict(frame_interval=1, rng=np.random.default_rng(0))
    for name, reason in (("still.png", "image_in_video_bucket"), ("anim.gif", "animated_image")):
        with pytest.raises(DecodeError) as e:
            load_sample(str(tmp_path / name), 8, 16, 16, num_frames_hint=12, **kw)
        assert e.value.reason == reason
    video, fps = load_sample(str(tmp_path / "anim.gif"), 1, 16, 16, **kw)  # an image bucket: the first frame
    assert video.shape == (3, 1, 16, 16) and abs(int(video.mean()) - 200) <= 2 and fps == 120
    with pytest.raises(DecodeError) as e:
        load_sample(str(tmp_path / "nothing.mp4"), 8, 16, 16, **kw)
    assert e.value.reason == "missing"
    (tmp_path / "junk.mp4").write_bytes(b"\x00not a video" * 50)
    with pytest.raises(DecodeError) as e:
        load_sample(str(tmp_path / "junk.mp4"), 8, 16, 16, **kw)
    assert e.value.reason == "unreadable"


def _tkhd_matrix(path):
    """The first track header's (a, b, c, d, tx, ty) of an mp4 (ISO/IEC 14496-12 §8.3.2: after
    version/flags, times, track id, duration, 8 reserved bytes, layer, group, volume, 2 reserved)."""
    data = open(path, "rb").read()
    i = data.index(b"tkhd") + 4  # version byte
    off = i + 4 + (32 if data[i] == 1 else 20) + 16
    a, b, _, c, d, _, tx, ty, _ = struct.unpack(">9i", data[off:off + 36])
    return np.array([a, b, c, d, tx, ty]) / 65536.0


def _displayed_corner(m, h, w):
    """Where a viewer sees the stored frame's top-left pixel: ('top'|'bottom', 'left'|'right'), and the
    displayed (H, W). The spec maps a point (x, y) (y down) to (a·x + c·y + tx, b·x + d·y + ty)."""
    a, b, c, d, tx, ty = m
    pts = np.array([[0, 0], [w, 0], [0, h], [w, h]], float)
    out = np.stack([a * pts[:, 0] + c * pts[:, 1] + tx, b * pts[:, 0] + d * pts[:, 1] + ty], 1)
    lo, hi = out.min(0), out.max(0)
    x, y = out[0]  # the image of the top-left corner
    corner = ("top" if y == lo[1] else "bottom", "left" if x == lo[0] else "right")
    return corner, (int(hi[1] - lo[1]), int(hi[0] - lo[0]))


def _corner_means(video):
    """[3, T, H, W] → mean level of each 4×4 corner, keyed like `_displayed_corner`."""
    v = video.mean(axis=(0, 1))
    return {("top", "left"): v[:4, :4].mean(), ("top", "right"): v[:4, -4:].mean(),
            ("bottom", "left"): v[-4:, :4].mean(), ("bottom", "right"): v[-4:, -4:].mean()}


@pytest.mark.parametrize("clockwise", [90, 180, 270])
def test_rotated_clips_come_out_as_displayed(tmp_path, clockwise):
    """A clip stored 24×40 with a bright top-left corner, its display matrix turning it `clockwise`
    degrees (written by PyAV: the counter-clockwise angle is −clockwise). The expected picture comes
    from the mp4's own matrix and the spec's mapping, not from the decoder."""
    h, w = 24, 40
    frames = np.full((6, h, w, 3), 16, np.uint8)
    frames[:, :6, :6] = 235
    path = write_mp4(frames, str(tmp_path / f"r{clockwise}.mp4"), 8, crf=0, display_rotation=-clockwise)
    corner, (dh, dw) = _displayed_corner(_tkhd_matrix(path), h, w)
    assert (dh, dw) == ((w, h) if clockwise % 180 else (h, w))
    assert corner == {90: ("top", "right"), 180: ("bottom", "right"), 270: ("bottom", "left")}[clockwise]

    probed = meta.probe(path)
    assert (probed["height"], probed["width"], probed["num_frames"]) == (dh, dw, 6)
    video, _ = load_sample(path, 4, dh, dw, frame_interval=1, rng=np.random.default_rng(0), num_frames_hint=6)
    assert video.shape == (3, 4, dh, dw)
    means = _corner_means(video)
    assert means[corner] > 200, means
    assert all(v < 40 for k, v in means.items() if k != corner), means


def test_exif_orientation_is_applied_to_images(tmp_path):
    """EXIF orientation 6 (TIFF/EXIF: row 0 is the visual right side, column 0 the visual top): a
    viewer turns the stored picture 90° clockwise, so its top-left corner shows top right."""
    stored = np.full((24, 40, 3), 16, np.uint8)
    stored[:6, :6] = 235
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "photo.png", exif=exif)
    probed = meta.probe(str(tmp_path / "photo.png"))
    assert (probed["height"], probed["width"]) == (40, 24)
    video, _ = load_sample(str(tmp_path / "photo.png"), 1, 40, 24, frame_interval=1, rng=np.random.default_rng(0))
    means = _corner_means(video)
    assert means[("top", "right")] > 200 and all(v < 40 for k, v in means.items() if k != ("top", "right")), means


# ---- decoding only the frames a crop needs ----------------------------------------------------------

def _texture_clip(n, h=48, w=64, seed=0, grain=8):
    """[n, h, w, 3] uint8: a smooth random texture (random colours every `grain` pixels, bicubic in
    between) panning one pixel per frame (every frame distinct)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // grain + 2, (w + n) // grain + 2, 3), dtype=np.uint8)
    tex = np.asarray(Image.fromarray(small).resize((small.shape[1] * grain, small.shape[0] * grain), Image.BICUBIC))
    return np.stack([tex[:h, i:i + w] for i in range(n)])


def _encode(path, frames, *, codec="libx264", fps=24, options=None, pts=None, rotation=0.0):
    """Write frames with explicit encoder options (GOP, B-frames) and optionally explicit timestamps."""
    from fractions import Fraction

    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = dict(options or {})
        if pts is not None:
            s.codec_context.time_base = Fraction(1, fps)
        if rotation:
            s.set_display_rotation(rotation)
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, fps)
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def _x264(gop=12, extra=""):
    return {"preset": "medium", "crf": "18",
            "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=3:b-adapt=0{extra}"}


@pytest.fixture
def decode_log(monkeypatch):
    """[(seeked to frame, outcome)] of every decode pass load_sample runs."""
    import jaxsora.data.video as video

    log, real = [], video._decode_pass

    def spy(container, slots, first, last, put, clock, seek_to):
        out = real(container, slots, first, last, put, clock, seek_to)
        log.append((seek_to, out[0]))
        return out

    monkeypatch.setattr(video, "_decode_pass", spy)
    return log


def _from_the_start(monkeypatch, fn):
    """fn() with the frame clock refused: every decode runs from the start of the file, counting frames."""
    import jaxsora.data.video as video

    with monkeypatch.context() as m:
        m.setattr(video._FrameClock, "of", classmethod(lambda cls, *a: None))
        return fn()


def _all_frames(path, h, w):
    """Every frame of a plain PyAV decode from the start, each through the full-size path (rgb24 +
    resize_crop): [N, 3, h, w] int."""
    import av

    from jaxsora.data.video import resize_crop

    with av.open(path) as c:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return np.transpose(resize_crop(frames, h, w), (0, 3, 1, 2)).astype(int)


CLIPS = {  # name → (container, codec, encoder options): GOP 12 with B-frames unless said otherwise
    "h264_mp4": ("mp4", "libx264", _x264()),
    "h264_open_gop_mp4": ("mp4", "libx264", _x264(extra=":open-gop=1")),
    "h264_mkv": ("mkv", "libx264", _x264()),  # no frame count in the container: the table's; ms timestamps
    "hevc_mp4": ("mp4", "libx265", {"preset": "fast", "x265-params":
                                    "keyint=12:min-keyint=12:scenecut=0:bframes=3:open-gop=1:log-level=none"}),
}


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_seeking_gives_the_frames_of_a_decode_from_the_start(tmp_path, monkeypatch, decode_log, name):
    """Keyframes every 12 frames, B-frames (reordered: decode order ≠ display order), crops starting
    in the middle of a GOP: the seek path's frames are bit-equal to a decode from the start of the
    file, and each is the frame of that index in a plain decode of all frames."""
    ext, codec, options = CLIPS[name]
    n = 60
    path = _encode(tmp_path / f"clip.{ext}", _texture_clip(n), codec=codec, options=options)
    h, w = 32, 40
    every = _all_frames(path, h, w)
    for t, interval, seed in [(8, 1, 0), (8, 1, 1), (4, 3, 2), (1, 1, 3), (16, 1, 4), (8, 2, 5), (8, 1, 6)]:
        kw = dict(frame_interval=interval, num_frames_hint=n)
        seeked, _ = load_sample(path, t, h, w, rng=np.random.default_rng(seed), **kw)
        start, _ = _from_the_start(monkeypatch, lambda: load_sample(path, t, h, w, rng=np.random.default_rng(seed),
                                                                    **kw))
        np.testing.assert_array_equal(seeked, start)
        expected = temporal_indices(n, t, interval, np.random.default_rng(seed)).tolist()
        nearest = [int(np.argmin(np.abs(every - f.astype(int)).mean(axis=(1, 2, 3))))
                   for f in np.moveaxis(seeked, 1, 0)]
        assert nearest == expected, (nearest, expected)
    seeks = [(s, o) for s, o in decode_log if s > 0]
    assert any(s % 12 and o == "done" for s, o in seeks), decode_log  # seeks into the middle of GOPs did happen
    if "open_gop" in name or "hevc" in name:  # leading frames of an open GOP: landed late once, then redone
        assert all(o in ("done", "late") for _, o in decode_log), decode_log
    else:
        assert all(o == "done" for _, o in decode_log), decode_log


def test_a_clip_with_a_gap_in_its_timestamps_decodes_from_the_start(tmp_path, monkeypatch, decode_log):
    """Frame 30 dropped (its timestamp skipped): the frame grid no longer counts frames, so no seek —
    the 59 frames keep the indices of a decode from the start."""
    pts = [i for i in range(61) if i != 30]
    path = _encode(tmp_path / "gap.mp4", _texture_clip(60), options=_x264(), pts=pts)
    for seed in range(4):
        got, _ = load_sample(path, 8, 32, 40, frame_interval=1, rng=np.random.default_rng(seed))
        ref, _ = _from_the_start(monkeypatch, lambda: load_sample(path, 8, 32, 40, frame_interval=1,
                                                                  rng=np.random.default_rng(seed)))
        np.testing.assert_array_equal(got, ref)
    assert decode_log and all(s == 0 for s, _ in decode_log), decode_log


def test_decoder_threads_give_the_same_frames(tmp_path):
    path = _encode(tmp_path / "clip.mp4", _texture_clip(48, 96, 128), options=_x264())
    kw = dict(frame_interval=1, num_frames_hint=48)
    one, _ = load_sample(path, 16, 64, 80, rng=np.random.default_rng(3), threads=1, **kw)
    three, _ = load_sample(path, 16, 64, 80, rng=np.random.default_rng(3), threads=3, **kw)
    np.testing.assert_array_equal(one, three)


@pytest.mark.parametrize("rotation", [0, -90])
def test_scaled_decode_stays_within_tolerance_of_the_full_size_path(tmp_path, rotation):
    """The scaled decode (one swscale call to planar RGB at the cover size) against full-size rgb24 +
    upright + PIL bilinear resize_crop, the path before it: the bound of the module docstring —
    mean |Δ| ≤ 3 levels, a uniform offset ≤ 1.5 (the full-size converter's darkening), 99% of the
    values within 12 — on downscales by 1.5–4× and a crop of the other aspect ratio, of a texture
    with colour detail every 16 pixels (as the bench's clips; the spread grows with colour detail at
    the pixel scale: every 8 pixels, mean 3.6–4.1, 99% within 17, while the two resampling filters
    alone still agree within mean 0.2–1.2)."""
    import av

    from jaxsora.data.video import channels_first, resize_crop, upright

    n = 24
    path = _encode(tmp_path / "clip.mp4", _texture_clip(n, 192, 320, seed=1, grain=16), options=_x264(),
                   rotation=rotation)
    with av.open(path) as c:
        decoded = [f for f in c.decode(video=0)]
        full = upright(np.stack([f.to_ndarray(format="rgb24") for f in decoded]), decoded[0].rotation)
    for h, w in ([(48, 80), (128, 212), (64, 64)] if not rotation else [(80, 48), (64, 64)]):
        video, _ = load_sample(path, 4, h, w, frame_interval=1, rng=np.random.default_rng(0), num_frames_hint=n)
        idx = temporal_indices(n, 4, 1, np.random.default_rng(0))
        d = video.astype(int) - channels_first(resize_crop(full[idx], h, w))
        assert np.abs(d).mean() <= 3 and abs(d.mean()) <= 1.5 and np.percentile(np.abs(d), 99) <= 12, \
            (h, w, np.abs(d).mean(), d.mean(), np.percentile(np.abs(d), 99))


def test_rotated_clips_come_out_as_displayed_after_a_seek(tmp_path, monkeypatch, decode_log):
    h, w = 24, 40
    frames = np.full((36, h, w, 3), 16, np.uint8)
    frames[:, :6, :6] = 235
    path = _encode(tmp_path / "r.mp4", frames, options=_x264(), rotation=-90)  # turned 90° clockwise
    video, _ = load_sample(path, 4, w, h, frame_interval=1, rng=np.random.default_rng(5), num_frames_hint=36)
    assert any(s > 0 for s, _ in decode_log)
    means = _corner_means(video)
    assert means[("top", "right")] > 200 and all(v < 40 for k, v in means.items() if k != ("top", "right")), means
    ref, _ = _from_the_start(monkeypatch, lambda: load_sample(path, 4, w, h, frame_interval=1,
                                                              rng=np.random.default_rng(5), num_frames_hint=36))
    np.testing.assert_array_equal(video, ref)


def test_the_same_frames_give_the_same_file(tmp_path):
    """write_mp4 is a function of its frames, so a sampler's seed gives the same file. With x264's
    macroblock tree on, frames like these gave up to 13 different files in 60 writes once jax was
    imported (as here); this test then failed in about 1 run of 5 (a guard, not a proof)."""
    import hashlib

    rng = np.random.default_rng(1)
    frames = (np.cumsum(rng.random((16, 240, 424, 3)), axis=2) / 424 * 255).astype(np.uint8)
    digests = {hashlib.sha256(open(write_mp4(frames, str(tmp_path / f"{i}.mp4"), 24), "rb").read()).hexdigest()
               for i in range(20)}
    assert len(digests) == 1
