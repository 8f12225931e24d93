"""Writing samples: each video as an mp4 (one frame: a png) named as Open-Sora names them, with a
JSON sidecar of how it was made."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from jaxsora.errors import BadInput
from jaxsora.infer import options as opt
from jaxsora.infer.conditioning import prompt_hash, prompt_occurrences
from jaxsora.infer.options import SampleSettings


def sample_name(index: int, *, prefix: str = "sample", num_sample: int = 1, k: int = 0, prompt: str | None = None
                ) -> str:
    """Open-Sora's get_save_path_name: "sample_0003" (or "<prefix>_0003"), "-k" with num_sample > 1;
    with prompt (prompt_as_path) the prompt itself (made file-safe)."""
    if prompt is not None:
        import re

        base = re.sub(r"[^\w\-. ]+", "_", prompt).strip()[:200] or "sample"
        name = f"{prefix if prefix != 'sample' else ''}{base}"
    else:
        name = f"{prefix}_{index:04d}"
    return f"{name}-{k}" if num_sample != 1 else name


def write_samples(videos: Sequence[np.ndarray], prompts: Sequence[str], settings: SampleSettings, save_dir: str,
                  meta: dict | None = None, *, start_index: int = 0, prefix: str = "sample", num_sample: int = 1,
                  prompt_as_path: bool = False) -> list[str]:
    """Write each video (an mp4 at settings.save_fps or fps; one frame: a png) and a JSON sidecar
    beside it (prompt as given and as fed, seed and noise derivation, every setting, the size
    written, plus `meta`: checkpoint path and step, ...). Returns the media paths.
    With num_sample > 1, prompts are taken as num_sample consecutive copies of each prompt (the
    names get "-k")."""
    from PIL import Image

    from jaxsora.data.video import write_mp4

    if len(videos) != len(prompts):
        raise ValueError(f"write_samples: {len(videos)} videos for {len(prompts)} prompts")
    os.makedirs(save_dir, exist_ok=True)
    try:
        res = settings.validate(None)
    except BadInput:  # a run's custom resolution name: the sidecar still has the size written
        res = None
    fps = float(settings.save_fps if settings.save_fps is not None else settings.fps)
    occ = prompt_occurrences(prompts)
    written = []
    for i, (video, prompt) in enumerate(zip(videos, prompts)):
        video = np.asarray(video)
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"write_samples: video {i} must be [T, H, W, 3] uint8, got {video.shape} {video.dtype}")
        text, _ = opt.extract_json(prompt)
        k = i % num_sample
        idx = start_index + i // num_sample
        name = sample_name(idx, prefix=prefix, num_sample=num_sample, k=k,
                           prompt=text if prompt_as_path else None)
        base = os.path.join(save_dir, name)
        if video.shape[0] == 1:
            path = base + ".png"
            Image.fromarray(video[0]).save(path)
        else:
            path = write_mp4(video, base + ".mp4", fps)
        record = {
            "media": os.path.basename(path),
            "prompt": prompt,
            "prompt_fed": opt.prepare_prompt(text, settings.aes, settings.flow, settings.camera_motion),
            "seed": int(settings.seed),
            "noise": {"scheme": "fold_in(fold_in(key(seed), crc32(prompt) & 0x7fffffff), occurrence)",
                      "prompt_crc32": prompt_hash(prompt), "occurrence": occ[i]},
            "frames": int(video.shape[0]), "height": int(video.shape[1]), "width": int(video.shape[2]),
            "fps": fps,
            "settings": settings.in_effect(),
            **({"requested": {"num_frames": res.num_frames, "height": res.height, "width": res.width}} if res else {}),
            **(meta or {}),
        }
        with open(base + ".json", "w") as f:
            json.dump(record, f, indent=1, default=_json_default)
        written.append(path)
    return written


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    return str(o)
