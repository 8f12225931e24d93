"""MaskGenerator: definitions of every mask type, frequencies, validation, edges
(Open-Sora 1.2's `opensora/utils/train_utils.py`)."""
import jax
import numpy as np
import pytest

from jaxsora.diffusion.masks import MASK_TYPES, MaskGenerator

# Open-Sora 1.2 configs/opensora-v1-2/train/stage1.py and stage2.py mask_ratios.
STAGE1 = {"random": 0.05, "intepolate": 0.005, "quarter_random": 0.005, "quarter_head": 0.005, "quarter_tail": 0.005,
          "quarter_head_tail": 0.005, "image_random": 0.025, "image_head": 0.05, "image_tail": 0.025,
          "image_head_tail": 0.025}
STAGE2 = {"random": 0.005, "intepolate": 0.002, "quarter_random": 0.007, "quarter_head": 0.002, "quarter_tail": 0.002,
          "quarter_head_tail": 0.002, "image_random": 0.0, "image_head": 0.22, "image_tail": 0.005,
          "image_head_tail": 0.005}


def _obeys(name, m):
    """Does the [T] bool mask m fit the definition of mask type `name`? (False = condition frame)"""
    t = len(m)
    off = np.nonzero(~m)[0]
    if t <= 1:
        return m.all()
    q = max(t // 4, 1)
    k = len(off)
    if name == "identity":
        return k == 0
    if name == "quarter_random":
        return 1 <= k <= q and off[-1] - off[0] == k - 1
    if name == "quarter_head":
        return 1 <= k <= q and np.array_equal(off, np.arange(k))
    if name == "quarter_tail":
        return 1 <= k <= q and np.array_equal(off, np.arange(t - k, t))
    if name == "quarter_head_tail":
        return any(np.array_equal(off, np.union1d(np.arange(j), np.arange(t - j, t))) for j in range(1, q + 1))
    if name == "image_random":
        return k == 1
    if name == "image_head":
        return np.array_equal(off, [0])
    if name == "image_tail":
        return np.array_equal(off, [t - 1])
    if name == "image_head_tail":
        return np.array_equal(off, [0, t - 1])
    if name == "intepolate":
        return np.array_equal(off, np.arange(0, t, 2)) or np.array_equal(off, np.arange(1, t, 2))
    if name == "random":
        return m.any()
    raise AssertionError(name)


UNIFORM = {n: 1 / len(MASK_TYPES) for n in MASK_TYPES}


@pytest.mark.parametrize("t", [15, 2, 1])
def test_every_type_obeys_its_definition(t):
    gen = MaskGenerator(UNIFORM)
    masks, types = gen.get_masks_and_types(jax.random.key(t), 2200, t)
    masks, types = np.asarray(masks), np.asarray(types)
    assert masks.shape == (2200, t) and masks.dtype == bool
    for m, i in zip(masks, types):
        assert _obeys(gen.names[i], m), (gen.names[i], t, m)
    assert set(types) == set(range(len(MASK_TYPES)))  # every type drawn
    if t == 15:  # the random parts cover their ranges (≈ 200 draws per type)
        by = {n: masks[types == i] for i, n in enumerate(gen.names)}
        assert set((~by["quarter_random"]).sum(1)) == {1, 2, 3}
        assert set((~by["quarter_head"]).sum(1)) == {1, 2, 3}
        assert set(np.argmin(by["quarter_random"], 1)) == set(range(15))  # start of the run
        assert set(np.argmin(by["image_random"], 1)) == set(range(15))
        assert set(np.argmin(by["intepolate"], 1)) == {0, 1}
        kept = by["random"].mean(1)  # frame kept iff rand > U(0.1, 0.9)
        assert 0.4 < kept.mean() < 0.6 and kept.min() < 0.3 and kept.max() > 0.7


@pytest.mark.parametrize("ratios", [STAGE1, STAGE2], ids=["stage1", "stage2"])
def test_frequencies_match_ratios(ratios):
    gen = MaskGenerator(dict(ratios))
    n = 20_000
    masks, types = gen.get_masks_and_types(jax.random.key(3), n, 15)
    masks, types = np.asarray(masks), np.asarray(types)
    for i, name in enumerate(gen.names):
        assert abs((types == i).mean() - gen.mask_ratios[name]) < 0.01, name
    assert gen.names[-1] == "identity" and gen.mask_ratios["identity"] == pytest.approx(1 - sum(ratios.values()))
    for m, i in zip(masks[:4000], types[:4000]):
        assert _obeys(gen.names[i], m)
    # the masks themselves: the share of all-True masks ≈ identity (+ rare all-True "random")
    assert abs(masks.all(1).mean() - gen.mask_ratios["identity"]) < 0.01
    # get_masks draws the same masks as get_masks_and_types
    np.testing.assert_array_equal(np.asarray(gen.get_masks(jax.random.key(3), 16, 15)), masks[:16])


def test_identity_and_determinism():
    """(T ≤ 1 and quarter_* with T < 4 are covered by test_every_type_obeys_its_definition.)"""
    assert MaskGenerator({"random": 0.0}).mask_ratios["identity"] == 1.0  # Lambda stages 4–7
    g = MaskGenerator(STAGE1)
    a, b = g.get_masks(jax.random.key(5), 64, 15), g.get_masks(jax.random.key(5), 64, 15)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(g.get_masks(jax.random.key(6), 64, 15)))
    assert np.asarray(jax.jit(lambda k: g.get_mask(k, 15))(jax.random.key(5))).shape == (15,)  # inside jit


def test_validation():
    with pytest.raises(ValueError, match="unknown mask type.*interpolate"):
        MaskGenerator({"interpolate": 0.1})  # the configs' key is the reference's "intepolate"
    with pytest.raises(ValueError, match="sum to 1"):
        MaskGenerator({"identity": 0.5, "random": 0.2})
    with pytest.raises(ValueError, match="sum to 1"):
        MaskGenerator({"random": 0.7, "image_head": 0.6})  # identity would be −0.3
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        MaskGenerator({"random": -0.1, "image_head": 0.2})
    MaskGenerator({"identity": 0.5, "random": 0.5 + 5e-7})  # within the reference's 1e-6
