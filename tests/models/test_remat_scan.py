"""Gradient checkpointing policies, Open-Sora's per-block selection and the scanned block pairs:
the same loss and gradients as the plain model, and — since none of them changes a number — each
is checked in the compiled program too: remat puts its barriers in the traced program and its
recomputation in the compiled one, a scan compiles one pair whatever the depth, and rematerialized
scanned blocks need less memory."""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import to_torch_state_dict
from jaxsora.models.config import REMAT_SAVED_NAMES, RematChoice
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import REMAT_POLICIES, STDiT3, remat_override

X = np.random.default_rng(0).standard_normal((2, 4, 3, 8, 8)).astype(np.float32)
T = np.array([100.0, 700.0], np.float32)
Y = 0.1 * np.random.default_rng(1).standard_normal((2, 1, 8, 32)).astype(np.float32)
MASK = np.array([[1] * 5 + [0] * 3, [1] * 8], np.int32)


def _split(depth=3, **kw):
    model = STDiT3(get_model_config("tiny", depth=depth, **kw), rngs=nnx.Rngs(0))
    return nnx.split(model)


def _grad_fn(graphdef, x=X, t=T, y=Y, mask=MASK):
    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(x, t, y, mask) ** 2)

    return jax.jit(jax.value_and_grad(loss))


@pytest.fixture(scope="module")
def plain():
    graphdef, state = _split()
    return state, _grad_fn(graphdef)(state)


CASES = [dict(remat=p) for p in REMAT_POLICIES if p != "none"] + [dict(remat="auto"),
    dict(remat="full", remat_blocks=1), dict(scan_blocks=True), dict(scan_blocks=True, remat="full"),
    dict(scan_blocks=True, remat="dots_with_no_batch_dims", remat_blocks=2)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_same_loss_and_gradients(plain, kw):
    state, (loss, grads) = plain
    graphdef, _ = _split(**kw)
    loss2, grads2 = _grad_fn(graphdef)(state)  # the same parameters: the tree does not change
    assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-7)


def test_parameters_and_conversion_unchanged_by_scan():
    a = STDiT3(get_model_config("tiny", depth=3), rngs=nnx.Rngs(0))
    b = STDiT3(get_model_config("tiny", depth=3, scan_blocks=True, remat="full"), rngs=nnx.Rngs(0))
    sa, sb = to_torch_state_dict(a), to_torch_state_dict(b)
    assert list(sa) == list(sb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k])


def _lowered(depth=3, **kw):
    graphdef, state = _split(depth=depth, **kw)
    return _grad_fn(graphdef).lower(state)


@pytest.mark.parametrize("blocks, expect", [(-1, 3), (1, 1), (0, 0)])
def test_remat_reaches_the_program(blocks, expect):
    # one optimization barrier per rematerialized block pair in the traced program ...
    assert _lowered(remat="full", remat_blocks=blocks).as_text().count("optimization_barrier") == expect
    # ... and its forward is recomputed in the compiled one
    dots = lambda kw: _lowered(**kw).compile().as_text().count(" dot(")  # noqa: E731
    if expect:
        assert dots(dict(remat="full", remat_blocks=blocks)) > dots(dict())


def test_scan_compiles_one_pair_whatever_the_depth():
    def count(depth, **kw):
        hlo = _lowered(depth=depth, scan_blocks=True, **kw).compile().as_text()
        return hlo.count(" while("), hlo.count(" dot(")

    (w2, d2), (w5, d5) = count(2), count(5)
    assert w2 >= 2 and (w2, d2) == (w5, d5)  # forward and backward loops; the same program at depth 2 and 5
    unrolled = _lowered(depth=5).compile().as_text().count(" dot(")
    assert d5 < unrolled / 2


def test_remat_of_scanned_blocks_saves_memory():
    x = np.ones((2, 4, 4, 32, 32), np.float32)
    y = np.ones((2, 1, 8, 32), np.float32)

    def temp(**kw):
        graphdef, state = _split(depth=4, scan_blocks=True, **kw)
        return _grad_fn(graphdef, x=x, y=y, mask=None).lower(state).compile().memory_analysis().temp_size_in_bytes

    assert temp(remat="full") < 0.5 * temp()


@pytest.mark.parametrize("bad", [dict(remat="sometimes"), dict(remat_blocks=7), dict(remat_blocks=-2)])
def test_bad_remat_settings_are_refused(bad):
    with pytest.raises(ValueError):
        get_model_config("tiny", depth=3, **bad)


def test_old_boolean_remat_still_reads():
    assert get_model_config("tiny", remat=True).remat == "full"
    assert get_model_config("tiny", remat=False).remat == "none"


def _saved(graphdef, state) -> list[str]:
    """What the backward of the loss keeps, one line per residual (jax's own report of them)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda s: jnp.mean(nnx.merge(graphdef, s)(X, T, Y, MASK) ** 2), state)
    return out.getvalue().splitlines()


def _names(lines) -> dict:
    counts = {}
    for line in lines:
        m = re.search(r"named '(\w+)'", line)
        if m:
            counts[m[1]] = counts.get(m[1], 0) + 1
    return counts


# Outside the blocks the caption embedder's MLP keeps its named outputs as any layer without remat does
OUTSIDE_BLOCKS = dict(mlp_hidden=1, mlp_out=1)


@pytest.mark.parametrize("policy", sorted(REMAT_SAVED_NAMES))
def test_named_policies_keep_exactly_their_matmul_outputs(policy):
    """Each named policy keeps the outputs its names say, of every block and nothing else named: per block
    (depth 3: 6 blocks) three q/k/v projections (self qkv, cross q, cross kv), two attention outputs, two output
    projections, one MLP hidden state and one MLP output."""
    graphdef, state = _split(remat=policy)
    per_block = dict(qkv=3, attn_out=2, proj=2, mlp_hidden=1, mlp_out=1)
    want = {n: 6 * per_block[n] for n in REMAT_SAVED_NAMES[policy]}
    for n, k in OUTSIDE_BLOCKS.items():
        want[n] = want.get(n, 0) + k
    assert _names(_saved(graphdef, state)) == want


def test_auto_outside_the_plan_and_the_override():
    """An unresolved "auto" (a model traced outside the train step's plan) keeps what full remat keeps; the
    override the train step traces each bucket under replaces the config's remat."""
    full = _saved(*_split(remat="full"))
    assert _names(full) == OUTSIDE_BLOCKS  # full: nothing of the blocks
    auto_graphdef, state = _split(remat="auto")
    assert _saved(auto_graphdef, state) == full
    with remat_override(RematChoice("save_qkv_proj")):
        assert _names(_saved(auto_graphdef, state)) == dict(qkv=18, proj=12, **OUTSIDE_BLOCKS)
    with remat_override(RematChoice("full", 1)):  # one pair of three rematerialized: the other two keep all
        assert _names(_saved(auto_graphdef, state))["mlp_hidden"] == 4 + OUTSIDE_BLOCKS["mlp_hidden"]
