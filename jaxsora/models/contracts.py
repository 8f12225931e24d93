"""What the frozen encoders offer their users (the train step, the sampler, the feature cache): the
VAE and the text encoder, as Protocols (structural: any object with these members fits)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class VAE(Protocol):
    """The frozen video autoencoder: `encode(video [B, 3, T, H, W] in [-1, 1], key)` → latents
    [B, C, t, h, w] (C = `out_channels`, (t, h, w) = `get_latent_size((T, H, W))`);
    `decode(z, num_frames)` → video [B, 3, num_frames, H, W]."""

    @property
    def out_channels(self) -> int: ...

    def get_latent_size(self, size: Sequence[int | None]) -> tuple: ...

    def encode(self, video: Any, key: Any) -> Any: ...

    def decode(self, z: Any, num_frames: int) -> Any: ...


@runtime_checkable
class TextEncoder(Protocol):
    """The frozen caption encoder: `tokenizer(texts)` → (ids [b, L], mask [b, L]) on the host;
    `encode(texts)` → (states [b, 1, L, D] float32, mask [b, L] int32), D = `caption_channels`,
    L = `model_max_length`. `graphdef`/`state` are the NNX module the train step runs."""

    model_max_length: int
    caption_channels: int
    graphdef: Any
    state: Any
    tokenizer: Any

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...
