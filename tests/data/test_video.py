"""Decoding one sample: rows that cannot fill their bucket raise with a reason (never repeated
frames, never a wrong shape); display rotation and EXIF orientation come out as a viewer shows
them, and data_tools.meta records the displayed size."""
import struct

import numpy as np
import pytest
from PIL import Image

from data_tools import meta
from jaxsora.data.video import DecodeError, load_sample, write_mp4

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
