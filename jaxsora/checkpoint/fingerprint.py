"""Layout-independent fingerprints of arrays: the checksums of `integrity.json` (jaxsora.checkpoint).

A fingerprint is a pair of uint32: each array is read as its logical C-order sequence of 32-bit
words (2- and 1-byte dtypes widened, 8-byte dtypes split in two, low word first) and reduced with
integer sums modulo 2^32, which are exact whatever the sharding or the reduction order. So a
checkpoint saved on one mesh verifies on another, and the host version (numpy, `host_fingerprint`)
gives the same bits as the device version (one jitted program per tree; `device_fingerprints` uses
it for arrays not wholly in this process's CPU memory).
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The MurmurHash3 32-bit finalizer ("fmix32", Austin Appleby, MurmurHash3.cpp, public domain): a
# bijection on uint32 that spreads every input bit over the output. Per word w at word position i
# (in the array's C order) the fingerprint is the pair
#     lane0 = Σ fmix32(w)            mod 2^32   (any change of one word changes it)
#     lane1 = Σ fmix32(w)·(2i + 1)   mod 2^32   (odd weights: moving values changes it)
_FMIX_M1 = 0x85EBCA6B
_FMIX_M2 = 0xC2B2AE35
_MASK32 = 0xFFFFFFFF
# numpy fingerprints work on this many words at a time (bounds the temporaries to ~64 MiB)
_HOST_CHUNK_WORDS = 1 << 23


def _fmix32_lax(h):
    """fmix32 on uint32 words, in lax primitives (a TrainState has hundreds of arrays: jnp's per-call
    promotion checks made this trace take seconds)."""
    for shift, mult in ((16, _FMIX_M1), (13, _FMIX_M2)):
        h = lax.mul(lax.bitwise_xor(h, lax.shift_right_logical(h, np.uint32(shift))), np.uint32(mult))
    return lax.bitwise_xor(h, lax.shift_right_logical(h, np.uint32(16)))


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_FMIX_M1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_FMIX_M2)
    return h ^ (h >> np.uint32(16))


def _words_jnp(x):
    """An array as uint32 words: shape x.shape (1-, 2-, 4-byte dtypes, zero-extended) or
    x.shape + (2,) (8-byte dtypes, low word first as in little-endian memory)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        narrow = jnp.uint8 if size == 1 else jnp.uint16
        return lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    if size == 8 and not jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"no fingerprint for dtype {x.dtype}")


def _words_np(a: np.ndarray) -> np.ndarray:
    """`_words_jnp` on the host, flattened: uint32[n_words] in C order."""
    a = np.ascontiguousarray(a).reshape(-1)
    if a.dtype == np.bool_:
        return a.view(np.uint8).astype(np.uint32)
    size = a.dtype.itemsize
    if size == 4:
        return a.view(np.uint32)
    if size in (1, 2):
        return a.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)
    if size == 8 and a.dtype.kind != "c":
        if sys.byteorder != "little":  # the device side splits 8-byte words low word first
            a = a.byteswap().view(a.dtype.newbyteorder())
        return a.view(np.uint32)
    raise TypeError(f"no fingerprint for dtype {a.dtype}")


def _fingerprint_jnp(x):
    """uint32[2] fingerprint of one array (traced; sharded inputs reduce across devices)."""
    w = _words_jnp(x)
    dims = tuple(range(w.ndim))
    # the word's position in C order, mod 2^32, from one iota per dimension
    pos = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(dims):
        pos = lax.add(pos, lax.mul(lax.broadcasted_iota(jnp.uint32, w.shape, d), np.uint32(stride & _MASK32)))
        stride *= w.shape[d]
    f = _fmix32_lax(w)
    weight = lax.add(lax.mul(pos, np.uint32(2)), np.uint32(1))
    zero = np.uint32(0)
    return jnp.stack([lax.reduce(f, zero, lax.add, dims), lax.reduce(lax.mul(f, weight), zero, lax.add, dims)])


def host_fingerprint(a) -> tuple[int, int]:
    """The fingerprint of a host array, bit-for-bit the one `device_fingerprints` computes."""
    words = _words_np(np.asarray(a))
    lane0 = lane1 = 0
    for start in range(0, words.size, _HOST_CHUNK_WORDS):
        w = words[start:start + _HOST_CHUNK_WORDS]
        pos = (np.arange(start, start + w.size, dtype=np.uint64) & np.uint64(_MASK32)).astype(np.uint32)
        f = _fmix32_np(w)
        weighted = f * (pos * np.uint32(2) + np.uint32(1))  # wraps mod 2^32, as on the device
        lane0 = (lane0 + int(f.sum(dtype=np.uint64))) & _MASK32  # < 2^23 terms < 2^32: no overflow
        lane1 = (lane1 + int(weighted.sum(dtype=np.uint64))) & _MASK32
    return lane0, lane1


def format_fingerprint(pair) -> str:
    """16 hex digits: lane0 then lane1."""
    return f"{int(pair[0]) & _MASK32:08x}{int(pair[1]) & _MASK32:08x}"


def array_name(path) -> str:
    """Orbax's name of a leaf (its key path joined by '.', e.g. 'params.blocks.0.attn.qkv.kernel.value'),
    so names from a TrainState and from an untargeted restore of the same checkpoint agree."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _fingerprints_impl(leaves):
    return jnp.stack([_fingerprint_jnp(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


# One jitted function per mesh; jax.jit caches its executables per tree structure, shapes, dtypes
# and shardings, so a training run traces it once (plus once per restore).
_FINGERPRINT_FNS: dict = {}


def _fingerprint_fn(leaves):
    mesh = next((x.sharding.mesh for x in leaves
                 if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)), None)
    key = None if mesh is None else (mesh.axis_names, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))
    fn = _FINGERPRINT_FNS.get(key)
    if fn is None:
        # replicated output: every process can read all fingerprints from its own devices
        out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        fn = _FINGERPRINT_FNS[key] = jax.jit(_fingerprints_impl, out_shardings=out)
    return fn


def device_fingerprints(tree, *, on_host: bool | None = None) -> tuple[list[str], list[dict], list]:
    """(names, [{"shape", "dtype"}], fingerprints) of a pytree of (global) arrays; fingerprints:
    uint32[n, 2] arrays, one per set of devices the leaves live on (one for a TrainState on its
    mesh). Read them with `fetch_fingerprints`.

    on_host: None picks per set of devices: CPU arrays this process holds whole are read with numpy
    (the same bits, `host_fingerprint`: ~0.05 s for a 9M-word demo TrainState, where the jitted
    program's first call costs a trace, a lowering and a compile of ~2 s in every process); other
    arrays (accelerators, or arrays spread over processes) by one jitted program, dispatched and not
    waited for. True/False force one way (tests of the device program use False)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [array_name(p) for p, _ in flat]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    info = [dict(shape=list(x.shape), dtype=str(x.dtype)) for x in leaves]
    groups: dict = {}  # device ids → leaf indices, in order
    for i, x in enumerate(leaves):
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(i)
    outs = []
    for idx in groups.values():
        group = [leaves[i] for i in idx]
        if on_host if on_host is not None else all(_whole_on_cpu(x) for x in group):
            outs.append(np.array([host_fingerprint(np.asarray(x)) for x in group], np.uint32).reshape(-1, 2))
        else:
            outs.append(_fingerprint_fn(group)(group))
    order = [i for idx in groups.values() for i in idx]  # the rows of the concatenated outputs
    names = [names[i] for i in order]
    info = [info[i] for i in order]
    return names, info, outs


def _whole_on_cpu(x: jax.Array) -> bool:
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)


def fetch_fingerprints(fps: list) -> list[str]:
    """Hex fingerprints from `device_fingerprints`' replicated outputs; works on every process."""
    rows = [f if isinstance(f, np.ndarray) else np.asarray(f.addressable_data(0)) for f in fps if f.shape[0]]
    return [format_fingerprint(r) for r in (np.concatenate(rows) if rows else np.zeros((0, 2), np.uint32))]
