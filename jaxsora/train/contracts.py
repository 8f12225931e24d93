"""What the training code needs of its components, written down as `typing.Protocol`s.

The loop, the run setup and the dry run are written against these, not against one class: the
video loader and the feature loader (`jaxsora.data`) and the tests' fake loader are all a
`Loader`; the OpenSora VAE and the demo's pixel-space `IdentityVAE` are both a `VAE`; the T5 and
the tiny random encoder are both a `TextEncoder` (those two are `jaxsora.models.contracts`). They
are `runtime_checkable`, so a test can hold each implementation against its contract
(`tests/train/test_contracts.py`); the checks see names only, the docstrings say the shapes.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

# The encoders' contracts live with the models (sampling reads them without the trainer); named here too.
from jaxsora.models.contracts import VAE, TextEncoder  # noqa: F401


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
