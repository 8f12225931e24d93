"""data_tools.judge reads colour, motion and shape off the pixels; data_tools.synthetic holds combinations out.

The judge is only worth its verdicts if it gets the set's own clips right: every 8-frame crop of every
clip (what the demo trains on), through the mp4 codec. And it must say "no" to what is not there: a
still shape, a reversed clip, an empty frame.
"""
import hashlib
import json
import subprocess

import numpy as np
import pandas as pd
import pytest

from data_tools import judge, synthetic
from jaxsora.errors import BadInput
from tests.conftest import REPO
from tests.zygote import PYTHON


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge_set")
    df = synthetic.generate(str(out), progress=False, **synthetic.PRESETS["demo"])
    return out, df


def _pooled(frames: np.ndarray) -> np.ndarray:
    """[N, T, H, W, 3] uint8 → the same through the demo's IdentityVAE (configs/demo.py's 2× pooling): encoded,
    decoded, back to uint8 — all of a frame a demo sample can show."""
    from jaxsora.data.video import to_model_range
    from jaxsora.models.vae import IdentityVAE

    vae = IdentityVAE(downsample=(1, 2, 2))
    x = np.transpose(to_model_range(frames), (0, 4, 1, 2, 3))  # [N, 3, T, H, W] in [-1, 1]
    y = np.asarray(vae.decode(vae.encode(x), frames.shape[1]))
    return np.round((np.transpose(y, (0, 2, 3, 4, 1)) + 1) * 127.5).clip(0, 255).astype(np.uint8)


def test_judge_reads_every_crop_of_the_training_clips(dataset):
    """Colour, direction and shape of every 8-frame crop of every clip, as drawn (through the codec) and after the
    demo's 2× pooling."""
    out, df = dataset
    videos = df[df.num_frames > 1]
    clips = np.stack([judge.read_video(str(out / p)) for p in videos.path])  # [240, 9, 32, 32, 3]
    for name, frames in (("drawn", clips), ("pooled", _pooled(clips))):
        n, wrong = 0, []
        for clip, text in zip(frames, videos.text):
            asked = judge.parse_caption(text)
            for start in range(len(clip) - 8 + 1):
                v = judge.judge_frames(clip[start:start + 8])
                n += 1
                if (v.colour, v.direction, v.shape) != (asked["colour"], asked["direction"], asked["shape"]):
                    wrong.append((text, start, v))
        assert n == 240 * 2 and not wrong, (name, wrong[:3])


def test_images_show_their_colour_and_shape_and_no_motion(dataset):
    out, df = dataset
    for row in df[df.num_frames == 1].itertuples():
        frames = judge.read_video(str(out / row.path))
        asked = judge.parse_caption(row.text)
        for v in (judge.judge_frames(frames), judge.judge_frames(_pooled(frames[None])[0])):
            assert (v.colour, v.shape, v.direction) == (asked["colour"], asked["shape"], "none")


def test_shapes_at_other_sizes_and_split_by_the_border():
    """Every shape in every direction at radii 0.15-0.35 of the frame; a shape the wrapping frame splits in two is
    judged whole; a speck of stray foreground does not change the shape's fit."""
    rng = np.random.default_rng(2)
    for radius in (0.15, 0.2, 0.3, 0.35):
        for shape in synthetic.SHAPES:
            for d in synthetic.DIRECTIONS.values():
                clip = synthetic.render(shape, synthetic.COLORS["yellow"], d, 8, 32, 32, rng, radius=radius)
                assert judge.judge_frames(clip).shape == shape, (radius, shape, d, judge.judge_frames(clip))
    square = synthetic.render("square", synthetic.COLORS["red"], (0, 0), 1, 32, 32, rng)[0]
    split = np.roll(square, (16, 16), axis=(0, 1))  # the square's four quarters in the frame's four corners
    assert (split[0] != split[16]).any() and (split[:, 0] != split[:, 16]).any()
    assert judge.judge_frames(split[None]).shape == "square"
    speck = square.copy()
    speck[1, 1] = synthetic.COLORS["red"]
    assert judge.judge_frames(speck[None]).fit == judge.judge_frames(square[None]).fit


def _drawn(mask: np.ndarray) -> np.ndarray:
    """[H, W] bool → one frame [1, H, W, 3] uint8: the mask grey on the set's background."""
    return np.where(mask[..., None], np.uint8(200), np.asarray(synthetic.BACKGROUND, np.uint8))[None]


def test_what_is_between_two_shapes_is_unclear_and_a_bump_changes_nothing():
    """The shapes a model draws on its way to the set's: a square with a bump on one side (what a demo model's
    samples show) is a square; a stretched disc is a bar; an oval, and a square with its corners cut halfway to
    a disc's, are neither circle nor square ("unclear"), where a bounding box's fill called every such blob a
    circle; a square with its corners cut deeper is a circle."""
    yy, xx = np.mgrid[0:32, 0:32]
    box = (np.abs(yy - 16) <= 10) & (np.abs(xx - 16) <= 10)  # the set's square at r = 10
    bump = box.copy()
    bump[12:16, 4:6] = True  # 4 x 2 pixels on its left side
    assert judge.judge_frames(_drawn(box)).shape == judge.judge_frames(_drawn(bump)).shape == "square"
    assert judge.judge_frames(_drawn(((yy - 16) / 10) ** 2 + ((xx - 16) / 5) ** 2 <= 1)).shape == "bar"
    oval = ((yy - 16) / 10) ** 2 + ((xx - 16) / 7.8) ** 2 <= 1  # 1.28 : 1
    assert judge.judge_frames(_drawn(oval)).shape == "unclear"

    def cut(k):  # the box with a triangle of legs k pixels off each corner
        return box & (np.abs(yy - 16) + np.abs(xx - 16) <= 20 - k)

    assert judge.judge_frames(_drawn(cut(4))).shape == "unclear"
    assert judge.judge_frames(_drawn(cut(6))).shape == "circle"


def test_judge_says_no_to_what_is_not_there():
    rng = np.random.default_rng(0)
    clip = synthetic.render("square", synthetic.COLORS["green"], synthetic.DIRECTIONS["up"], 8, 32, 32, rng)
    assert judge.judge_frames(clip).direction == "up"
    assert judge.judge_frames(clip[::-1]).direction == "down"  # time reversed
    still = np.repeat(clip[:1], 8, axis=0)
    assert judge.judge_frames(still).direction == "none"
    empty = np.broadcast_to(np.asarray(synthetic.BACKGROUND, np.uint8), (8, 32, 32, 3))
    assert judge.judge_frames(empty) == judge.Verdict(None, "none", (0.0, 0.0), None, (0.0, 0.0, 0.0))
    # a shape that jumps back and forth has no consistent direction even if it ends elsewhere
    jitter = np.stack([clip[i] if i % 2 else clip[7 - i] for i in range(8)])
    assert judge.judge_frames(jitter).direction in ("none", "up", "down")


def test_held_out_combinations_are_never_shown(dataset):
    out, df = dataset
    held = {synthetic.caption(*c) for c in synthetic.HELD_OUT}
    assert len(held) == 12
    assert not held & set(df.text)
    assert (out / "prompts.txt").read_text().splitlines() == [synthetic.caption(*c) for c in synthetic.HELD_OUT]
    # every pair of words of a held-out caption is shown together in other combinations
    shown = {tuple(judge.parse_caption(t).values()) for t in df.text}
    for colour, shape, direction in synthetic.HELD_OUT:
        assert any(c == colour and d == direction for c, _, d in shown)
        assert any(s == shape and d == direction for _, s, d in shown)
        assert any(c == colour and s == shape and d is not None for c, s, d in shown)


def test_no_two_samples_are_alike(dataset, tmp_path):
    """Shapes near the centre of a 32×32 frame can coincide; the set draws such a clip again, so a dedup of it
    removes nothing — and asking for more samples than a frame size holds is one clear error."""
    out, df = dataset
    digests = {hashlib.sha256((out / p).read_bytes()).hexdigest() for p in df.path}
    assert len(digests) == len(df) == synthetic.PRESETS["demo"]["num_videos"] + synthetic.PRESETS["demo"]["num_images"]
    with pytest.raises(BadInput, match="could not draw 1000 distinct samples"):  # 18 captions, a few patterns each
        synthetic.generate(str(tmp_path), num_videos=0, num_images=1000, sizes=[(8, 8)], frames=[2], fps=8, seed=0,
                           progress=False)


def test_the_demo_set_draws_at_every_seed(tmp_path):
    """A still or moving square within +-1 px of the centre has only a few pixel patterns, so a caption drawn more
    often than it has patterns takes another caption: the demo preset draws at other seeds too (seeds 1-7 stopped at
    "could not draw 256 distinct samples" before), its samples distinct and none of the held-out captions."""
    held_out = {synthetic.caption(*c) for c in synthetic.HELD_OUT}
    total = synthetic.PRESETS["demo"]["num_videos"] + synthetic.PRESETS["demo"]["num_images"]
    for seed in (1, 3):
        df = synthetic.generate(str(tmp_path / str(seed)), progress=False, **dict(synthetic.PRESETS["demo"], seed=seed))
        assert len({hashlib.sha256((tmp_path / str(seed) / p).read_bytes()).hexdigest() for p in df.path}) == total
        assert not held_out & set(df.text)
        assert df.text.str.contains("square").sum() > total // 5  # squares are not crowded out (a third of each)


def test_parse_caption():
    assert judge.parse_caption("a white bar moving up on a dark background") == \
        dict(colour="white", shape="bar", direction="up")
    assert judge.parse_caption("a red circle on a dark background aesthetic score: 6.5.") == \
        dict(colour="red", shape="circle", direction=None)
    assert judge.parse_caption("a cat") == dict(colour=None, shape=None, direction=None)


def _sample_folder(folder, clips_and_prompts):
    from jaxsora.data.video import write_mp4

    folder.mkdir()
    for i, (clip, prompt) in enumerate(clips_and_prompts):
        write_mp4(clip, str(folder / f"sample_{i:04d}.mp4"), 8)
        (folder / f"sample_{i:04d}.json").write_text(json.dumps({"prompt": prompt}))


def test_cli_scores_a_folder_and_draws_it(tmp_path):
    rng = np.random.default_rng(1)
    right = synthetic.render("circle", synthetic.COLORS["red"], synthetic.DIRECTIONS["right"], 8, 32, 32, rng)
    _sample_folder(tmp_path / "s", [(right, synthetic.caption("red", "circle", "right")),
                                    (right, synthetic.caption("red", "circle", "left")),
                                    (right, synthetic.caption("blue", "circle", "right")),
                                    (right, synthetic.caption("red", "bar", "right"))])
    r = subprocess.run([PYTHON, "-m", "data_tools.judge", str(tmp_path / "s"), "--png",
                        str(tmp_path / "grid.png")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "samples follow their prompts: colour 3/4, motion 3/4, shape 3/4"
    assert "asked red bar right, shows red circle right" in lines[3]
    from PIL import Image

    with Image.open(tmp_path / "grid.png") as im:
        assert im.width > 8 * 32 * 3 and im.height >= 4 * 32 * 3


def test_cli_user_mistakes_are_one_line(tmp_path):
    for args in ([str(tmp_path / "missing")], [str(tmp_path)]):
        r = subprocess.run([PYTHON, "-m", "data_tools.judge", *args], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def _foreground(frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] → [T, H, W] bool: the pixels the judge counts as the shape."""
    return np.linalg.norm(frames.astype(np.float32) - np.asarray(synthetic.BACKGROUND), axis=-1) > \
        judge.FOREGROUND_DISTANCE


def test_synthetic_motion_never_stops(dataset):
    out, df = dataset
    row = df[df.num_frames > 1].iloc[0]
    fg = _foreground(judge.read_video(str(out / row.path)))
    c = np.stack([judge._circular_centroid(fg, 1), judge._circular_centroid(fg, 2)], axis=1)
    steps = np.abs(np.diff(c, axis=0)).max(axis=1)
    assert steps.min() > 0.5 * steps.mean()  # constant speed: no frame where the shape stands still
    assert pd.notna(row.fps)


def _first_and_mean_place(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y, x) of the shape's centroid in the first frame and over all frames, from the frame's centre."""
    fg = _foreground(frames)
    size = np.array(fg.shape[1:], np.float64)
    c = np.stack([judge._circular_centroid(fg, 1), judge._circular_centroid(fg, 2)], axis=1)  # [T, 2], unwrapped
    first = c[0] % size - size / 2
    return first, first + (c - c[0]).mean(axis=0)


def test_every_clip_starts_at_the_centre_whichever_way_it_goes(dataset):
    """The demo set's shapes start near the centre: a first frame says nothing of the direction (only the
    caption does), while where the shape is over the clip lies on the side its direction names."""
    out, df = dataset
    # the start's jitter, plus a pixel for the centroid of a drawn shape
    side = synthetic.PRESETS["demo"].get("jitter", synthetic.START_JITTER) * 32 + 1.0
    firsts = {d: [] for d in synthetic.DIRECTIONS}
    for row in df[df.num_frames > 1].itertuples():
        d = judge.parse_caption(row.text)["direction"]
        first, mean = _first_and_mean_place(judge.read_video(str(out / row.path)))
        assert np.abs(first).max() <= side, (row.path, first)
        way = np.asarray(synthetic.DIRECTIONS[d], np.float64)
        # over the clip the shape sits half its travel (6 px of 12) out from where it began, the way it goes,
        # and so on that side of the centre whatever the jitter of its start
        assert 5.0 < (mean - first) @ way < 7.0 and mean @ way > 1.5, (row.path, d, first, mean)
        firsts[d].append(first)
    for d, f in firsts.items():  # the first frames of each direction sit alike around the centre
        assert len(f) > 40 and np.abs(np.mean(f, axis=0)).max() < 1.0, (d, np.mean(f, axis=0))


def test_anywhere_starts_say_nothing_of_the_direction():
    """--start anywhere: the frames wrap around and a shape starts anywhere, whichever way it moves; a clip
    that crosses a border is drawn in two pieces and judged by its direction all the same."""
    rng = np.random.default_rng(0)
    for d in ("right", "left"):
        starts = []
        for _ in range(40):
            clip = synthetic.render("circle", synthetic.COLORS["red"], synthetic.DIRECTIONS[d], 9, 32, 32, rng,
                                    start="anywhere")
            starts.append(_first_and_mean_place(clip)[0][1] + 16)
        # start columns spread over the frame (a fixed side would give a spread of ~2 px)
        assert np.histogram(starts, bins=4, range=(0, 32))[0].min() >= 3, (d, sorted(starts))
    rng = np.random.default_rng(3)
    clip = synthetic.render("circle", synthetic.COLORS["red"], synthetic.DIRECTIONS["left"], 9, 32, 32, rng,
                            start="anywhere", travel=0.8)
    fg = _foreground(clip)
    split = [f for f in fg if f[:, 0].any() and f[:, -1].any()]
    assert split, "this seed's clip should cross the left border"
    assert judge.judge_frames(clip).direction == "left"


def test_inside_starts_stay_in_the_frame():
    """--start inside: the path stays within the frame (never split across a border), rightward clips start on
    the left."""
    rng = np.random.default_rng(0)
    for _ in range(10):
        clip = synthetic.render("square", synthetic.COLORS["green"], synthetic.DIRECTIONS["right"], 9, 32, 32, rng,
                                start="inside")
        fg = (clip != np.asarray(synthetic.BACKGROUND, np.uint8)).any(-1)
        assert not (fg[:, :, 0].any(axis=1) & fg[:, :, -1].any(axis=1)).any()
        assert judge.judge_frames(clip).direction == "right" and _first_and_mean_place(clip)[0][1] < 0
    with pytest.raises(ValueError, match="start must be one of"):
        synthetic.render("square", synthetic.COLORS["green"], (0, 1), 9, 32, 32, rng, start="middle")


def test_a_trail_shows_the_direction_in_every_frame():
    """--trail N: fading copies behind the shape (a moving object's blur): every frame shows which way it
    goes, the judge still reads the colour and direction, and without it only two colours are drawn."""
    colour = synthetic.COLORS["blue"]
    for name, (dy, dx) in synthetic.DIRECTIONS.items():
        plain = synthetic.render("circle", colour, (dy, dx), 9, 32, 32, np.random.default_rng(5))
        trail = synthetic.render("circle", colour, (dy, dx), 9, 32, 32, np.random.default_rng(5), trail=3)
        assert len(np.unique(plain.reshape(-1, 3), axis=0)) == 2
        v = judge.judge_frames(trail)
        assert (v.colour, v.direction) == ("blue", name)
        # the shape itself is where it was; the blends lie behind it (against the motion), never ahead
        shape = (plain == colour).all(-1)
        assert ((trail == colour).all(-1) == shape).all()
        blend = ~shape & (trail != np.asarray(synthetic.BACKGROUND, np.uint8)).any(-1)  # [T, H, W]
        assert blend.any(axis=(1, 2)).all()
        whole = [i for i in range(9) if not (shape[i][[0, -1]].any() or shape[i][:, [0, -1]].any())]
        assert whole
        for i in whole:  # frames where the shape is not split by a border
            ys, xs = np.nonzero(shape[i])
            by, bx = np.nonzero(blend[i])
            behind = (by - ys.mean()) * dy + (bx - xs.mean()) * dx  # < 0: behind the shape
            near = (np.abs(by - ys.mean()) < 12) & (np.abs(bx - xs.mean()) < 12)
            assert (behind[near] < 0).all()


def test_jitter_bounds_where_a_centre_start_begins(tmp_path):
    """--jitter J: a centre start lies within J of the frame's side from its middle (±1 px at 0.03 and 32 px), and
    the clip still travels its caption's way; a jitter outside [0, 0.5] is one line, exit 2."""
    rng = np.random.default_rng(4)
    for d in synthetic.DIRECTIONS:
        for _ in range(10):
            clip = synthetic.render("square", synthetic.COLORS["white"], synthetic.DIRECTIONS[d], 9, 32, 32, rng,
                                    jitter=0.03)
            first, _ = _first_and_mean_place(clip)
            assert np.abs(first).max() <= 0.03 * 32 + 1.0, (d, first)
            assert judge.judge_frames(clip).direction == d
    r = subprocess.run([PYTHON, "-m", "data_tools.synthetic", "--output", str(tmp_path / "d"), "--jitter", "0.7"],
                       cwd=REPO, capture_output=True, text=True)
    expected = ["data_tools.synthetic: --jitter must be in [0, 0.5], got 0.7"]
    assert r.returncode == 2 and r.stderr.strip().splitlines() == expected, r.stderr
    assert not (tmp_path / "d").exists()
