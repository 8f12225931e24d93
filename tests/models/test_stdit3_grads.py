"""Our STDiT3's training gradients vs the real Open-Sora 1.2 STDiT3's (tests/fixtures/gen/stdit3_tiny_grads.py).

The forward is checked in test_stdit3_parity.py; this checks the backward (written-out attention
VJP, modulation, masks) through the real training loss: every trained parameter's gradient, by
state-dict name, with x_mask and text masks of different lengths.
"""
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.convert.torch import to_torch_state_dict
from jaxsora.diffusion import rflow
from jaxsora.models.presets import get_model_config
from tests.conftest import FIXTURES, rel_err

G = np.load(FIXTURES / "rflow_golden.npz")
GRADS = np.load(FIXTURES / "stdit3_tiny_grads.npz")


@pytest.fixture(scope="module")
def model():
    return from_torch_state_dict(read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors")),
                                 get_model_config("tiny"))


def _mean_loss(model, x_mask):
    cond = dict(y=G["loss_y"], mask=G["loss_mask"], fps=G["loss_fps"], height=G["loss_h"], width=G["loss_w"])
    return rflow.training_loss_explicit(model, G["loss_x0"], cond, G["loss_noise"], G["loss_t"], x_mask=x_mask).mean()


@pytest.mark.parametrize("case", ["plain", "xmask"])
def test_mean_loss_matches_reference(model, case):
    x_mask = G["loss_x_mask"] if case == "xmask" else None
    assert rel_err(nnx.jit(_mean_loss)(model, x_mask), GRADS[f"{case}/loss"]) <= 1e-5


def test_gradients_match_reference(model):
    grads = nnx.jit(nnx.grad(_mean_loss))(model, G["loss_x_mask"])
    ours = to_torch_state_dict({path: v for path, v in nnx.to_flat_state(grads)}, config=model.config)
    ref = {k.split("/", 1)[1]: GRADS[k] for k in GRADS.files if k.startswith("grad/")}
    assert len(ref) > 80 and set(ref) <= set(ours), sorted(set(ref) - set(ours))[:5]
    errs = {k: rel_err(ours[k], ref[k]) for k in ref}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-4, (worst, errs[worst])
    # every block's attention received a gradient (a VJP that dropped a term would give zeros)
    assert all(np.abs(ours[k]).max() > 0 for k in ref if "attn.qkv.weight" in k or "kv_linear.weight" in k)
