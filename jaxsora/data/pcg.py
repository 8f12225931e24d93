"""`np.random.default_rng(int(s)).random(n)` for an array of seeds at once, bit-exact.

The reference's bucket assignment seeds a fresh generator per (row, resolution, frame count);
creating each one in Python costs ~25 µs, so a table of millions of rows took minutes per epoch.
This reimplements numpy's path in vectorized uint32/uint64 arithmetic (numpy ≥ 1.17:
`numpy/random/bit_generator.pyx` SeedSequence, `numpy/random/src/pcg64/pcg64.h` PCG64 XSL-RR):
  SeedSequence(s): entropy = s as little-endian uint32 words, mixed into a 4-word pool
  → generate_state(4, uint64) → PCG64 seed (state, inc) → per draw: 128-bit LCG step, XSL-RR
  output → double = (u64 >> 11) · 2⁻⁵³.
`tests/data/test_assign_vectorized.py` checks it against numpy itself.
"""
from __future__ import annotations

import numpy as np

# SeedSequence's hash constants (numpy/random/bit_generator.pyx).
INIT_A, MULT_A = np.uint32(0x43B0D7E5), np.uint32(0x931E8875)
INIT_B, MULT_B = np.uint32(0x8B51F9DD), np.uint32(0x58F38DED)
MIX_MULT_L, MIX_MULT_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
XSHIFT = np.uint32(16)
POOL_SIZE = 4
# PCG64's default 128-bit multiplier (pcg64.h PCG_DEFAULT_MULTIPLIER_HIGH/LOW).
MULT_HI, MULT_LO = np.uint64(2549297995355413924), np.uint64(4865540595714422341)
M32 = np.uint64(0xFFFFFFFF)


def _hashmix(value, hash_const):
    value = value ^ hash_const
    hash_const = hash_const * MULT_A
    value = value * hash_const
    return value ^ (value >> XSHIFT), hash_const


def _mix(x, y):
    r = MIX_MULT_L * x - MIX_MULT_R * y
    return r ^ (r >> XSHIFT)


def _seed_pool(seeds: np.ndarray) -> list:
    """SeedSequence.mix_entropy for 1- or 2-word entropy: → 4 uint32 arrays."""
    lo = (seeds & M32).astype(np.uint32)
    hi = (seeds >> np.uint64(32)).astype(np.uint32)
    two = hi != 0  # entropy has 2 words only when s ≥ 2**32
    zero = np.zeros_like(lo)
    hc = np.full_like(lo, INIT_A)
    pool = []
    for i, word in enumerate([lo, np.where(two, hi, zero), zero, zero]):
        v, hc = _hashmix(word, hc)
        pool.append(v)
    for src in range(POOL_SIZE):
        for dst in range(POOL_SIZE):
            if src != dst:
                h, hc = _hashmix(pool[src], hc)
                pool[dst] = _mix(pool[dst], h)
    return pool


def _generate_state(pool: list) -> list:
    """SeedSequence.generate_state(4, uint64): → 4 uint64 arrays."""
    hc = np.full_like(pool[0], INIT_B)
    words = []
    for i in range(2 * POOL_SIZE):
        v = pool[i % POOL_SIZE] ^ hc
        hc = hc * MULT_B
        v = v * hc
        words.append((v ^ (v >> XSHIFT)).astype(np.uint64))
    return [words[2 * k] | (words[2 * k + 1] << np.uint64(32)) for k in range(POOL_SIZE)]


def _mul64(a, b):
    """Full 64×64 → (hi, lo) product of uint64 arrays, via 32-bit limbs."""
    a0, a1, b0, b1 = a & M32, a >> np.uint64(32), b & M32, b >> np.uint64(32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> np.uint64(32)) + (p01 & M32) + (p10 & M32)
    lo = (p00 & M32) | (mid << np.uint64(32))
    hi = p11 + (p01 >> np.uint64(32)) + (p10 >> np.uint64(32)) + (mid >> np.uint64(32))
    return hi, lo


def _add128(ah, al, bh, bl):
    lo = al + bl
    return ah + bh + (lo < al).astype(np.uint64), lo


def _step(sh, sl, ih, il):
    """state = state · MULT + inc (mod 2**128)."""
    hi, lo = _mul64(sl, MULT_LO)
    hi = hi + sl * MULT_HI + sh * MULT_LO
    return _add128(hi, lo, ih, il)


def uniforms(seeds, n: int = 1) -> np.ndarray:
    """[len(seeds), n] float64: row i equals `np.random.default_rng(int(seeds[i])).random(n)`.
    seeds: non-negative integers < 2**64."""
    seeds = np.asarray(seeds, dtype=np.uint64).ravel()
    with np.errstate(over="ignore"):
        s_hi, s_lo, i_hi, i_lo = _generate_state(_seed_pool(seeds))  # PCG_128BIT_CONSTANT(high, low)
        inc_hi = (i_hi << np.uint64(1)) | (i_lo >> np.uint64(63))  # inc = (initseq << 1) | 1
        inc_lo = (i_lo << np.uint64(1)) | np.uint64(1)
        zero = np.zeros_like(seeds)
        st_hi, st_lo = _step(zero, zero, inc_hi, inc_lo)  # state = 0; step; state += initstate; step
        st_hi, st_lo = _add128(st_hi, st_lo, s_hi, s_lo)
        st_hi, st_lo = _step(st_hi, st_lo, inc_hi, inc_lo)
        out = np.empty((len(seeds), n), np.float64)
        for k in range(n):
            st_hi, st_lo = _step(st_hi, st_lo, inc_hi, inc_lo)
            x = st_hi ^ st_lo
            rot = st_hi >> np.uint64(58)
            u = (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))
            out[:, k] = (u >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    return out
