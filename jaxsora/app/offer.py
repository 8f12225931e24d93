"""What the page offers for one checkpoint, and a page request as `SampleSettings` (plain Python, no JAX, no Gradio).

A run's checkpoint offers what its run trained on: the resolutions of its `data.bucket_config` (a keep
probability above 0), in each the aspect ratios of that resolution's table and the clip lengths of its buckets
(1 frame: "image"). The demo's table (`demo32`, one 32×32 entry, 1- and 8-frame buckets) so offers 32×32 images
and 8-frame clips and no 720p. A checkpoint without a run config (a `convert from-torch` output) offers what
Open-Sora 1.2's own app does (`gradio/app.py`): 144p to 720p, five aspect ratios, an image or 2 s to 16 s.

The aesthetic score is offered unless the run's `sample` section sets `aes` to None (its captions carry none:
the demo's), and the motion score and the camera motion (both from Open-Sora's motion annotations) unless it
sets `flow` to None.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxsora.data.aspect import ASPECT_RATIO_MAP, NUM_FRAMES_MAP, resolution_tables
from jaxsora.data.buckets import normalize_bucket_config
from jaxsora.errors import BadInput
from jaxsora.infer.options import SampleSettings

# Open-Sora 1.2's gradio/app.py: its resolution, aspect-ratio, length and camera-motion choices.
OPEN_SORA_RESOLUTIONS = ("144p", "240p", "360p", "480p", "720p")
OPEN_SORA_ASPECT_RATIOS = ("9:16", "16:9", "3:4", "4:3", "1:1")
OPEN_SORA_LENGTHS = (1, 51, 102, 204, 408)  # an image, 2s, 4s, 8s, 16s
CAMERA_MOTIONS = ("none", "pan right", "pan left", "tilt up", "tilt down", "zoom in", "zoom out", "static")
IMAGE = "image"
# 51 → "2s", ...: the duration names of NUM_FRAMES_MAP (its "1x"... names count the same frames)
SECONDS = {n: name for name, n in NUM_FRAMES_MAP.items() if name.endswith("s")}


def length_name(frames: int) -> str:
    """1 → "image", 51 → "2s", 8 → "8 frames"."""
    return IMAGE if frames == 1 else SECONDS.get(frames, f"{frames} frames")


def parse_length(text) -> int:
    """A length as the page gives it (a choice or typed): "image", "2s", "8 frames", "8" → frames."""
    t = str(text if text is not None else "").strip().lower()
    if t == IMAGE:
        return 1
    if t in NUM_FRAMES_MAP:
        return NUM_FRAMES_MAP[t]
    t = t.removesuffix("frames").removesuffix("frame").strip()
    if not t.isdigit() or int(t) < 1:
        raise BadInput(f"length {text!r}: give {IMAGE!r}, a duration such as 2s or a number of frames")
    return int(t)


def aspect_names(table: Mapping) -> list[str]:
    """The aspect ratios offered for a resolution's table {H/W key: (H, W)}: Open-Sora's app's five where the
    table has them, else every h:w name it has, else its raw keys."""
    named = [n for n in OPEN_SORA_ASPECT_RATIOS if ASPECT_RATIO_MAP[n] in table]
    return named or [n for n, k in ASPECT_RATIO_MAP.items() if k in table] or list(table)


@dataclasses.dataclass
class Offer:
    """resolutions: name → the aspect-ratio names offered; lengths: resolution → frame counts (1 = image),
    ascending; aes / motion: whether the aesthetic score / the motion score and camera motion are offered;
    source: where the choices come from (said on the page)."""
    resolutions: dict[str, list[str]]
    lengths: dict[str, list[int]]
    aes: bool = True
    motion: bool = True
    source: str = "Open-Sora 1.2's app"
    extra_resolutions: dict | None = None  # the run's own resolution tables (`data.resolutions`)

    def length_names(self, resolution: str) -> list[str]:
        return [length_name(n) for n in self.lengths.get(resolution, [])]

    def max_frames(self, resolution: str) -> int:
        return max(self.lengths.get(resolution) or [1])

    def size(self, resolution: str, aspect_ratio: str) -> tuple[int, int]:
        from jaxsora.infer.options import get_image_size

        return get_image_size(resolution, aspect_ratio, self.extra_resolutions)

    def find(self, height: int, width: int) -> tuple[str, str] | None:
        """The offered (resolution, aspect ratio) of that size, if any."""
        for res, names in self.resolutions.items():
            for name in names:
                if self.size(res, name) == (height, width):
                    return res, name
        return None


def offer_for(run_config: Mapping | None) -> Offer:
    """What a checkpoint with this run config (None: converted, no config) can serve (the module docstring)."""
    data = dict((run_config or {}).get("data") or {})
    sample = dict((run_config or {}).get("sample") or {})
    extra = {str(k): dict(v) for k, v in dict(data.get("resolutions") or {}).items()} or None
    tables = resolution_tables(extra)
    aes = not ("aes" in sample and sample["aes"] is None)
    motion = not ("flow" in sample and sample["flow"] is None)
    buckets = normalize_bucket_config(data["bucket_config"]) if data.get("bucket_config") else {}
    resolutions, lengths = {}, {}
    for res, frames in buckets.items():
        trained = sorted(f for f, (prob, bs) in frames.items()
                         if bs is not None and max(prob if isinstance(prob, tuple) else (prob,)) > 0)
        if trained and res in tables:
            resolutions[res] = aspect_names(tables[res][1])
            lengths[res] = trained
    if resolutions:
        return Offer(resolutions, lengths, aes, motion, "the run's buckets (data.bucket_config)", extra)
    return Offer({r: list(OPEN_SORA_ASPECT_RATIOS) for r in OPEN_SORA_RESOLUTIONS},
                 {r: list(OPEN_SORA_LENGTHS) for r in OPEN_SORA_RESOLUTIONS}, aes, motion, "Open-Sora 1.2's app", extra)


@dataclasses.dataclass
class Request:
    """One press of the page's generate button, as the page gives it (numbers may come as floats)."""
    prompt: str
    resolution: str
    aspect_ratio: str
    length: str
    seed: float = 42
    steps: float = 30
    cfg_scale: float = 7.0
    aes: float | None = None          # None: not appended (switched off or not offered)
    flow: float | None = None
    camera_motion: str | None = None  # None / "none": not appended
    reference: str | None = None      # an uploaded image or video (a path on the server)
    mask_strategy: str = "0"          # with a reference; "0": it is the first frame
    loop: float = 1
    fps: float | None = None


def _whole(value, name: str, least: int = 1) -> int:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"{name} must be a whole number, got {value!r}") from None
    if f != int(f) or f < least:
        raise BadInput(f"{name} must be a whole number of at least {least}, got {value!r}")
    return int(f)


def settings_for(request: Request, offer: Offer, base: SampleSettings) -> SampleSettings:
    """The SampleSettings of a request, `base` (the page's defaults: fps, ...) for what the page does not set.
    A request the checkpoint cannot serve — an empty prompt, a choice not offered, more frames than it was
    trained on — is a BadInput saying so."""
    prompt = str(request.prompt or "").strip()
    if not prompt:
        raise BadInput("the prompt is empty: describe the video to make")
    if request.resolution not in offer.resolutions:
        raise BadInput(f"resolution {request.resolution!r} is not one this checkpoint serves "
                       f"({', '.join(offer.resolutions)})")
    if request.aspect_ratio not in offer.resolutions[request.resolution]:
        raise BadInput(f"aspect ratio {request.aspect_ratio!r} is not offered at {request.resolution} "
                       f"({', '.join(offer.resolutions[request.resolution])})")
    frames = parse_length(request.length)
    most = offer.max_frames(request.resolution)
    if frames > most:
        raise BadInput(f"{frames} frames is more than this checkpoint takes at {request.resolution}: it was trained "
                       f"on {', '.join(offer.length_names(request.resolution))} (at most {most} frames)")
    reference = request.reference or None
    if reference and frames == 1 and str(request.mask_strategy or "0").strip() not in ("", "0"):
        raise BadInput("an image has one frame: its reference can only be that frame (mask strategy 0)")
    video = frames > 1  # Open-Sora's app: the motion score and the camera motion for videos only
    camera = request.camera_motion if request.camera_motion not in (None, "", "none") else None
    offer.size(request.resolution, request.aspect_ratio)  # a table without that aspect ratio: BadInput
    return base.replace(
        image_size=None, resolution=request.resolution, aspect_ratio=request.aspect_ratio, num_frames=frames,
        seed=_whole(request.seed, "seed", 0), num_sampling_steps=_whole(request.steps, "steps"),
        cfg_scale=float(request.cfg_scale), aes=request.aes if offer.aes else None,
        flow=request.flow if offer.motion and video else None, camera_motion=camera if offer.motion and video else None,
        reference_path=reference, mask_strategy=(str(request.mask_strategy or "0").strip() or "0") if reference
        else None, loop=_whole(request.loop, "loops"), batch_size=1,
        fps=float(request.fps) if request.fps else base.fps)
