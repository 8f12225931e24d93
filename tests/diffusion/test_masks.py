"""MaskGenerator: definitions of every mask type, frequencies, validation (spec §5)."""
import jax
import numpy as np
import pytest

from jaxsora.diffusion.masks import MASK_TYPES, MaskGenerator

STAGE1 = {"random": 0.05, "intepolate": 0.005, "quarter_random": 0.005, "quarter_head": 0.005, "quarter_tail": 0.005,
          "quarter_head_tail": 0.005, "image_random": 0.025, "image_head": 0.05, "image_tail": 0.025,
          "image_head_tail": 0.025}
STAGE2 = {"random": 0.005, "intepolate": 0.002, "quarter_random": 0.007, "quarter_head": 0.002, "quarter_tail": 0.002,
          "quarter_head_tail": 0.002, "image_random": 0.0, "image_head": 0.22, "image_tail": 0.005,
          "image_head_tail": 0.005}


def _classify(m):
    """Name of the (unique) mask type that can produce the [T] mask m, or a set of candidates."""
    t = len(m)
    f = ~m
    idx = np.nonzero(f)[0]
    if not f.any():
        return {"identity", "random"}
    cands = set()
    if len(idx) == 1:
        cands |= {"image_random"} | ({"image_head"} if idx[0] == 0 else set()) | \
            ({"image_tail"} if idx[0] == t - 1 else set())
    runs = np.split(idx, np.nonzero(np.diff(idx) != 1)[0] + 1)
    q = t // 4
    if len(runs) == 1 and len(idx) <= q:
        cands.add("quarter_random")
        if idx[0] == 0:
            cands.add("quarter_head")
        if idx[-1] == t - 1:
            cands.add("quarter_tail")
    if len(runs) == 2 and runs[0][0] == 0 and runs[1][-1] == t - 1 and len(runs[0]) == len(runs[1]) <= q:
        cands.add("quarter_head_tail")
        if len(runs[0]) == 1:
            cands.add("image_head_tail")
    if np.array_equal(idx, np.arange(0, t, 2)) or np.array_equal(idx, np.arange(1, t, 2)):
        cands.add("intepolate")
    if m.any():
        cands.add("random")
    return cands


@pytest.mark.parametrize("name", [n for n in MASK_TYPES if n != "identity"])
def test_each_type_obeys_its_definition(name):
    gen = MaskGenerator({name: 1.0})
    for t in (15, 8, 4):
        masks = np.asarray(jax.jit(lambda k: gen.get_masks(k, 300, t))(jax.random.key(t)))
        for m in masks:
            assert name in _classify(m), (name, t, m)
        if name == "random":
            assert masks.any(1).all()


def test_identity_and_single_frames():
    assert np.asarray(MaskGenerator({"identity": 1.0}).get_masks(jax.random.key(0), 5, 15)).all()
    assert np.asarray(MaskGenerator({"image_head": 1.0}).get_masks(jax.random.key(0), 5, 1)).all()  # T ≤ 1
    # quarter_* with T < 4 (T // 4 = 0): conditions one frame instead of crashing
    m = np.asarray(MaskGenerator({"quarter_head": 1.0}).get_masks(jax.random.key(0), 5, 3))
    assert (m.sum(1) == 2).all()


@pytest.mark.parametrize("ratios", [STAGE1, STAGE2], ids=["stage1", "stage2"])
def test_frequencies_match_ratios(ratios):
    gen = MaskGenerator(dict(ratios))
    n = 20_000
    u = jax.random.uniform(jax.random.key(7), (n,))
    idx = np.asarray(jax.vmap(gen.mask_type_index)(u))
    names = gen._names
    for i, name in enumerate(names):
        assert abs((idx == i).mean() - gen.mask_ratios[name]) < 0.01, name
    # and the masks themselves: the share of all-True masks ≈ identity (+ rare all-True "random")
    masks = np.asarray(jax.jit(lambda k: gen.get_masks(k, n, 15))(jax.random.key(3)))
    assert abs(masks.all(1).mean() - gen.mask_ratios["identity"]) < 0.01


def test_validation():
    with pytest.raises(ValueError, match="unknown mask type"):
        MaskGenerator({"interpolate": 0.1})
    with pytest.raises(ValueError, match="sum to 1"):
        MaskGenerator({"identity": 0.5, "random": 0.2})
    with pytest.raises(ValueError, match="sum to 1"):
        MaskGenerator({"random": 0.7, "image_head": 0.6})
    assert MaskGenerator({"random": 0.0}).mask_ratios["identity"] == 1.0
