"""The model FLOPs behind the logged MFU (jaxsora.train.plan.mfu) against XLA's own count of the compiled
train step, built as the loop builds it: a full run and a LoRA run (frozen base), at a shape where
attention is a quarter of the forward. XLA also counts elementwise work (softmax, norms, the
optimizer), so its count is a little above ours; ours must never be above it — an MFU that claims
FLOPs the step does not run is the failure this guards against (a LoRA run counted as 3 × forward)."""
import pytest

from jaxsora.train.plan.mfu import forward_flops, train_flops_per_sample
from jaxsora.train.run.setup import setup_run
from tests.train.common import small_config

SIZE = (8, 64, 64)  # pixels (T, H, W): 8 × 32 × 32 latent with the demo's 2× pooling


def _counts(tmp_path, lora_rank: int) -> tuple[float, float, float]:
    """(XLA's FLOPs of one compiled step, our train FLOPs of its batch, our forward FLOPs)."""
    c = small_config(tmp_path, mesh=(1, 1, 1))
    c.model.update(dict(depth=2, hidden_size=64, num_heads=4, remat="none"))
    c.text_encoder.update(dict(model_max_length=32))
    c.train.max_param_norm_growth = 0  # the guard's extra parameter norm is not model work
    if lora_rank:
        c.lora.update(dict(rank=lora_rank, alpha=1.0, targets=("all",)))
    setup = setup_run(c)
    batch = 2
    compiled = setup.step.lower(setup.batch_spec(SIZE, batch), setup.encoders.weights).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    latent = setup.encoders.latent_size(SIZE)
    ours = batch * train_flops_per_sample(setup.model_config, latent, frozen_base=bool(lora_rank))
    return float(cost["flops"]), ours, batch * forward_flops(setup.model_config, latent,
                                                              setup.model_config.model_max_length)


def test_train_flops_agree_with_xla_for_a_full_and_a_lora_step(tmp_path):
    xla_full, ours_full, fwd = _counts(tmp_path / "full", 0)
    xla_lora, ours_lora, _ = _counts(tmp_path / "lora", 1)
    assert ours_full == pytest.approx(3 * fwd)
    # ours ≤ XLA's, and within its elementwise overhead (measured: 5 % full, 10 % LoRA here)
    assert ours_full <= xla_full <= 1.12 * ours_full, (xla_full, ours_full)
    assert ours_lora <= xla_lora <= 1.15 * ours_lora, (xla_lora, ours_lora)
    # 3 × forward for the LoRA step would claim more than the compiled step runs
    assert 3 * fwd > xla_lora
