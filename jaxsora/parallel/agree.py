"""Host-side agreement between the processes of a run, through jax.distributed's key-value store.

`agree_max(tag, value)`: every process gives its value under the same tag (e.g. the step number)
and gets the largest — without a device collective, so the host does not wait for the steps
already queued on its devices (a jitted all-gather would). One process: the value itself.

A peer that never answers is the peer watch's business (`jaxsora.parallel.peers` ends the run
in one line); the wait here only needs to outlast a slow peer (a long late compile).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

_PREFIX = "jaxsora/agree/"
# A slow peer (compiling a shape first met) may take many minutes to reach the same tag.
TIMEOUT_MS = 3 * 60 * 60 * 1000


def _client():
    from jax._src import distributed as jd  # jax has no public handle on its distributed client

    return getattr(jd.global_state, "client", None)


def agree_max(tag: str, value: int) -> int:
    """The largest `value` given under `tag` by any process of the run (each process calls once per tag)."""
    n = jax.process_count()
    if n <= 1:
        return int(value)
    client = _client()
    if client is None:  # not started by jax.distributed (cannot happen in a multi-process run)
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int64(value))))
    me = jax.process_index()
    key = f"{_PREFIX}{tag}/"
    client.key_value_set(f"{key}{me}", str(int(value)))
    values = [int(value)]
    for i in range(n):
        if i != me:
            values.append(int(client.blocking_key_value_get(f"{key}{i}", TIMEOUT_MS)))
    return max(values)


def forget(tag: str) -> None:
    """Drop this process's entry under `tag` (call once every process has read it)."""
    client = _client() if jax.process_count() > 1 else None
    if client is not None:
        with contextlib.suppress(Exception):  # best effort: an entry left behind costs a few bytes
            client.key_value_delete(f"{_PREFIX}{tag}/{jax.process_index()}")
