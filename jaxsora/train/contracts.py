"""What the training code needs of its components, written down as `typing.Protocol`s.

The loop, the run setup and the dry run are written against these, not against one class: the
video loader and the feature loader (`jaxsora.data`) and the tests' fake loader are all a
`Loader`; the OpenSora VAE and the demo's pixel-space `IdentityVAE` are both a `VAE`; the T5 and
the tiny random encoder are both a `TextEncoder`. They are `runtime_checkable`, so a test can
hold each implementation against its contract (`tests/train/test_contracts.py`); the checks see
names only, the docstrings say the shapes.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Loader(Protocol):
    """Global batches of the epoch plan, with an exact, checkable position.

    `iter(loader)` yields host batches: this host's rows of one bucket, `video` [b, 3, T, H, W]
    uint8 or `latents` [b, C, t, h, w], `ids` [b, L] int32 (or cached states [b, L, D] float32),
    `text_mask` [b, L], `fps`/`height`/`width` [b] float32, `num_frames` [b], `bucket`
    (res, T, H, W), `epoch`. After each batch, `epoch`/`index` are the position of the next one."""

    epoch: int
    index: int

    @property
    def num_rows(self) -> int: ...

    def steps_per_epoch(self, epoch: int = 0) -> int: ...

    def describe_plan(self, epoch: int = 0) -> list:
        """[((res, T, H, W), batches this epoch, global batch, rows)] per bucket shape."""

    def state(self) -> dict:
        """JSON-serializable position (epoch, index, fingerprint of the data setup, skip counts)."""

    def restore(self, state: dict, reset: bool = False) -> None:
        """Continue from `state`; refuse (a UserError) a state of another data setup unless `reset`."""

    def __iter__(self) -> Iterator[dict]: ...


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
