"""`np.random.default_rng(int(s)).random(n)` for an array of seeds at once, bit-exact.

The reference's bucket assignment seeds a fresh generator per (row, resolution, frame count);
creating each one in Python costs ~25 µs, so a table of millions of rows took minutes per epoch.
This reimplements numpy's path in vectorized uint32/uint64 arithmetic (numpy ≥ 1.17:
`numpy/random/bit_generator.pyx` SeedSequence, `numpy/random/src/pcg64/pcg64.h` PCG64 XSL-RR):
  SeedSequence(s): entropy = s as little-endian uint32 words, mixed into a 4-word pool
  → generate_state(4, uint64) → PCG64 seed (state, inc) → per draw: 128-bit LCG step, XSL-RR
  output → double = (u64 >> 11) · 2⁻⁵³.
SeedSequence's hash constants evolve independently of the data, so they are precomputed as scalars;
seeds are processed in cache-sized chunks. `tests/data/test_assign_vectorized.py` checks the result
against numpy itself.
"""
from __future__ import annotations

import numpy as np

# SeedSequence's hash constants (numpy/random/bit_generator.pyx).
INIT_A, MULT_A = 0x43B0D7E5, 0x931E8875
INIT_B, MULT_B = 0x8B51F9DD, 0x58F38DED
MIX_MULT_L, MIX_MULT_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
XSHIFT = np.uint32(16)
POOL_SIZE = 4
# PCG64's default 128-bit multiplier (pcg64.h PCG_DEFAULT_MULTIPLIER_HIGH/LOW).
MULT_HI, MULT_LO = np.uint64(2549297995355413924), np.uint64(4865540595714422341)
M32 = np.uint64(0xFFFFFFFF)
_U32, _U1, _U11, _U58, _U63, _U64 = (np.uint64(k) for k in (32, 1, 11, 58, 63, 64))
_MLO0, _MLO1 = MULT_LO & M32, MULT_LO >> _U32
_CHUNK = 1 << 15  # seeds per pass: the temporaries stay in cache


def _const_sequence(init: int, mult: int, n: int) -> list:
    """hash_const before each of n hashmix calls, paired with the multiplier applied after the xor."""
    out, hc = [], init
    for _ in range(n):
        nxt = (hc * mult) & 0xFFFFFFFF
        out.append((np.uint32(hc), np.uint32(nxt)))
        hc = nxt
    return out


# mix_entropy: 4 hashmix calls filling the pool, then 12 (src, dst) mixes; generate_state: 8 words.
_HASH_A = _const_sequence(INIT_A, MULT_A, POOL_SIZE + POOL_SIZE * (POOL_SIZE - 1))
_HASH_B = _const_sequence(INIT_B, MULT_B, 2 * POOL_SIZE)


def _hashmix(value, k):
    xor, mul = _HASH_A[k]
    value = (value ^ xor) * mul
    return value ^ (value >> XSHIFT)


def _mix(x, y):
    r = MIX_MULT_L * x - MIX_MULT_R * y
    return r ^ (r >> XSHIFT)


def _seed_state(seeds: np.ndarray) -> tuple:
    """SeedSequence(s).generate_state(4, uint64) → 4 uint64 arrays. The entropy is [lo] or [lo, hi];
    a missing word hashes like a zero word, so [lo, hi] serves both."""
    pool = [_hashmix((seeds & M32).astype(np.uint32), 0), _hashmix((seeds >> _U32).astype(np.uint32), 1),
            _hashmix(np.uint32(0), 2), _hashmix(np.uint32(0), 3)]  # the last two are constants
    k = POOL_SIZE
    for src in range(POOL_SIZE):
        for dst in range(POOL_SIZE):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], k))
                k += 1
    words = []
    for i, (xor, mul) in enumerate(_HASH_B):
        v = (pool[i % POOL_SIZE] ^ xor) * mul
        words.append((v ^ (v >> XSHIFT)).astype(np.uint64))
    return tuple(words[2 * j] | (words[2 * j + 1] << _U32) for j in range(POOL_SIZE))


def _step(sh, sl, ih, il):
    """(state · MULT + inc) mod 2**128 on (hi, lo) uint64 pairs; sl · MULT_LO via 32-bit limbs."""
    a0, a1 = sl & M32, sl >> _U32
    p00, p01, p10 = a0 * _MLO0, a0 * _MLO1, a1 * _MLO0
    mid = (p00 >> _U32) + (p01 & M32) + (p10 & M32)
    lo = (p00 & M32) | (mid << _U32)
    hi = a1 * _MLO1 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32) + sl * MULT_HI + sh * MULT_LO
    lo2 = lo + il
    return hi + ih + (lo2 < lo), lo2


def _uniforms_chunk(seeds: np.ndarray, out: np.ndarray) -> None:
    s_hi, s_lo, i_hi, i_lo = _seed_state(seeds)  # pcg64_set_seed: PCG_128BIT_CONSTANT(high, low)
    inc_hi = (i_hi << _U1) | (i_lo >> _U63)  # srandom: inc = (initseq << 1) | 1
    inc_lo = (i_lo << _U1) | _U1
    st_lo = inc_lo + s_lo  # state = 0; step (→ inc); state += initstate; step
    st_hi = inc_hi + s_hi + (st_lo < s_lo)
    st_hi, st_lo = _step(st_hi, st_lo, inc_hi, inc_lo)
    for k in range(out.shape[1]):
        st_hi, st_lo = _step(st_hi, st_lo, inc_hi, inc_lo)  # next64: step, then XSL-RR of the new state
        x = st_hi ^ st_lo
        rot = st_hi >> _U58
        u = (x >> rot) | (x << ((_U64 - rot) & _U63))
        out[:, k] = u >> _U11
    out *= 1.0 / 9007199254740992.0  # (u64 >> 11) · 2⁻⁵³, exact


def uniforms(seeds, n: int = 1) -> np.ndarray:
    """[len(seeds), n] float64: row i equals `np.random.default_rng(int(seeds[i])).random(n)`.
    seeds: non-negative integers < 2**64."""
    seeds = np.asarray(seeds, dtype=np.uint64).ravel()
    out = np.empty((len(seeds), n), np.float64)
    with np.errstate(over="ignore"):
        for a in range(0, len(seeds), _CHUNK):
            _uniforms_chunk(seeds[a:a + _CHUNK], out[a:a + _CHUNK])
    return out
