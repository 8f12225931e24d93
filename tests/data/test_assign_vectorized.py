"""The vectorized bucket assignment equals the scalar one (which `test_buckets.py` checks against
the real reference), and `pcg.uniforms` equals numpy's own generator, bit for bit."""
import importlib.util
import os

import numpy as np
import pytest

from jaxsora.data.buckets import Buckets
from jaxsora.data.pcg import uniforms

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _stage_buckets(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config().data.bucket_config.to_dict()


def test_uniforms_equal_numpy_default_rng():
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 2, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**63, 2**64 - 1], np.uint64)
    near_2_63 = np.uint64(2**63) - np.arange(1, 20, dtype=np.uint64) * np.uint64(7919)
    seeds = np.concatenate([edges, near_2_63, rng.integers(0, 2**63, 1000, dtype=np.uint64),
                            rng.integers(0, 2**32, 1000, dtype=np.uint64)])
    ours = uniforms(seeds, 2)
    ref = np.array([np.random.default_rng(int(s)).random(2) for s in seeds])
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3"])
@pytest.mark.parametrize("frame_interval", [1, 3])
def test_assign_many_equals_assign(stage, frame_interval):
    buckets = Buckets(_stage_buckets(stage))
    rng = np.random.default_rng([int(stage[-1]), frame_interval])  # deterministic (str hash is not)
    n = 800
    frames = sorted({f for fr in buckets.probs.values() for f in fr})
    edges = np.array([f * frame_interval + d for f in frames for d in (0, 1)])  # T at the strict-rule edge
    t = np.where(rng.random(n) < 0.2, 1, rng.integers(2, 420 * frame_interval, n))  # images and videos
    t = np.where(rng.random(n) < 0.2, rng.choice(edges, n), t)
    side = rng.integers(100, 3841, (n, 2))  # both orientations
    h, w = side[:, 0], np.where(rng.random(n) < 0.5, side[:, 1], (side[:, 0] * 16) // 9)
    exact = np.array([hw for res in buckets.res_order for hw in buckets.tables[res][1].values()])
    pick = rng.random(n) < 0.15  # a bucket's own size: exact ratios, pixel counts at the edges
    h[pick], w[pick] = exact[rng.integers(0, len(exact), pick.sum())].T
    rows = rng.choice([0, 1, 7, 4_500_000, 9_000_000], n) + np.arange(n)  # row seeds beyond 2**32 too
    for epoch in (0, 5):
        seeds = buckets.row_seeds(42, epoch, rows)
        codes = buckets.assign_many(t, h, w, seeds, frame_interval)
        got = [None if c < 0 else buckets.bucket_keys[c] for c in codes]
        want = [buckets.assign(int(a), int(b), int(c), buckets.row_seed(42, epoch, int(r)), frame_interval)
                for a, b, c, r in zip(t, h, w, rows)]
        assert got == want
        assert sum(g is not None for g in got) > n // 4  # the cases exercise the kept paths too
    assert int(seeds.max()) > 2**32
