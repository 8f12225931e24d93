"""The fresh train state's program on a GPU: jax's threefry kernel, not XLA:GPU's inline PRNG (whose
compile made XL/2's first start take a minute on an H200). Lowered for CUDA on this CPU machine (a
structural test: the values are the same on either lowering, so no equality test would see it)."""
import jax

from jaxsora.models.presets import get_model_config
from jaxsora.parallel.mesh import logical_rules, make_mesh
from jaxsora.train.step.optim import AdamW
from jaxsora.train.step.state import plan_state


def test_fresh_state_uses_the_threefry_kernel_on_gpu_only():
    mesh = make_mesh(dict(data=-1, fsdp=1, sequence=1), devices=jax.devices()[:1])
    tx = AdamW.from_config(dict(lr=1e-4, warmup_steps=0, lr_schedule="constant", weight_decay=0.0,
                                    ema_decay=0.99)).tx()
    plan = plan_state(get_model_config("tiny"), tx, 0, mesh, logical_rules(mesh))
    with jax.set_mesh(mesh):
        cuda = plan.traced_init.lower(lowering_platforms=("cuda",)).as_text()
        cpu = plan.traced_init.lower().as_text()
    # one kernel call per randomly initialized array family, none inline
    assert cuda.count("stablehlo.custom_call @cu_threefry2x32") >= 10
    assert "cu_threefry2x32" not in cpu and "func.func private @threefry2x32" in cpu
