"""The train step as the loop builds it, on 8 CPU devices: its compiled HLO holds the collectives
of the configured parallelism (an equality test alone passes when a sharding path never runs),
and its loss and gradients equal the sequence-parallel-free run — also when the image tokens do
not divide the sequence axis and are padded."""
import re

import jax
import numpy as np
import pytest

from jaxsora.parallel.mesh import MeshError
from jaxsora.train.run.setup import fresh_state, setup_run
from jaxsora.train.step.train_step import global_batch
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader


def _setup(tmp_path, mesh, heads=2):
    c = small_config(tmp_path, mesh=mesh)
    c.model.num_heads = heads
    return setup_run(c)


def _lowered(setup, size=(4, 16, 16), batch=4):
    return setup.step.lower(setup.batch_spec(size, batch), setup.encoders.weights)


def _hlo(setup, size=(4, 16, 16), batch=4):
    return _lowered(setup, size, batch).compile().as_text()


def _ulysses_all_to_all(hlo: str) -> int:
    """all-to-all instructions that come from `jax.lax.all_to_all` (Ulysses), not from resharding
    the SPMD partitioner may insert on its own."""
    return len(re.findall(r"all-to-all\(.*op_name=\"[^\"]*/all_to_all\"", hlo))


def _host_batch(setup, size, batch=4):
    t, h, w = size
    loader = FakeLoader(data_parallel_size=setup.data_parallel_size, per_device_batch=batch // setup.data_parallel_size,
                        frames=t, size=(h, w), text_inputs=setup.encoders.text_inputs)
    return next(iter(loader))


def test_hlo_has_the_collectives_of_the_mesh(tmp_path):
    assert jax.device_count() >= 8
    sp = _setup(tmp_path, (2, 2, 2))
    lowered = _lowered(sp)
    # the activation-sharding constraints and the Ulysses shard_map are in the traced program ...
    assert lowered.as_text().count("sharding_constraint") > 0
    hlo = lowered.compile().as_text()
    # ... and its all-to-alls in the compiled one: 4 per spatial block forward, 4 backward
    assert _ulysses_all_to_all(hlo) == 8 * sp.model_config.depth
    assert "reduce-scatter" in hlo or "all-gather" in hlo, "FSDP left no collective in the step"
    # traced outside the mesh (what the loop once did), both vanish while the numbers stay the same
    outside = sp.step._jit.lower(sp.plan.abstract_sharded, sp.batch_spec((4, 16, 16), 4), sp.encoders.weights)
    assert outside.as_text().count("sharding_constraint") == 0
    assert _ulysses_all_to_all(outside.compile().as_text()) == 0
    plain = _hlo(_setup(tmp_path, (4, 1, 1)))  # pure data parallelism: no all-to-all, no parameter gathers
    assert "all-to-all" not in plain and "all-gather" not in plain
    assert "all-reduce" in plain  # the gradient mean over the data axis


def test_hlo_has_all_to_all_when_tokens_are_padded(tmp_path):
    # 12×20 pixels → 6×10 latents → 3×5 = 15 patches per frame: odd, padded to 16 for sp = 2
    sp = _setup(tmp_path, (2, 2, 2))
    assert _ulysses_all_to_all(_hlo(sp, size=(4, 12, 20))) == 8 * sp.model_config.depth


@pytest.mark.parametrize("size", [(4, 16, 16), (4, 12, 20)])
def test_sequence_parallel_loss_and_grads_equal_sp1(tmp_path, size):
    ref = _setup(tmp_path / "sp1", (4, 1, 1))
    sp = _setup(tmp_path / "sp2", (2, 2, 2))
    host = _host_batch(ref, size)
    state = fresh_state(ref)
    loss1, g1 = ref.step.loss_and_grads(state, global_batch(host, ref.mesh), ref.encoders.weights)
    # the same numbers, placed in the sequence-parallel run's shardings
    state_sp = jax.device_put(jax.device_get(state), sp.plan.shardings)
    loss2, g2 = sp.step.loss_and_grads(state_sp, global_batch(host, sp.mesh), sp.encoders.weights)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(g1)), jax.tree.leaves(jax.device_get(g2))):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_sequence_axis_must_divide_heads(tmp_path):
    with pytest.raises(MeshError, match="does not divide the model's 2 attention heads"):
        _setup(tmp_path, (1, 2, 4))
