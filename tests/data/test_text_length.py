"""Captions cut to the batch's valid tokens (jaxsora/data/text_length.py): the lengths chosen, and that
cutting changes no number — STDiT3's loss and every gradient, with and without caption dropout, and
T5's states of the valid tokens."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.data import text_length as tl
from jaxsora.diffusion import rflow
from jaxsora.models.presets import get_model_config
from tests.conftest import FIXTURES

G = np.load(FIXTURES / "rflow_golden.npz")


def test_valid_length_is_the_last_valid_token_over_rows():
    m = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert tl.valid_length(m) == 4
    assert tl.valid_length(np.zeros((2, 5))) == 0
    assert tl.valid_length(np.array([[1, 0, 0, 1, 0]])) == 4  # not a prefix: the last valid one counts


def test_fitted_length_takes_the_shortest_that_holds_it():
    assert tl.fitted_length(40, (75, 150), 300) == 75
    assert tl.fitted_length(75, (75, 150), 300) == 75
    assert tl.fitted_length(76, (150, 75), 300) == 150
    assert tl.fitted_length(151, (75, 150), 300) == 300
    assert tl.fitted_length(3, (75, 150), 48) == 48  # lengths at or above the maximum are never used
    assert tl.fitted_length(0, (), 300) == 300
    mask = (np.arange(300)[None] < np.array([[40], [76]])).astype(np.int32)  # rows of 40 and 76 valid tokens
    assert tl.length_for(mask, (75, 150)) == 150 and tl.length_for(mask[:1], (75, 150)) == 75


def test_check_lengths_refuses_what_is_not_token_counts():
    assert tl.check_lengths([150, 75, 75]) == (75, 150)
    assert tl.check_lengths(()) == ()
    for bad in (["a"], [0], [-3], 5):
        with pytest.raises(ValueError, match="data.text_lengths"):
            tl.check_lengths(bad)


def test_cut_keeps_every_valid_token_and_refuses_to_drop_one():
    ids = np.arange(12).reshape(2, 6)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    out = tl.cut(dict(ids=ids, text_mask=mask, fps=np.ones(2)), 3)
    assert out["ids"].shape == (2, 3) and out["text_mask"].shape == (2, 3) and out["fps"].shape == (2,)
    np.testing.assert_array_equal(out["ids"], ids[:, :3])
    states = np.zeros((2, 6, 4), np.float32)  # cached text states cut along the token axis too
    assert tl.cut(dict(ids=states, text_mask=mask), 3)["ids"].shape == (2, 3, 4)
    assert tl.cut(dict(ids=ids, text_mask=mask), 6)["ids"] is ids
    with pytest.raises(AssertionError):
        tl.cut(dict(ids=ids, text_mask=mask), 2)


@pytest.fixture(scope="module")
def model():
    return from_torch_state_dict(read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors")),
                                 get_model_config("tiny"))


def _loss(model, y, mask, drop):
    rows = np.array([0, 2])  # the golden batch's two captions shorter than 8 tokens (3 and 5 valid)
    cond = dict(y=y, mask=mask, fps=G["loss_fps"][rows], height=G["loss_h"][rows], width=G["loss_w"][rows],
                force_drop_ids=drop)
    return rflow.training_loss_explicit(model, G["loss_x0"][rows], cond, G["loss_noise"][rows], G["loss_t"][rows],
                                        x_mask=G["loss_x_mask"][rows]).mean()


@pytest.mark.parametrize("drop", [[0, 0], [1, 0]], ids=["captions", "one-dropped"])
def test_stdit3_loss_and_grads_equal_on_cut_captions(model, drop):
    rows = np.array([0, 2])
    y, mask = G["loss_y"][rows], G["loss_mask"][rows]
    n = tl.valid_length(mask)
    assert n == 5 < mask.shape[1]
    grad_fn = nnx.jit(nnx.value_and_grad(_loss))
    full, g_full = grad_fn(model, y, mask, np.array(drop))
    cut, g_cut = grad_fn(model, y[:, :, :n], mask[:, :n], np.array(drop))
    assert abs(float(full) - float(cut)) <= 1e-6 * abs(float(full))
    flat_full, flat_cut = dict(nnx.to_flat_state(g_full)), dict(nnx.to_flat_state(g_cut))
    assert flat_full.keys() == flat_cut.keys()
    for k in flat_full:
        a, b = np.asarray(flat_full[k][...]), np.asarray(flat_cut[k][...])
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * (np.abs(a).max() + 1e-12), err_msg=str(k))
    # the dropped caption's null embedding reached the loss (else the case tests nothing)
    if drop[0]:
        assert abs(float(full) - float(grad_fn(model, y, mask, np.array([0, 0]))[0])) > 1e-6


def test_t5_valid_states_do_not_depend_on_the_padding_after_them():
    from jaxsora.models import t5 as t5_lib

    cfg = t5_lib.tiny_t5_config(32, 2, 2, 64, None)
    enc = t5_lib.T5EncoderModel(cfg, rngs=nnx.Rngs(0), dtype=jax.numpy.float32, param_dtype=jax.numpy.float32)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg.vocab_size, (2, 12)).astype(np.int32)
    mask = (np.arange(12)[None] < np.array([[4], [7]])).astype(np.int32)
    ids = np.where(mask == 1, ids, 0)
    full = np.asarray(enc(ids, mask))
    cut = np.asarray(enc(ids[:, :7], mask[:, :7]))
    np.testing.assert_allclose(cut[0, :4], full[0, :4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cut[1, :7], full[1, :7], rtol=1e-5, atol=1e-6)
