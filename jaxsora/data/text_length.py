"""Captions at the cost of their valid tokens: each batch's text inputs are cut, on the host, to the
shortest of a few static lengths (`data.text_lengths`) that holds the batch's longest caption.

Open-Sora 1.2 packs the batch's valid caption tokens (`STDiT3.encode_text`'s masked_select and a
block-diagonal cross-attention mask), so its text K/V projections and cross-attention cost what the
captions hold, not `model_max_length` (300) tokens a sample. Shapes here must be static, so a batch
runs at one of a few lengths instead — each (bucket, text length) pair compiles once, when first met.

Cutting changes no number: the tokens cut are padding (the mask's valid tokens come first, as T5's
tokenizer gives them) and T5's and STDiT3's attentions give padding keys exactly zero weight; the
caption-dropout null embedding is used on the first tokens only (`CaptionEmbedder`).

Every process of a multi-process run must cut to the same length (one SPMD program): the trainer
agrees on the largest of the processes' lengths (`jaxsora.parallel.agree`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# The default `data.text_lengths`: a quarter and a half of Open-Sora 1.2's 300 T5 tokens (OpenVid-1M
# captions hold 40-150 of them), so a batch compiles at no more than three caption lengths.
DEFAULT_LENGTHS = (75, 150)


def valid_length(text_mask: np.ndarray) -> int:
    """[b, L] 0/1 mask → the number of leading tokens that hold every row's valid ones (the last
    valid position + 1 over the rows; 0 for an empty batch or all-padding rows)."""
    m = np.asarray(text_mask) != 0
    if m.size == 0 or not m.any():
        return 0
    last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)  # [b]: 1 + index of each row's last valid token
    return int(np.max(np.where(m.any(axis=1), last, 0)))


def fitted_length(valid: int, lengths: Sequence[int], max_length: int) -> int:
    """The shortest of `lengths` (those below `max_length`) that is ≥ `valid`, else `max_length`."""
    fits = [int(n) for n in lengths if int(valid) <= int(n) < int(max_length)]
    return min(fits) if fits else int(max_length)


def length_for(text_mask: np.ndarray, lengths: Sequence[int]) -> int:
    """[b, L] mask → the length one batch is cut to: the shortest of `lengths` that holds its valid
    tokens, else L (one process's view; a multi-process run agrees on the max, see the trainer)."""
    return fitted_length(valid_length(text_mask), lengths, np.shape(text_mask)[1])


def check_lengths(lengths) -> tuple[int, ...]:
    """`data.text_lengths` as a sorted tuple of positive ints; ValueError names what is wrong."""
    try:
        out = tuple(sorted({int(n) for n in (lengths or ())}))
    except (TypeError, ValueError):
        raise ValueError(f"data.text_lengths must be a list of token counts, got {lengths!r}") from None
    if any(n < 1 for n in out):
        raise ValueError(f"data.text_lengths must be positive token counts, got {list(lengths)}")
    return out


def cut(host: dict, length: int) -> dict:
    """The host batch with `ids` ([b, L] token ids or [b, L, D] cached states) and `text_mask` [b, L]
    cut to their first `length` tokens (the batch itself when it is no longer)."""
    ids, mask = np.asarray(host["ids"]), np.asarray(host["text_mask"])
    if mask.shape[1] <= length:
        return host
    dropped = mask[:, length:]
    if np.any(dropped != 0):  # an internal error: the length must hold every valid token
        raise AssertionError(f"cutting captions to {length} tokens would drop valid tokens")
    return dict(host, ids=ids[:, :length], text_mask=mask[:, :length])
