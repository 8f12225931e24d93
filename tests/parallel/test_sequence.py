"""Ulysses attention and the sequence-parallel STDiT3 equal their unsharded versions."""
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.models.layers import attention
from jaxsora.models.presets import get_model_config
from jaxsora.parallel.constraints import logical_rules
from jaxsora.parallel.sequence import ulysses_attention
from tests.conftest import FIXTURES, rel_err

RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("seq", "sequence"))


def _mesh(data, fsdp, seq):
    return jax.make_mesh((data, fsdp, seq), ("data", "fsdp", "sequence"), axis_types=(AxisType.Auto,) * 3)


def test_ulysses_attention_equals_plain():
    mesh = _mesh(2, 1, 4)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 16, 8, 8)).astype(np.float32) for _ in range(3))
    fn = lambda a, b, c: attention(a, b, c, impl=None)  # noqa: E731
    ref = fn(q, k, v)
    sh = NamedSharding(mesh, P("data", "sequence"))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a, b, c: ulysses_attention(a, b, c, mesh=None, axis_name="sequence", attn_fn=fn))(
            *(jax.device_put(x, sh) for x in (q, k, v)))
    assert rel_err(out, ref) <= 1e-6


def test_sequence_parallel_stdit3_equals_single_device():
    io = np.load(FIXTURES / "stdit3_tiny_io.npz")
    sd = read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors"))
    plain = from_torch_state_dict(sd, get_model_config("tiny"))
    sp = from_torch_state_dict(sd, get_model_config("tiny", sequence_parallel_axis="sequence"))
    args = [np.concatenate([io[f"xmask/{k}"]] * 2) for k in ("x", "timestep", "y", "mask", "x_mask")]
    ref = nnx.jit(lambda m, *a: m(*a))(plain, *args)
    mesh = _mesh(2, 2, 2)
    graphdef, state = nnx.split(sp)

    @jax.jit
    def fwd(state, *a):
        with logical_rules(RULES):
            return nnx.merge(graphdef, state)(*a)

    with jax.set_mesh(mesh):
        out = fwd(state, *args)
    assert rel_err(out, ref) <= 1e-5
