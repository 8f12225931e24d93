"""`python -m data_tools.judge DIR`: do sampled videos of the synthetic set show what their prompts say?

The synthetic set (`data_tools.synthetic`) draws one coloured shape moving in one direction over a
dark background, and its caption names both ("a red circle moving right on a dark background").
This judges a video by its pixels alone:

- colour: the foreground (pixels far from the background colour), its stronger half averaged over
  all frames, matched to the nearest colour of the set's palette;
- motion: the foreground's centroid in every frame (on the circle: the set's frames wrap around its
  borders), a least-squares line through it over the frames; the direction is the dominant axis of
  that line's travel (first to last frame) and its sign. A travel under `MIN_TRAVEL` of the frame's
  side, or frames with no foreground, is "none";
- shape: the foreground's largest piece in every frame. Much longer than wide (`BAR_ELONGATION`), a bar;
  otherwise the nearer, by intersection over union, of a disc and a square of its area at its centroid.
  An oval or a blob that fits both about as well is "unclear". The medians over the frames decide.

The judge is checked on the set's own clips (tests/data_tools/test_judge.py): every 8-frame crop of every
training clip, as drawn and after the demo's 2x pooling, gets its caption's colour, direction and shape.

DIR holds `sample_NNNN.mp4` + `sample_NNNN.json` (what `jaxsora.sample` writes; the sidecar's
`prompt` is the caption judged against). It prints one line per sample and the summary
"samples follow their prompts: colour k/n, motion m/n, shape s/n", and with `--png FILE` draws every sample's
frames in a row beside its prompt and verdict.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys

import numpy as np

from data_tools.stream import HelpFormatter
from data_tools.synthetic import BACKGROUND, COLORS, DIRECTIONS, SHAPES
from jaxsora.cli import ArgumentParser
from jaxsora.errors import BadInput, run_cli

PROG = "data_tools.judge"

# A pixel is foreground when its RGB distance from the background exceeds this (the darkest palette
# colour, blue (50, 90, 240), is ~230 away; codec noise on the background stays under ~20).
FOREGROUND_DISTANCE = 80.0
# Foreground pixels a frame needs for its centroid to count (a 32×32 frame's smallest shape, a bar
# of radius 6 drawn 3 wide, covers ~90 pixels).
MIN_FOREGROUND_PIXELS = 6
# The centroid's travel over the clip, as a fraction of the frame's side along that axis, below which
# the shape is judged not to move. The set's clips travel 0.5 of the frame or more over 12 frames
# (~0.3 over an 8-frame crop); 0.05 is 1.6 px at 32 px.
MIN_TRAVEL = 0.05
# Shape, from the foreground's largest piece in each frame, fitted against the set's shapes. data_tools.synthetic
# draws, at radius r: a disc x² + y² ≤ r², a square of side 2r + 1, a bar 2r + 1 long and 2·(r // 2) + 1 wide across
# the motion.
# - elongation, the piece's longer axis over its shorter (the square root of its second moments' eigenvalues): bars
#   ~2.0 as drawn, 1.76-2.06 after the IdentityVAE's 2x average pooling and nearest upsampling; discs and squares
#   1.00-1.07 as drawn, up to 1.12 pooled (every 8-frame crop of the demo set at r = 6 and r = 10 px). A piece
#   at least BAR_ELONGATION long is a bar; one under ROUND_ELONGATION may be a disc or a square; one between (an oval,
#   a blob stretched by its motion) is none of the three: "unclear".
BAR_ELONGATION = 1.4
ROUND_ELONGATION = 1.25
# - otherwise, the nearer of a disc and a square: each drawn with the piece's area at its centroid, compared by
#   intersection over union with the piece. The set's discs fit a disc 0.84-1.00 and a square 0.74-0.88, its squares
#   0.83-0.88 and 0.89-1.00 (pooled at r = 6: the closest pair). Where the two fits are within SHAPE_MARGIN of each
#   other the piece is a blob between the two: "unclear". (Before, a bounding box's fill read the shape: a sampled
#   square with a 2-pixel bump on one side filled its box as a circle does, and every blob was a "circle".)
SHAPE_MARGIN = 0.03

_CAPTION = re.compile(r"\ba (?P<colour>\w+) (?P<shape>\w+)(?: moving (?P<direction>\w+))?")


@dataclasses.dataclass(frozen=True)
class Verdict:
    colour: str | None  # nearest palette colour of the foreground (None: no foreground)
    direction: str  # "right" | "left" | "down" | "up" | "none"
    travel: tuple  # (dy, dx) of the fitted centroid line, first to last frame, in pixels
    shape: str | None = None  # "circle" | "square" | "bar" | "unclear" (None: no frame with enough foreground)
    fit: tuple = (0.0, 0.0, 0.0)  # (elongation, disc fit, square fit) of the largest piece, medians over frames


def parse_caption(text: str) -> dict:
    """The colour, shape and direction a caption of the synthetic set names (None where absent)."""
    m = _CAPTION.search(text.lower())
    if not m or m["colour"] not in COLORS or m["shape"] not in SHAPES:
        return dict(colour=None, shape=None, direction=None)
    direction = m["direction"] if m["direction"] in DIRECTIONS else None
    return dict(colour=m["colour"], shape=m["shape"], direction=direction)


def _circular_centroid(fg: np.ndarray, axis: int) -> np.ndarray:
    """fg [T, H, W] bool → [T] centroid along `axis` (1: rows, 2: columns), taken on the circle (the
    synthetic set's frames wrap around: a shape crossing a border is split in two), unwrapped over the
    frames so that a shape leaving one border and coming back at the other moves on continuously. For
    a compact shape away from the borders it is the plain centroid."""
    size = fg.shape[axis]
    angle = 2 * np.pi * np.arange(size) / size
    shape = [1, 1, 1]
    shape[axis] = size
    s = (fg * np.sin(angle).reshape(shape)).sum(axis=(1, 2))
    c = (fg * np.cos(angle).reshape(shape)).sum(axis=(1, 2))
    return np.unwrap(np.arctan2(s, c)) * size / (2 * np.pi)


def background_distance(frames: np.ndarray) -> np.ndarray:
    """frames [T, H, W, 3] (uint8 or float in 0..255) → [T, H, W]: each pixel's RGB distance from the background
    colour (foreground where > FOREGROUND_DISTANCE)."""
    return np.linalg.norm(np.asarray(frames, np.float32) - np.asarray(BACKGROUND, np.float32), axis=-1)


def largest_piece(fg: np.ndarray, cy: float, cx: float) -> np.ndarray:
    """fg [H, W] bool (a frame's foreground, not empty), (cy, cx) its circular centroid → [H, W] bool: its largest
    4-connected piece, the frame first rolled so that the centroid sits at its middle (a shape that the wrapping
    frame splits across a border is whole again)."""
    from scipy import ndimage

    h, w = fg.shape
    fg = np.roll(fg, (int(round(h / 2 - cy % h)), int(round(w / 2 - cx % w))), axis=(0, 1))
    labels, n = ndimage.label(fg)
    return labels == 1 + int(np.argmax(np.bincount(labels.ravel())[1:])) if n > 1 else fg


def _fit(fg: np.ndarray, cy: float, cx: float) -> tuple[float, float, float]:
    """fg [H, W] bool (a frame's foreground, not empty), (cy, cx) its circular centroid → (elongation, fit to a
    disc, fit to a square) of its `largest_piece` (see BAR_ELONGATION)."""
    h, w = fg.shape
    fg = largest_piece(fg, cy, cx)
    ys, xs = np.nonzero(fg)
    my, mx = ys.mean(), xs.mean()
    low, high = np.linalg.eigvalsh(np.cov(np.stack([ys, xs]).astype(np.float64))) if len(ys) > 1 else (0.0, 0.0)
    elongation = float(np.sqrt((high + 1e-9) / (low + 1e-9)))  # a one-pixel-wide line: very long; one pixel: 1
    yy, xx = np.mgrid[0:h, 0:w]
    area = float(fg.sum())
    disc = (yy - my) ** 2 + (xx - mx) ** 2 <= area / np.pi
    half = np.sqrt(area) / 2
    square = (np.abs(yy - my) <= half) & (np.abs(xx - mx) <= half)

    def iou(a):
        return float((a & fg).sum()) / float((a | fg).sum())

    return elongation, iou(disc), iou(square)


def shape_of(elongation: float, disc: float, square: float) -> str:
    """The set's shape a piece of this elongation and these fits (intersection over union with a disc and with a
    square of its area) shows, or "unclear" (see BAR_ELONGATION, ROUND_ELONGATION, SHAPE_MARGIN)."""
    if elongation >= BAR_ELONGATION:
        return "bar"
    if elongation >= ROUND_ELONGATION or abs(square - disc) < SHAPE_MARGIN:
        return "unclear"
    return "square" if square > disc else "circle"


def judge_frames(frames: np.ndarray) -> Verdict:
    """frames: [T, H, W, 3] uint8 (or float in 0..255) → the colour, motion and shape they show."""
    f = np.asarray(frames, np.float32)
    if f.ndim != 4 or f.shape[-1] != 3:
        raise ValueError(f"expected frames [T, H, W, 3], got {f.shape}")
    t, h, w, _ = f.shape
    dist = background_distance(f)  # [T, H, W]
    fg = dist > FOREGROUND_DISTANCE
    if not fg.any():
        return Verdict(None, "none", (0.0, 0.0))
    # the colour of the strongest half of the foreground: a motion trail or a soft edge, blended with the
    # background, would pull the mean toward it
    mean_rgb = f[fg & (dist >= np.median(dist[fg]))].mean(axis=0)
    names = list(COLORS)
    palette = np.asarray([COLORS[n] for n in names], np.float32)
    colour = names[int(np.argmin(np.linalg.norm(palette - mean_rgb, axis=1)))]

    counts = fg.sum(axis=(1, 2))
    ok = counts >= MIN_FOREGROUND_PIXELS
    shape, fit = None, (0.0, 0.0, 0.0)
    if ok.any():
        cy, cx = _circular_centroid(fg[ok], axis=1), _circular_centroid(fg[ok], axis=2)
        fit = tuple(float(v) for v in np.median(np.asarray([_fit(*a) for a in zip(fg[ok], cy, cx)]), axis=0))
        shape = shape_of(*fit)
    if t < 2 or ok.sum() < 2:
        return Verdict(colour, "none", (0.0, 0.0), shape, fit)
    frames_idx = np.arange(t, dtype=np.float32)[ok]
    span = float(t - 1)
    dy = float(np.polyfit(frames_idx, cy, 1)[0]) * span
    dx = float(np.polyfit(frames_idx, cx, 1)[0]) * span
    if max(abs(dy) / h, abs(dx) / w) < MIN_TRAVEL:
        return Verdict(colour, "none", (dy, dx), shape, fit)
    horizontal = abs(dx) / w >= abs(dy) / h
    direction = ("right" if dx > 0 else "left") if horizontal else ("down" if dy > 0 else "up")
    return Verdict(colour, direction, (dy, dx), shape, fit)


def read_video(path: str) -> np.ndarray:
    """Every frame of a video (or the one frame of an image) as [T, H, W, 3] uint8."""
    if not path.lower().endswith((".mp4", ".mkv", ".mov", ".avi", ".webm")):
        from PIL import Image

        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))[None]
    import av

    with av.open(path) as container:
        frames = [fr.to_ndarray(format="rgb24") for fr in container.decode(video=0)]
    if not frames:
        raise BadInput(f"{path}: no frames")
    return np.stack(frames)


@dataclasses.dataclass
class Judged:
    path: str
    prompt: str
    frames: np.ndarray
    verdict: Verdict
    asked: dict

    @property
    def colour_ok(self) -> bool:
        return self.asked["colour"] is not None and self.verdict.colour == self.asked["colour"]

    @property
    def motion_ok(self) -> bool:
        return self.asked["direction"] is not None and self.verdict.direction == self.asked["direction"]

    @property
    def shape_ok(self) -> bool:
        return self.asked["shape"] is not None and self.verdict.shape == self.asked["shape"]


def judge_folder(folder: str) -> list[Judged]:
    """Every `sample_*.{mp4,png}` in `folder` (not its subfolders) with its sidecar's prompt."""
    sidecars = sorted(glob.glob(os.path.join(folder, "sample_*.json")))
    out = []
    for side in sidecars:
        stem = side[: -len(".json")]
        media = next((stem + ext for ext in (".mp4", ".png") if os.path.exists(stem + ext)), None)
        if media is None:
            continue
        with open(side) as fh:
            meta = json.load(fh)
        prompt = meta.get("prompt") or meta.get("prompt_as_given") or ""
        frames = read_video(media)
        out.append(Judged(media, prompt, frames, judge_frames(frames), parse_caption(prompt)))
    return out


def summary(judged: list[Judged]) -> str:
    """"samples follow their prompts: colour k/n, motion m/n, shape s/n" (motion over prompts naming one)."""
    n_col = sum(j.asked["colour"] is not None for j in judged)
    n_mot = sum(j.asked["direction"] is not None for j in judged)
    n_shp = sum(j.asked["shape"] is not None for j in judged)
    k = sum(j.colour_ok for j in judged)
    m = sum(j.motion_ok for j in judged)
    s = sum(j.shape_ok for j in judged)
    return f"samples follow their prompts: colour {k}/{n_col}, motion {m}/{n_mot}, shape {s}/{n_shp}"


def draw_grid(judged: list[Judged], path: str, scale: int = 3) -> str:
    """A PNG: one row per sample, its prompt and verdict on the left, its frames to the right."""
    from PIL import Image, ImageDraw

    if not judged:
        raise BadInput("no samples to draw")
    max_t = max(j.frames.shape[0] for j in judged)
    fh, fw = max(j.frames.shape[1] for j in judged) * scale, max(j.frames.shape[2] for j in judged) * scale
    text_w, gap, line = 330, 4, 14
    row_h = max(fh, 4 * line) + gap
    img = Image.new("RGB", (text_w + max_t * (fw + gap), len(judged) * row_h + gap), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    ok_ink, no_ink = (0, 110, 0), (180, 0, 0)
    for r, j in enumerate(judged):
        y = gap + r * row_h
        draw.text((4, y + 2), j.prompt.replace(" on a dark background", ""), fill=(0, 0, 0))
        # one line per word judged, green where the sample shows what its prompt asks
        for k, (word, ok, shows) in enumerate((("colour", j.colour_ok, j.verdict.colour),
                                               ("shape", j.shape_ok, j.verdict.shape),
                                               ("motion", j.motion_ok, j.verdict.direction))):
            draw.text((4, y + 2 + (k + 1) * line), f"{word} {'ok' if ok else 'NO'} ({shows})",
                      fill=ok_ink if ok else no_ink)
        for i, frame in enumerate(j.frames):
            tile = Image.fromarray(np.asarray(frame, np.uint8)).resize(
                (frame.shape[1] * scale, frame.shape[0] * scale), Image.NEAREST)
            img.paste(tile, (text_w + i * (fw + gap), y))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    img.save(path)
    return path


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m data_tools.judge", description=__doc__,
                        formatter_class=HelpFormatter)
    ap.add_argument("input", metavar="DIR", help="folder of sample_NNNN.mp4 + .json (jaxsora.sample --output)")
    ap.add_argument("--png", metavar="FILE", help="write a picture of every sample's frames beside its prompt")
    ap.add_argument("--quiet", action="store_true", help="print the summary line only")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    args = ap.parse_args(argv)
    return run_cli(PROG, lambda: _main(args), sys.argv if argv is None else list(argv))


def _main(args) -> int:
    if not os.path.isdir(args.input):
        raise BadInput(f"{args.input}: no such folder")
    judged = judge_folder(args.input)
    if not judged:
        raise BadInput(f"{args.input}: no sample_NNNN.mp4/.png with a .json sidecar")
    if not args.quiet:
        for j in judged:
            dy, dx = j.verdict.travel
            e, disc, square = j.verdict.fit
            print(f"{os.path.relpath(j.path, args.input)}: asked {j.asked['colour']} {j.asked['shape']} "
                  f"{j.asked['direction']}, shows {j.verdict.colour} {j.verdict.shape} {j.verdict.direction} "
                  f"(travel dy {dy:+.1f} dx {dx:+.1f} px; elongation {e:.2f}, "
                  f"fits a disc {disc:.2f}, a square {square:.2f})")
    if args.png:
        print(f"frames → {draw_grid(judged, args.png)}")
    print(summary(judged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
