"""`python -m jaxsora.sample`: text-to-video with a trained jaxsora checkpoint.

    python -m jaxsora.sample --ckpt outputs/demo/checkpoints --prompt "a red circle moving right" \
        --out samples/ [--ema] [--num-frames 16 --height 32 --width 32] [--steps 30 --cfg 7.0 --seed 1024]

The model, VAE and text encoder are rebuilt from the config stored in the checkpoint. Sampling is
Open-Sora 1.2's RFLOW (spec §2.4): timestep-shifted Euler steps with classifier-free guidance
against the model's null caption. Videos are written as h264 mp4 (PyAV), single frames as png.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional, Sequence

import numpy as np

from jaxsora.errors import BadInput, MissingFile, run_cli


def to_uint8_frames(video: np.ndarray) -> np.ndarray:
    """[3, T, H, W] in [-1, 1] → [T, H, W, 3] uint8 (clamped, as the reference's save_sample)."""
    v = np.clip((np.asarray(video, np.float32) + 1) / 2, 0, 1)
    return np.round(np.transpose(v, (1, 2, 3, 0)) * 255).astype(np.uint8)


def write_video(frames: np.ndarray, path: str, fps: float = 24) -> str:
    """Write [T, H, W, 3] uint8 as h264 mp4 (or one frame as png). Returns the path written."""
    from jaxsora.data.video import write_mp4

    if frames.shape[0] == 1:
        from PIL import Image

        path = os.path.splitext(path)[0] + ".png"
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        Image.fromarray(frames[0]).save(path)
        return path
    return write_mp4(frames, path, fps)


def _slug(text: str, n: int = 40) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "_", text).strip("_")[:n] or "sample"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxsora.sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="jaxsora checkpoint folder (training outputs/.../checkpoints)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--prompt-file", help="a text file with one prompt per line")
    ap.add_argument("--out", default="samples", help="output folder")
    ap.add_argument("--ema", action="store_true", help="use the EMA weights")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ap.add_argument("--num-frames", type=int, default=None, help="pixel frames (default: the config's sample setting)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--fps", type=float, default=None)
    ap.add_argument("--steps", type=int, default=30, help="sampling steps (Open-Sora 1.2 inference: 30)")
    ap.add_argument("--cfg", type=float, default=7.0, help="CFG scale (Open-Sora 1.2 inference: 7.0)")
    ap.add_argument("--seed", type=int, default=1024, help="noise seed (Open-Sora 1.2 always uses 1024)")
    args = ap.parse_args(argv)

    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise MissingFile(f"--prompt-file: no such file {args.prompt_file}")
        with open(args.prompt_file) as f:
            prompts += [ln.strip() for ln in f if ln.strip()]
    if not prompts:
        ap.error("give at least one --prompt or a --prompt-file")

    import jax
    import jax.numpy as jnp

    import jaxsora  # noqa: F401
    from jaxsora.convert import native
    from jaxsora.diffusion import rflow
    from jaxsora.train.build import build_text_encoder_from_config, build_vae_from_config

    step_dir = native.resolve_step_dir(args.ckpt, args.step)
    stored = native.read_config(step_dir)
    model = native.load_model(step_dir, ema=args.ema)
    cfg = stored.get("config", stored)
    sample_cfg = cfg.get("sample", {}) if isinstance(cfg, dict) else {}
    num_frames = args.num_frames or sample_cfg.get("num_frames", 16)
    height = args.height or sample_cfg.get("height", 64)
    width = args.width or sample_cfg.get("width", 64)
    fps = args.fps or sample_cfg.get("fps", 24)

    if not isinstance(cfg, dict) or "vae" not in cfg or "text_encoder" not in cfg:
        raise BadInput(f"{step_dir} has no run config naming the VAE and text encoder (a checkpoint converted from "
                       "PyTorch?); sample from a training checkpoint")
    vae = build_vae_from_config(cfg["vae"])
    text_encoder = build_text_encoder_from_config(cfg["text_encoder"])
    y, mask = text_encoder.encode(prompts)
    b = len(prompts)
    lt, lh, lw = vae.get_latent_size((num_frames, height, width))
    key = jax.random.key(args.seed)
    z = jax.random.normal(key, (b, vae.out_channels, lt, lh, lw), jnp.float32)
    hw = dict(height=jnp.full((b,), height, jnp.float32), width=jnp.full((b,), width, jnp.float32),
              num_frames=jnp.full((b,), num_frames, jnp.float32))
    cond = dict(y=jnp.asarray(y), mask=jnp.asarray(mask), fps=jnp.full((b,), fps, jnp.float32),
                height=hw["height"], width=hw["width"])
    null_y = jnp.broadcast_to(model.y_embedder.y_embedding[...][None, None], y.shape)
    latents = rflow.sample(
        model, z, cond, null_y, key=jax.random.fold_in(key, 1),
        num_sampling_steps=args.steps, cfg_scale=args.cfg, height=hw["height"], width=hw["width"],
        num_frames=hw["num_frames"],
        use_timestep_transform=bool(cfg.get("scheduler", {}).get("use_timestep_transform", True)),
    )
    videos = np.asarray(vae.decode(latents, num_frames))
    written = []
    for i, prompt in enumerate(prompts):
        path = write_video(to_uint8_frames(videos[i]), os.path.join(args.out, f"{i:03d}_{_slug(prompt)}.mp4"), fps)
        written.append(path)
        print(f"[{i}] {prompt!r} → {path}")
    with open(os.path.join(args.out, "samples.json"), "w") as f:
        json.dump({"ckpt": step_dir, "ema": args.ema, "prompts": prompts, "files": written, "steps": args.steps,
                   "cfg": args.cfg, "seed": args.seed, "num_frames": num_frames, "height": height, "width": width}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("jaxsora.sample", main))
