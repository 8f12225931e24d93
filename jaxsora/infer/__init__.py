"""Sampling with a jaxsora checkpoint: Open-Sora 1.2's inference (`scripts/inference.py`) as a Python API.

    from jaxsora.infer import Pipeline, SampleSettings, write_samples
    pipe = Pipeline.load("outputs/demo", ema=True)                  # run folder / checkpoints / step / converted
    settings = SampleSettings(image_size=(32, 32), num_frames=8, fps=8)
    videos = pipe.generate(["a red circle moving right"], settings)  # [T, H, W, 3] uint8 each
    paths = write_samples(videos, prompts, settings, "samples/", pipe.meta())

`python -m jaxsora.sample` is the command line over the same pieces. The names load their modules on first use:
`locate` and `options` (finding the checkpoint, the settings) import no jax, so the command line answers a wrong
path or setting before it imports jax.
"""
from jaxsora.lazy_imports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    "conditioning": ("build_condition", "prompt_key"),
    "locate": ("find_step_dir",),
    "options": ("SampleSettings", "append_score_to_prompts", "find_nearest_point", "get_image_size", "get_num_frames",
                "parse_mask_strategy", "place_group"),
    "pipeline": ("Pipeline",),
    "writing": ("write_samples",),
})
