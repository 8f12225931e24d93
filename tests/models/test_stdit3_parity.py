"""Our STDiT3 vs golden outputs of the real Open-Sora 1.2 STDiT3 (tests/fixtures/gen/stdit3_tiny.py)."""
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.models.presets import get_model_config
from tests.conftest import FIXTURES, rel_err

IO = np.load(FIXTURES / "stdit3_tiny_io.npz")
CASES = sorted({k.split("/")[0] for k in IO.files if "/" in k})


@pytest.fixture(scope="module")
def model():
    sd = read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors"))
    return from_torch_state_dict(sd, get_model_config("tiny"))


@pytest.fixture(scope="module")
def forward():
    return nnx.jit(lambda m, *a: m(*a))


def test_fixture_covers_the_issue_cases():
    # with/without x_mask, text masks of different lengths, non-square and non-divisible sizes,
    # fps/height/width given, no text mask, images
    assert set(CASES) == {"base", "xmask", "odd", "odd_xmask", "nomask", "image"}
    assert len(set(IO["base/mask"].sum(1))) > 1 and IO["odd/x"].shape[3:] == (7, 9)


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(model, forward, case):
    g = lambda k: IO[f"{case}/{k}"] if f"{case}/{k}" in IO.files else None  # noqa: E731
    args = [g(k) for k in ("x", "timestep", "y", "mask", "x_mask", "fps", "height", "width")]
    out = forward(model, *args)
    ref = g("out")
    assert out.shape == ref.shape and out.dtype == np.float32
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)


def test_all_true_x_mask_equals_no_mask(model, forward):
    g = lambda k: IO[f"base/{k}"]  # noqa: E731
    args = (g("x"), g("timestep"), g("y"), g("mask"))
    a = forward(model, *args, None, g("fps"), g("height"), g("width"))
    all_true = np.ones((g("x").shape[0], g("x").shape[2]), bool)
    b = forward(model, *args, all_true, g("fps"), g("height"), g("width"))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_fixed_final_layer_differs_only_on_condition_frames(model):
    g = lambda k: IO[f"xmask/{k}"]  # noqa: E731
    fixed = from_torch_state_dict(read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors")),
                                  get_model_config("tiny", fix_final_layer_double_mod=True))
    args = (g("x"), g("timestep"), g("y"), g("mask"), g("x_mask"))
    fwd = nnx.jit(lambda m, *a: m(*a))
    a, b = np.asarray(fwd(model, *args)), np.asarray(fwd(fixed, *args))
    xm = g("x_mask")
    for i in range(xm.shape[0]):
        for t in range(xm.shape[1]):
            same = np.allclose(a[i, :, t], b[i, :, t], atol=1e-6)
            assert same == bool(xm[i, t])
