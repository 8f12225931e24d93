"""STDiT3 under a device mesh, with remat, and in bf16: same function as the plain forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from jaxsora.convert import from_torch_state_dict, read_state_dict
from jaxsora.models.presets import get_model_config
from jaxsora.parallel.constraints import logical_rules, logical_to_spec
from tests.conftest import FIXTURES, rel_err

IO = np.load(FIXTURES / "stdit3_tiny_io.npz")
FWD = nnx.jit(lambda m, *a, **kw: m(*a, **kw))
RULES = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("heads", None), ("mlp", None), ("seq", None))


def _model(**kw):
    return from_torch_state_dict(read_state_dict(str(FIXTURES / "stdit3_tiny_ref.safetensors")),
                                 get_model_config("tiny", **kw))


def _args(case="xmask", batch=None):
    g = lambda k: IO[f"{case}/{k}"] if f"{case}/{k}" in IO.files else None  # noqa: E731
    args = [g(k) for k in ("x", "timestep", "y", "mask", "x_mask")]
    if batch:  # tile the batch so it divides the data axes
        args = [np.concatenate([a] * (batch // a.shape[0])) if a is not None else None for a in args]
    return args


def test_forward_on_8_device_mesh_equals_single_device():
    assert len(jax.devices()) >= 8
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    model = _model()
    args = _args(batch=8)
    ref = np.asarray(FWD(model, *args))

    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, logical_to_spec(tuple(p), RULES)), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    state = jax.device_put(state, shardings)
    assert any(len(v.sharding.device_set) == 8 and not v.sharding.is_fully_replicated
               for v in jax.tree.leaves(state)), "no parameter got sharded"
    batch_sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    args = [jax.device_put(a, batch_sharding) for a in args]

    @jax.jit
    def fwd(state, *a):
        with logical_rules(RULES):
            return nnx.merge(graphdef, state)(*a)

    with jax.set_mesh(mesh):
        out = fwd(state, *args)
    assert rel_err(out, ref) <= 1e-5


def test_remat_same_output_and_gradients():
    args = _args()
    grads = []
    for remat in (False, True):
        model = _model(remat=remat)
        g = nnx.jit(nnx.grad(lambda m: jnp.mean(m(*args) ** 2)))(model)
        grads.append(jax.tree.leaves(nnx.state(g)))
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_bf16_compute_close_to_fp32():
    args = _args()
    ref = np.asarray(FWD(_model(), *args))
    out = FWD(_model(compute_dtype="bfloat16"), *args)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) < 5e-2  # bf16 rounding through 4 blocks; params stay fp32
    params = nnx.state(_model(compute_dtype="bfloat16"), nnx.Param)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(params))


def test_caption_dropout_uses_null_caption_and_keeps_mask():
    model = _model()
    x, t, y, mask, _ = _args("base")
    null = np.broadcast_to(np.asarray(model.y_embedder.y_embedding[...]), y[:, 0].shape)[:, None]
    dropped = FWD(model, x, t, y, mask, force_drop_ids=np.array([1, 0]))
    manual = FWD(model, x, t, np.concatenate([null[:1], y[1:]]), mask)
    np.testing.assert_allclose(np.asarray(dropped), np.asarray(manual), rtol=1e-6, atol=1e-6)
    keyed = [FWD(model, x, t, y, mask, dropout_key=jax.random.key(i)) for i in range(2)]
    assert all(o.shape == manual.shape for o in keyed)


def test_reference_initialization():
    from jaxsora.models.stdit3 import STDiT3

    m = STDiT3(get_model_config("tiny"), rngs=nnx.Rngs(0))
    t0 = m.temporal_blocks[0]
    for lin in (t0.attn.proj, t0.cross_attn.proj, t0.mlp.fc2, m.fps_embedder.mlp[2]):
        assert not np.asarray(lin.kernel[...]).any()
    k = np.asarray(m.spatial_blocks[0].mlp.fc1.kernel[...])
    bound = np.sqrt(6 / sum(k.shape))  # xavier_uniform
    assert np.abs(k).max() <= bound and np.abs(k).max() > 0.9 * bound
    assert not np.asarray(m.spatial_blocks[0].mlp.fc1.bias[...]).any()
    np.testing.assert_allclose(np.asarray(m.rope.freqs[...]), 1 / 10000 ** (np.arange(0, 16, 2) / 16), rtol=1e-6)


@pytest.mark.parametrize("bad", [dict(hidden_size=66), dict(drop_path=0.1), dict(compute_dtype="int8")])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        get_model_config("tiny", **bad)
