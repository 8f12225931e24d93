"""Open-Sora 1.2's inference options as plain Python (no JAX): settings, sizes, durations, prompts
and mask strategies (`scripts/inference.py`, `opensora/utils/inference_utils.py`
and `opensora/datasets/aspect.py` at ee909a7).

Everything here is what the reference does, with its names; where a user mistake would crash the
reference with an assertion or an IndexError, it is a `BadInput` (one line, exit code 2) here.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxsora.data.aspect import ASPECT_RATIO_MAP, NUM_FRAMES_MAP, resolution_tables
from jaxsora.errors import BadInput

# Open-Sora 1.2 (opensora/datasets/utils.py): images are fed fps 120.
IMG_FPS = 120
# parse_mask_strategy's defaults for the 6 fields: loop_id, ref_id, ref_start, target_start, length, edit_ratio.
MASK_DEFAULT = ("0", "0", "0", "0", "1", "0")


# --------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SampleSettings:
    """What to sample; defaults are Open-Sora 1.2's inference config
    (`configs/opensora-v1-2/inference/sample.py`).

    resolution/aspect_ratio: Open-Sora names ("240p", "9:16" or a raw H/W key "0.56"), used unless
        image_size = (H, W) is given. num_frames: a count or a duration name ("2s" = 51, "4s" = 102,
        "8s" = 204, "16s" = 408, "1x"... as NUM_FRAMES_MAP). fps: what the model is told (120 for a
        single frame, as the reference) and the mp4's rate (unless save_fps).
    aes/flow/camera_motion: appended to each prompt as " aesthetic score: 6.5." etc. unless the
        prompt has one already (None: nothing appended).
    seed: the noise of each prompt comes from (seed, prompt text, occurrence of that text in the
        list) only — see `jaxsora.infer.conditioning.prompt_key`.
    reference_path / mask_strategy: one string for every prompt or one per prompt (Open-Sora's
        syntax: paths separated by ";", groups "loop,ref,ref_start,target_start,length,edit" by ";").
    loop / condition_frame_length / condition_frame_edit: video extension by loops, each conditioned
        on the previous clip's last `condition_frame_length` latent frames.
    align: snap mask-strategy starts to multiples of this many latent frames; None = the VAE's chunk
        (5 for the OpenSora VAE, as Open-Sora's align=5; 1 — no snapping — for the pixel-space VAE).
    """

    resolution: str = "240p"
    aspect_ratio: str = "9:16"
    image_size: tuple | None = None
    num_frames: int | str = 51
    fps: float = 24
    num_sampling_steps: int = 30
    cfg_scale: float = 7.0
    aes: float | None = 6.5
    flow: float | None = None
    seed: int = 42
    batch_size: int = 1
    reference_path: None | str | Sequence[str] = None
    mask_strategy: None | str | Sequence[str] = None
    loop: int = 1
    condition_frame_length: int = 5
    # --- beyond the server's list (Open-Sora config keys too) ---
    camera_motion: str | None = None
    condition_frame_edit: float = 0.0
    align: int | None = None
    save_fps: float | None = None

    def replace(self, **changes) -> SampleSettings:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("image_size", "reference_path", "mask_strategy"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d

    def in_effect(self) -> dict:
        """`to_dict()` less the settings this one does not use: with `image_size` given, the named
        resolution and aspect ratio (a sample's sidecar records what made it, not unused defaults)."""
        d = self.to_dict()
        if self.image_size is not None:
            d.pop("resolution")
            d.pop("aspect_ratio")
        return d

    def validate(self, extra_resolutions: Mapping | None = None) -> Resolved:
        """Check every value; returns the resolved sizes. Raises BadInput naming the setting."""
        h, w = get_image_size(self.resolution, self.aspect_ratio, extra_resolutions) if self.image_size is None \
            else _image_size(self.image_size)
        t = get_num_frames(self.num_frames)
        for name in ("num_sampling_steps", "batch_size", "loop"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadInput(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.condition_frame_length, int) or self.condition_frame_length < 1:
            raise BadInput(f"condition_frame_length must be a positive integer, got {self.condition_frame_length!r}")
        if self.align is not None and (not isinstance(self.align, int) or self.align < 1):
            raise BadInput(f"align must be a positive integer (or None: the VAE's chunk), got {self.align!r}")
        for name in ("fps", "cfg_scale", "condition_frame_edit") + (("save_fps",) if self.save_fps is not None else ()):
            try:
                float(getattr(self, name))
            except (TypeError, ValueError):
                raise BadInput(f"{name} must be a number, got {getattr(self, name)!r}") from None
        if float(self.fps) <= 0 or (self.save_fps is not None and float(self.save_fps) <= 0):
            raise BadInput(f"fps must be positive, got {self.fps!r}")
        if not 0.0 <= float(self.condition_frame_edit) <= 1.0:
            raise BadInput(f"condition_frame_edit must lie in [0, 1], got {self.condition_frame_edit!r}")
        for name in ("aes", "flow"):
            v = getattr(self, name)
            if v is not None:
                try:
                    float(v)
                except (TypeError, ValueError):
                    raise BadInput(f"{name} must be a number or None, got {v!r}") from None
        try:
            int(self.seed)
        except (TypeError, ValueError):
            raise BadInput(f"seed must be an integer, got {self.seed!r}") from None
        return Resolved(height=h, width=w, num_frames=t)


def default_settings(run_config: Mapping | None = None, **overrides) -> SampleSettings:
    """SampleSettings with the run config's `sample` section (height/width, num_frames, fps, and
    aes/flow/cfg_scale when it names them) in place of Open-Sora's defaults, then `overrides`."""
    s = dict((run_config or {}).get("sample") or {})
    kw: dict[str, Any] = {}
    if s.get("height") and s.get("width"):
        kw["image_size"] = (int(s["height"]), int(s["width"]))
    for k in ("num_frames", "fps", "aes", "flow", "cfg_scale"):
        if k in s:
            kw[k] = s[k]
    kw.update(overrides)
    return SampleSettings(**kw)


@dataclasses.dataclass(frozen=True)
class Resolved:
    height: int
    width: int
    num_frames: int


def _image_size(size) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in size)
    except (TypeError, ValueError):
        raise BadInput(f"image_size must be two integers (H, W), got {size!r}") from None
    if h < 1 or w < 1:
        raise BadInput(f"image_size must be positive, got {h}×{w}")
    return h, w


# --------------------------------------------------------------------------------------------
# sizes and durations (opensora/datasets/aspect.py)
# --------------------------------------------------------------------------------------------
def get_image_size(resolution: str, aspect_ratio: str, extra_resolutions: Mapping | None = None) -> tuple[int, int]:
    """(H, W) of a resolution name and an aspect ratio, as the reference's `get_image_size`: an
    "h:w" name goes through ASPECT_RATIO_MAP to its H/W key ("9:16" → "0.56" → 240p: 240×426,
    i.e. landscape), anything else is taken as a key itself ("0.56"). `extra_resolutions`: a run's
    custom tables {name: {key: (H, W)}} (e.g. the demo's "demo32")."""
    tables = resolution_tables(_as_tables(extra_resolutions))
    if resolution not in tables:
        raise BadInput(f"unknown resolution {resolution!r}; Open-Sora's names: {', '.join(tables)}")
    key = ASPECT_RATIO_MAP.get(str(aspect_ratio), str(aspect_ratio))
    table = tables[resolution][1]
    if key not in table:
        names = [n for n, k in ASPECT_RATIO_MAP.items() if k in table]
        raise BadInput(f"aspect ratio {aspect_ratio!r} not found for resolution {resolution!r}; use one of "
                       f"{', '.join(names) or 'its keys'} (h:w) or a key: {', '.join(table)}")
    h, w = table[key]
    return int(h), int(w)


def _as_tables(extra) -> dict | None:
    """A run config's `data.resolutions` ({name: [(key, (H, W)), ...]} or {name: {key: (H, W)}})."""
    if not extra:
        return None
    return {str(name): dict(table) for name, table in dict(extra).items()}


def get_num_frames(num_frames: int | str) -> int:
    """A frame count from an int or a name: NUM_FRAMES_MAP ("2s" = 51, "4s" = 102, "8s" = 204,
    "16s" = 408, "32s" = 816, "1x" = 51, "2x" = 102, ...), else int(...) as the reference."""
    if isinstance(num_frames, str) and num_frames in NUM_FRAMES_MAP:
        return NUM_FRAMES_MAP[num_frames]
    try:
        n = int(num_frames)
    except (TypeError, ValueError):
        raise BadInput(f"num_frames must be a count or one of {', '.join(NUM_FRAMES_MAP)}, got {num_frames!r}") \
            from None
    if isinstance(num_frames, float) and n != num_frames:
        raise BadInput(f"num_frames must be a whole number, got {num_frames!r}")
    if n < 1:
        raise BadInput(f"num_frames must be at least 1, got {n}")
    return n


# --------------------------------------------------------------------------------------------
# prompts (inference_utils.py)
# --------------------------------------------------------------------------------------------
def append_score_to_prompts(prompts: Sequence[str], aes=None, flow=None, camera_motion=None) -> list[str]:
    """" aesthetic score: {aes:.1f}.", " motion score: {flow:.1f}.", " camera motion: {cm}." appended
    to each prompt that does not have one yet (the reference's `append_score_to_prompts`)."""
    out = []
    for prompt in prompts:
        new = prompt
        if aes is not None and "aesthetic score:" not in prompt:
            new = f"{new} aesthetic score: {float(aes):.1f}."
        if flow is not None and "motion score:" not in prompt:
            new = f"{new} motion score: {float(flow):.1f}."
        if camera_motion is not None and "camera motion:" not in prompt:
            new = f"{new} camera motion: {camera_motion}."
        out.append(new)
    return out


def split_prompt(prompt: str) -> tuple[list[str], list[int] | None]:
    """"|0| a |2| b" → (["a", "b"], [0, 2]); a plain prompt → ([prompt], None)."""
    if not prompt.startswith("|0|"):
        return [prompt], None
    parts = prompt.split("|")[1:]
    if len(parts) % 2:
        raise BadInput(f"loop prompt {prompt!r}: expected '|0| text |n| text ...'")
    texts, loops = [], []
    for i in range(0, len(parts), 2):
        try:
            loops.append(int(parts[i]))
        except ValueError:
            raise BadInput(f"loop prompt {prompt!r}: {parts[i]!r} is not a loop index") from None
        texts.append(parts[i + 1].strip())
    if loops != sorted(loops):
        raise BadInput(f"loop prompt {prompt!r}: loop indices must increase")
    return texts, loops


def merge_prompt(texts: Sequence[str], loops: Sequence[int] | None = None) -> str:
    if loops is None:
        return texts[0]
    return "".join(f"|{i}|{t}" for t, i in zip(texts, loops))


def extract_prompt_loop(prompt: str, loop_i: int) -> str:
    """The text of loop `loop_i` of a "|0| a |2| b" prompt (the reference's extract_prompts_loop);
    a plain prompt is the same for every loop."""
    if not prompt.startswith("|0|"):
        return prompt
    parts = prompt.split("|")[1:]
    texts = []
    for i in range(0, len(parts), 2):
        start = int(parts[i])
        end = int(parts[i + 2]) if i + 2 < len(parts) else loop_i + 1
        texts.extend([parts[i + 1]] * (end - start))
    return texts[loop_i]


def extract_json(prompt: str) -> tuple[str, dict]:
    """'text{"reference_path": ..., "mask_strategy": ...}' → (text, {those keys}), as the reference's
    extract_json_from_prompts."""
    parts = re.split(r"(?=[{])", prompt)
    if len(parts) > 2:
        raise BadInput(f"invalid prompt {prompt!r}: more than one {{...}} part")
    if len(parts) == 1:
        return prompt, {}
    try:
        info = json.loads(parts[1])
    except ValueError as e:
        raise BadInput(f"prompt {prompt!r}: the {{...}} part is not JSON ({e})") from None
    if not isinstance(info, dict):
        raise BadInput(f"prompt {prompt!r}: the {{...}} part must be an object")
    bad = sorted(set(info) - {"reference_path", "mask_strategy"})
    if bad:
        raise BadInput(f"prompt {prompt!r}: invalid key(s) {bad}; allowed: reference_path, mask_strategy")
    return parts[0], info


def prepare_prompt(text: str, aes=None, flow=None, camera_motion=None) -> str:
    """The text the encoder gets (as `scripts/inference.py`: split loops, append scores, merge).
    Open-Sora also cleans and lower-cases it (T5's `text_preprocessing`); jaxsora does not, as its
    training captions are not cleaned either."""
    texts, loops = split_prompt(text)
    return merge_prompt(append_score_to_prompts(texts, aes, flow, camera_motion), loops)


def per_prompt(value, n: int, name: str) -> list[str]:
    """One string for every prompt, or a list with one per prompt → list of n strings ("" = none)."""
    if value is None:
        return [""] * n
    if isinstance(value, str):
        return [value] * n
    values = ["" if v is None else str(v) for v in value]
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise BadInput(f"{name}: give one for every prompt or one per prompt ({n}), got {len(values)}")
    return values


# --------------------------------------------------------------------------------------------
# mask strategy (inference_utils.py)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MaskGroup:
    loop_id: int
    ref_id: int
    ref_start: int
    target_start: int
    length: int
    edit_ratio: float


def parse_mask_strategy(mask_strategy: str | None) -> list[MaskGroup]:
    """"0" → [MaskGroup(0, 0, 0, 0, 1, 0.0)]: ";"-separated groups of 1–6 comma fields,
    `loop_id, ref_id, ref_start, target_start, length, edit_ratio`, missing ones from
    MASK_DEFAULT (0, 0, 0, 0, 1, 0). The first five are ints, edit_ratio a float in [0, 1]."""
    if mask_strategy is None or mask_strategy == "":
        return []
    groups = []
    for group in str(mask_strategy).split(";"):
        fields = [f.strip() for f in group.split(",")]
        if not 1 <= len(fields) <= 6:
            raise BadInput(f"mask strategy {mask_strategy!r}: group {group!r} has {len(fields)} fields; a group is "
                           "1 to 6 of loop_id,ref_id,ref_start,target_start,length,edit_ratio")
        fields += list(MASK_DEFAULT[len(fields):])
        try:
            ints = [int(f) for f in fields[:5]]
            edit = float(fields[5])
        except ValueError:
            raise BadInput(f"mask strategy {mask_strategy!r}: group {group!r} is not "
                           "loop_id,ref_id,ref_start,target_start,length (integers),edit_ratio (a number)") from None
        if ints[0] < 0 or ints[1] < 0 or ints[4] < 0 or not 0.0 <= edit <= 1.0:
            raise BadInput(f"mask strategy {mask_strategy!r}: group {group!r}: loop_id, ref_id and length must be "
                           "≥ 0 and edit_ratio in [0, 1]")
        groups.append(MaskGroup(*ints, edit))
    return groups


def find_nearest_point(value: int, point: int, max_value: int) -> int:
    """The reference's alignment: round `value` to a multiple of `point`, rounding up only when the
    remainder is more than half and the result stays below the last full multiple of `max_value`."""
    t = value // point
    if value % point > point / 2 and t < max_value // point - 1:
        t += 1
    return t * point


def place_group(group: MaskGroup, ref_frames: int, z_frames: int, align: int | None) -> tuple[int, int, int]:
    """(ref_start, target_start, length) of one group for a reference of `ref_frames` latent frames
    and a sample of `z_frames`, as `apply_mask_strategy`: negative starts count from the end, then
    (align) snap with `find_nearest_point`, length = min(length, frames left in z, in the ref).
    A start outside its clip is a BadInput (the reference would silently slice from the end)."""
    ref_start, target_start = group.ref_start, group.target_start
    if ref_start < 0:
        ref_start += ref_frames
    if target_start < 0:
        target_start += z_frames
    if align is not None:
        ref_start = find_nearest_point(ref_start, align, ref_frames)
        target_start = find_nearest_point(target_start, align, z_frames)
    if not 0 <= ref_start < ref_frames or not 0 <= target_start < z_frames:
        raise BadInput(f"mask strategy group {group}: start outside the clip (reference start {ref_start} of "
                       f"{ref_frames} latent frames, target start {target_start} of {z_frames})")
    length = max(0, min(group.length, z_frames - target_start, ref_frames - ref_start))
    return ref_start, target_start, length


def check_references(mask_strategy: str, reference_path: str, loop: int, where: str = "") -> None:
    """Every group's ref_id names one of the prompt's ";"-separated references (loop > 0 groups may
    also name the clips the loops append, which come after them)."""
    groups = parse_mask_strategy(mask_strategy)
    refs = [p for p in reference_path.split(";")] if reference_path else []
    for g in groups:
        extra = g.loop_id  # loop i has appended i generated clips by the time it runs
        if g.ref_id >= len(refs) + extra:
            raise BadInput(f"mask strategy {mask_strategy!r}{where}: group {g} uses reference {g.ref_id}, but there "
                           f"{'is' if len(refs) == 1 else 'are'} {len(refs)} reference path(s)"
                           + (" (give --reference-path)" if not refs else ""))
        if g.loop_id >= loop:
            raise BadInput(f"mask strategy {mask_strategy!r}{where}: group {g} is for loop {g.loop_id}, "
                           f"but loop = {loop}")


def describe(settings: SampleSettings, resolved: Resolved) -> dict[str, Any]:
    """The settings as written into the sidecar: everything given plus the resolved sizes."""
    return {**settings.to_dict(), "height": resolved.height, "width": resolved.width,
            "num_frames_resolved": resolved.num_frames}
