"""What a sample is conditioned on besides its text: its noise key, its reference files and the
edit mask that places them (Open-Sora 1.2's mask strategies), and the VAE's frame geometry that
loops and references depend on.

Seeding: the noise of a prompt depends on (seed, the prompt as given, how many times the same
prompt came before it in the list) only — not on its position, the batch size or the other
prompts: key = fold_in(fold_in(key(seed), crc32(prompt) & 0x7fffffff), occurrence); loop i uses
fold_in(key, i); the initial z is drawn from fold_in(·, 0) and the re-noising of edited frames from
fold_in(·, 1) (per sample, see `rflow._step_noise`). Open-Sora instead re-seeds 1024 before every
batch, so its noise depends on the batch.
"""
from __future__ import annotations

import collections
import os
import zlib
from collections.abc import Sequence

import jax
import numpy as np

from jaxsora.errors import BadInput, MissingFile
from jaxsora.infer import options as opt


# --------------------------------------------------------------------------------------------
# seeds
# --------------------------------------------------------------------------------------------
def prompt_hash(prompt: str) -> int:
    return zlib.crc32(prompt.encode("utf-8")) & 0x7FFFFFFF


def prompt_occurrences(prompts: Sequence[str]) -> list[int]:
    """For each prompt, how many times the same string came before it in the list."""
    seen: dict = collections.Counter()
    out = []
    for p in prompts:
        out.append(seen[p])
        seen[p] += 1
    return out


def prompt_key(seed: int, prompt: str, occurrence: int = 0) -> jax.Array:
    """The base key of one prompt (see the module docstring)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(int(seed)), prompt_hash(prompt)), int(occurrence))


# --------------------------------------------------------------------------------------------
# VAE frame geometry
# --------------------------------------------------------------------------------------------
def vae_align(vae) -> int:
    """Latent frames of one VAE chunk: Open-Sora's align = 5 for its VAE (17 frames → 5), 1 for a
    VAE without temporal chunks (the pixel-space one)."""
    cfg = getattr(vae, "config", None)
    if cfg is not None and getattr(cfg, "micro_frame_size", None):
        return int(vae.get_latent_size((cfg.micro_frame_size, None, None))[0])
    return 1


def cond_pixel_frames(vae, latent_frames: int) -> int:
    """Pixel frames covered by `latent_frames` conditioning latents — what the reference's
    `dframe_to_frame` drops from each later loop (5 → 17 for the OpenSora VAE)."""
    cfg = getattr(vae, "config", None)
    if cfg is not None and getattr(cfg, "micro_frame_size", None):
        chunk = vae_align(vae)
        if latent_frames % chunk:
            raise BadInput(f"condition_frame_length must be a multiple of {chunk} latent frames with this VAE "
                           f"(one {cfg.micro_frame_size}-frame chunk), got {latent_frames}")
        return latent_frames // chunk * int(cfg.micro_frame_size)
    return latent_frames * int(getattr(vae, "downsample", (1,))[0])


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------
def read_reference(path: str, height: int, width: int) -> np.ndarray:
    """An image or video file → [3, T, H, W] float32 in [-1, 1], resized to cover (H, W) and center
    cropped (the reference's "resize_crop": bicubic for images, bilinear for video frames)."""
    from PIL import Image

    from jaxsora.data.video import channels_first, is_video, resize_crop, to_model_range, upright

    if not os.path.isfile(path):
        raise MissingFile(f"--reference-path: no such file {path!r}")
    if is_video(path):
        import av

        try:
            with av.open(path) as container:
                frames, rotation = [], 0.0
                for i, frame in enumerate(container.decode(container.streams.video[0])):
                    if i == 0:
                        rotation = float(getattr(frame, "rotation", 0) or 0)
                    frames.append(frame.to_ndarray(format="rgb24"))
        except Exception as e:  # noqa: BLE001 — av errors: corrupt, unsupported
            raise BadInput(f"--reference-path: cannot decode {path}: {e}") from None
        if not frames:
            raise BadInput(f"--reference-path: {path} has no frames")
        arr = resize_crop(upright(np.stack(frames), rotation), height, width)
    else:
        from PIL import ImageOps

        try:
            with Image.open(path) as im:
                arr = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))[None]
        except Exception as e:  # noqa: BLE001 — PIL errors
            raise BadInput(f"--reference-path: cannot read image {path}: {e}") from None
        arr = resize_crop(arr, height, width, Image.BICUBIC)
    return to_model_range(channels_first(arr))


def build_condition(strategies: Sequence[str], refs: Sequence[Sequence[np.ndarray]], loop_i: int,
                    latent_shape: tuple, align: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The edit mask [B, T] (1 = generate, 0 = keep, between = edit strength) and the reference
    latents x_cond [B, C, T, h, w] of one loop, as `apply_mask_strategy`; (None, None) when every
    frame is generated (plain text-to-video: the model then gets no x_mask, which equals all True)."""
    c, t, h, w = latent_shape
    b = len(strategies)
    mask = np.ones((b, t), np.float32)
    x_cond = np.zeros((b, c, t, h, w), np.float32)
    for r, ms in enumerate(strategies):
        for g in opt.parse_mask_strategy(ms):
            if g.loop_id != loop_i:
                continue
            ref = refs[r][g.ref_id]
            if tuple(ref.shape[2:]) != (h, w):
                raise BadInput(f"reference {g.ref_id} has latent size {ref.shape[2:]}, the sample {(h, w)}")
            rs, ts, length = opt.place_group(g, ref.shape[1], t, align)
            x_cond[r, :, ts:ts + length] = ref[:, rs:rs + length]
            mask[r, ts:ts + length] = g.edit_ratio
    if np.all(mask == 1):
        return None, None
    return mask, x_cond
