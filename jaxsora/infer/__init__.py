"""Sampling with a jaxsora checkpoint: Open-Sora 1.2's inference (spec §2.4, §8) as a Python API.

    from jaxsora.infer import Pipeline, SampleSettings, write_samples
    pipe = Pipeline.load("outputs/demo", ema=True)                  # run folder / checkpoints / step / converted
    settings = SampleSettings(image_size=(32, 32), num_frames=8, fps=8)
    videos = pipe.generate(["a red circle moving right"], settings)  # [T, H, W, 3] uint8 each
    paths = write_samples(videos, prompts, settings, "samples/", pipe.meta())

`python -m jaxsora.sample` is the command line over the same pieces.
"""
from jaxsora.infer.conditioning import build_condition, prompt_key
from jaxsora.infer.loading import find_step_dir
from jaxsora.infer.options import (
                                   SampleSettings,
                                   append_score_to_prompts,
                                   find_nearest_point,
                                   get_image_size,
                                   get_num_frames,
                                   parse_mask_strategy,
                                   place_group,
)
from jaxsora.infer.pipeline import Pipeline
from jaxsora.infer.writing import write_samples

__all__ = ["Pipeline", "SampleSettings", "write_samples", "get_image_size", "get_num_frames", "parse_mask_strategy",
           "find_nearest_point", "place_group", "append_score_to_prompts", "build_condition", "find_step_dir",
           "prompt_key"]
