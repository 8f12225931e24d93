"""LoRA adapters on STDiT3 (jaxsora.models.lora): fresh adapters leave the output unchanged, the
target patterns select the right Linears, a bad pattern is one line, the merged weights give the
adapted model's output, dropout only inside the train step's context; and the train step built as
the loop builds it (setup_run, 8 CPU devices, FSDP 4) trains the adapters alone — base variables
bit-identical, optimizer state and EMA of adapters only, adapters sharded as declared."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.config import ConfigError, validate_config
from jaxsora.convert.native import apply_weights, save_weights
from jaxsora.models import lora
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3
from jaxsora.parallel.sharding import logical_sharding
from jaxsora.train.run.setup import fresh_state, setup_run, weights_only_state
from jaxsora.train.step.train_step import global_batch
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader

TINY = get_model_config("tiny")  # depth 2, hidden 64
SPEC = lora.LoRASpec(rank=4, alpha=8.0, targets=("all", "t_block.1", "final_layer.linear"))


def _inputs(cfg=TINY, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, cfg.in_channels, 3, 8, 8)), jnp.float32)
    t = jnp.asarray([120.0, 870.0])
    y = jnp.asarray(rng.standard_normal((2, 1, cfg.model_max_length, cfg.caption_channels)), jnp.float32)
    mask = jnp.asarray([[1] * cfg.model_max_length, [1] * 3 + [0] * (cfg.model_max_length - 3)], jnp.int32)
    return (x, t, y), dict(mask=mask, x_mask=jnp.asarray([[True, False, True], [True, True, True]]))


@nnx.jit
def _forward(model, args, kw):
    """The model's output, jitted (eager STDiT3 runs op by op: slow). Not for dropout: the dropout
    context is read while tracing."""
    return model(*args, **kw)


def _flat(model) -> dict:
    return {tuple(str(p) for p in k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def _randomize_b(model, seed=1):
    """Nonzero B everywhere (a trained adapter), so that the adapters change the output."""
    rng = np.random.default_rng(seed)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, lora.LoRALinear):
            m.lora_b[...] = jnp.asarray(rng.standard_normal(m.lora_b[...].shape) * 0.05, jnp.float32)


def _names(paths):
    return {".".join(str(p) for p in q) for q in paths}


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_fresh_adapters_leave_the_output_unchanged(compute_dtype):
    cfg = TINY.replace(compute_dtype=compute_dtype)
    base = STDiT3(cfg, rngs=nnx.Rngs(0))
    model = STDiT3(cfg, rngs=nnx.Rngs(0))
    adapted = lora.apply_lora(model, SPEC, seed=0)
    assert len(adapted) == 2 * 2 * 7 + 2
    args, kw = _inputs(cfg)
    np.testing.assert_array_equal(np.asarray(_forward(model, args, kw)), np.asarray(_forward(base, args, kw)))
    # every base variable keeps its path and value; the adapters come beside it
    fb, fl = _flat(base), _flat(model)
    assert {k for k in fl if not lora.is_adapter_path(k)} == set(fb)
    for k, v in fb.items():
        np.testing.assert_array_equal(fl[k], v)
    qkv = model.spatial_blocks[1].attn.qkv
    assert isinstance(qkv, lora.LoRALinear) and type(qkv.lora_a) is lora.LoRAParam
    assert qkv.lora_a[...].shape == (64, 4) and qkv.lora_b[...].shape == (4, 192)
    assert not np.any(np.asarray(qkv.lora_b[...]))  # B = 0
    a = np.asarray(qkv.lora_a[...])  # peft's kaiming-uniform(a=√5): U(±1/√din)
    assert np.abs(a).max() <= 1 / 8 and a.std() > 0.5 / 8 / np.sqrt(3)
    # each adapter's A depends on (seed, its path) only, not on what else is targeted
    other = STDiT3(cfg, rngs=nnx.Rngs(0))
    lora.apply_lora(other, lora.LoRASpec(rank=4, alpha=8.0, targets=("attn.qkv",)), seed=0)
    np.testing.assert_array_equal(np.asarray(other.spatial_blocks[1].attn.qkv.lora_a[...]), a)
    gauss = STDiT3(cfg, rngs=nnx.Rngs(0))
    lora.apply_lora(gauss, lora.LoRASpec(rank=4, alpha=8.0, targets=("attn.qkv",), init="gaussian"), seed=0)
    assert np.asarray(gauss.spatial_blocks[1].attn.qkv.lora_a[...]).std() == pytest.approx(1 / 4, rel=0.2)


def test_adapters_apply_to_an_abstract_model_with_declared_sharding_names():
    model = nnx.eval_shape(lambda: STDiT3(TINY, rngs=nnx.Rngs(0)))
    lora.apply_lora(model, SPEC, seed=0)
    _, params, frozen = nnx.split(model, lora.trainable_filter(model), ...)
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
    assert flat and all(type(v) is lora.LoRAParam for v in flat.values())
    assert not any(lora.is_adapter_path(k) for k, _ in nnx.to_flat_state(frozen))
    names = {k: tuple(v.get_metadata()["out_sharding"]) for k, v in flat.items()}
    assert names["spatial_blocks.0.attn.qkv.lora_a"] == ("embed", None)  # kernel ("embed", "heads")
    assert names["spatial_blocks.0.attn.qkv.lora_b"] == (None, "heads")
    assert names["temporal_blocks.1.mlp.fc2.lora_a"] == ("mlp", None)  # kernel ("mlp", "embed")
    assert names["temporal_blocks.1.mlp.fc2.lora_b"] == (None, "embed")
    assert names["t_block.1.lora_b"] == (None, "adaln")


def test_patterns_select_the_right_modules():
    paths = lora.linear_paths(nnx.eval_shape(lambda: STDiT3(TINY, rngs=nnx.Rngs(0))))
    blocks = [f"{kind}.{i}" for kind in ("spatial_blocks", "temporal_blocks") for i in range(2)]

    def sel(*targets):
        return _names(lora.select(paths, targets))

    assert sel("attention") == {f"{b}.attn.{n}" for b in blocks for n in ("qkv", "proj")}
    assert sel("cross_attention") == {f"{b}.cross_attn.{n}" for b in blocks for n in ("q_linear", "kv_linear", "proj")}
    assert sel("mlp") == {f"{b}.mlp.{n}" for b in blocks for n in ("fc1", "fc2")}  # not t_embedder.mlp.*
    assert sel("all") == sel("attention") | sel("cross_attention") | sel("mlp")
    assert len(sel("all")) == 4 * 7
    assert sel("attn.proj") == {f"{b}.attn.proj" for b in blocks}  # not cross_attn.proj
    assert sel("cross_attn.proj") == {f"{b}.cross_attn.proj" for b in blocks}
    assert sel("temporal_blocks") == {p for p in sel("all") if p.startswith("temporal_blocks")}
    assert sel("spatial_blocks.1.mlp.fc1") == {"spatial_blocks.1.mlp.fc1"}
    assert sel("spatial_blocks.*.cross_attn.q_linear") == {f"spatial_blocks.{i}.cross_attn.q_linear" for i in range(2)}
    assert sel("t_block.1", "final_layer.linear") == {"t_block.1", "final_layer.linear"}
    assert sel("y_proj") == {"y_embedder.y_proj.fc1", "y_embedder.y_proj.fc2"}
    assert sel("attn.qkv,mlp.fc2") == sel("attn.qkv") | sel("mlp.fc2")  # --config.lora.targets=a,b
    assert lora.expand_targets(["attention", "mlp.fc1"]) == ("attn.qkv", "attn.proj", "mlp.fc1")


@pytest.mark.parametrize("target", ["attn.q", "x_embedder.proj", "spatial_blocks.7.attn.qkv", "attentions"])
def test_a_bad_pattern_is_one_line_naming_the_modules(target):
    with pytest.raises(lora.LoRAError) as e:
        lora.check_targets(lora.LoRASpec(rank=4, alpha=4.0, targets=("attention", target)), TINY)
    msg = str(e.value)
    assert "\n" not in msg and repr(target) in msg
    assert "spatial_blocks.*.attn.qkv" in msg and "t_block.1" in msg and "presets: attention" in msg


def _config(tmp_path, **lora_kw):
    c = small_config(tmp_path, mesh=(1, 1, 1))
    c.lora.update(dict(rank=4, alpha=8.0, **lora_kw))
    return c


@pytest.mark.parametrize("change, match", [
    (dict(targets=("attn.qkvv",)), r"lora.targets: 'attn.qkvv' matches no Linear layer .*available: "),
    (dict(targets=()), "lora.targets is empty"),
    (dict(dropout=1.0), r"lora.dropout must be in \[0, 1\)"),
    (dict(alpha=0.0), "lora.alpha = 0.0 is out of range"),
    (dict(rank=-2), "lora.rank = -2 is out of range"),
    (dict(init="xavier"), "lora.init must be one of kaiming, gaussian"),
])
def test_config_validation_is_one_line(tmp_path, change, match):
    c = _config(tmp_path)
    c.lora.update(change)
    with pytest.raises(ConfigError, match=match) as e:
        validate_config(c)
    assert "\n" not in str(e.value)


def test_config_validation_of_scan_blocks(tmp_path):
    c = _config(tmp_path, targets=("attention",), dropout=0.1)
    c.model.scan_blocks = True
    with pytest.raises(ConfigError, match="lora.dropout > 0 is not supported with model.scan_blocks"):
        validate_config(c)
    c.lora.dropout = 0.0
    c.lora.targets = ("spatial_blocks.0.attn.qkv",)
    c.model.depth = 2
    with pytest.raises(ConfigError, match="needs the same LoRA targets in every one of the spatial_blocks"):
        validate_config(c)
    c.lora.targets = ("spatial_blocks.*.attn.qkv",)
    validate_config(c)  # every spatial block alike: fine
    c.lora.rank = 0
    c.lora.targets = ("nothing",)
    validate_config(c)  # off: the targets are not looked at


def test_scanned_blocks_give_the_unrolled_output():
    cfg = TINY.replace(scan_blocks=True)
    spec = lora.LoRASpec(rank=4, alpha=8.0, targets=("all",))
    unrolled, scanned = STDiT3(TINY, rngs=nnx.Rngs(0)), STDiT3(cfg, rngs=nnx.Rngs(0))
    for m in (unrolled, scanned):
        lora.apply_lora(m, spec, seed=0)
        _randomize_b(m)
    args, kw = _inputs()
    np.testing.assert_allclose(np.asarray(_forward(scanned, args, kw)), np.asarray(_forward(unrolled, args, kw)),
                               rtol=1e-5, atol=1e-6)


def test_merged_weights_give_the_adapted_output():
    model = STDiT3(TINY, rngs=nnx.Rngs(0))
    lora.apply_lora(model, SPEC, seed=0)
    _randomize_b(model)
    flat = _flat(model)
    merged = lora.merge_flat(flat, SPEC.scale)
    assert not any(lora.is_adapter_path(k) for k in merged)
    k = ("temporal_blocks", "0", "cross_attn", "kv_linear", "kernel")
    a, b = flat[k[:-1] + ("lora_a",)], flat[k[:-1] + ("lora_b",)]
    np.testing.assert_allclose(merged[k], flat[k] + SPEC.scale * a.astype(np.float64) @ b, rtol=1e-6, atol=1e-7)
    assert merged[k].dtype == np.float32
    plain = STDiT3(TINY, rngs=nnx.Rngs(5))  # other weights, all replaced below
    apply_weights(plain, merged)
    args, kw = _inputs()
    out_lora, out_merged = np.asarray(_forward(model, args, kw)), np.asarray(_forward(plain, args, kw))
    base = STDiT3(TINY, rngs=nnx.Rngs(0))
    assert np.abs(out_lora - np.asarray(_forward(base, args, kw))).max() > 1e-3  # the adapters do change it
    np.testing.assert_allclose(out_merged, out_lora, rtol=1e-5, atol=1e-5)


def test_dropout_only_inside_the_train_context():
    spec = lora.LoRASpec(rank=4, alpha=8.0, targets=("all",), dropout=0.5)
    model = STDiT3(TINY, rngs=nnx.Rngs(0))
    lora.apply_lora(model, spec, seed=0)
    _randomize_b(model)
    ref = STDiT3(TINY, rngs=nnx.Rngs(0))
    lora.apply_lora(ref, lora.LoRASpec(rank=4, alpha=8.0, targets=("all",)), seed=0)
    _randomize_b(ref)
    args, kw = _inputs()
    np.testing.assert_array_equal(np.asarray(model(*args, **kw)), np.asarray(ref(*args, **kw)))  # eval: off
    key = jax.random.key(3)
    with lora.dropout_rng(key):
        a = np.asarray(model(*args, **kw))
    with lora.dropout_rng(key):
        b = np.asarray(model(*args, **kw))
    with lora.dropout_rng(jax.random.key(4)):
        c = np.asarray(model(*args, **kw))
    np.testing.assert_array_equal(a, b)  # masks are a function of the key
    assert np.abs(a - np.asarray(ref(*args, **kw))).max() > 1e-4 and np.abs(a - c).max() > 1e-4


# ----------------------------------------------------------------------------------------------
# the train step on the mesh
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The loop's setup of a LoRA run on 8 CPU devices: data 2 × fsdp 4."""
    assert jax.device_count() >= 8
    c = small_config(tmp_path_factory.mktemp("lora"), mesh=(2, 4, 1))
    c.lora.update(dict(rank=4, alpha=8.0, targets=("all", "t_block.1")))
    return setup_run(c)


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_train_steps_change_only_the_adapters(sharded):
    sp = sharded
    state = fresh_state(sp)
    before = jax.device_get(state)
    # the base is the model's plain initialization (the adapters did not perturb it; the plan's is
    # jitted, this one eager: equal up to an ulp)
    plain = _flat(STDiT3(sp.model_config, rngs=nnx.Rngs(int(sp.config.train.seed))))
    frozen = {tuple(str(p) for p in k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(before.frozen)}
    assert frozen.keys() == plain.keys()
    for k in plain:
        np.testing.assert_allclose(frozen[k], plain[k], rtol=1e-6, atol=1e-9, err_msg=str(k))
    # trainable, optimizer state and EMA: adapters only
    params = _paths(before.params)
    assert params and all(k.endswith(("['lora_a'].value", "['lora_b'].value")) for k in params)
    assert len(params) == 2 * (2 * 7 + 1)  # depth 1: two blocks of 7 Linears, and t_block.1
    assert _paths(before.ema).keys() == params.keys()
    opt = _paths(before.opt_state)
    arrays = {k: v for k, v in opt.items() if np.ndim(v) > 0 and np.size(v) > 1}
    assert arrays and all("lora_a" in k or "lora_b" in k for k in arrays), sorted(arrays)[:5]
    assert sum(np.size(v) for v in arrays.values()) == 2 * sum(np.size(v) for v in params.values())  # mu, nu

    host = next(iter(FakeLoader(data_parallel_size=sp.data_parallel_size, per_device_batch=2,
                                text_inputs=sp.encoders.text_inputs)))
    # A's gradient is 0 while its B is 0, and a temporal block's qkv sees no gradient at all until the
    # adapter of its zero-initialized proj moves: after 3 steps every adapter matrix has moved
    for _ in range(3):
        state, metrics = sp.step(state, global_batch(host, sp.mesh), sp.encoders.weights)
        assert int(metrics["nonfinite"]) == 0 and np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 3
    after = jax.device_get(state)
    for x, y in zip(jax.tree.leaves(before.frozen), jax.tree.leaves(after.frozen)):
        np.testing.assert_array_equal(x, y)  # base bit-identical
    new = _paths(after.params)
    for k, v in params.items():
        assert not np.array_equal(new[k], v), f"{k} did not change"
    # adapter shardings as declared: A (in_axis, None), B (None, out_axis); embed → fsdp, heads → none
    def spec_of(names, x):
        return logical_sharding(names, x.shape, sp.mesh, sp.rules).spec

    for tree in (state.params, state.ema):
        qkv = tree["spatial_blocks"][0]["attn"]["qkv"]
        fc2 = tree["temporal_blocks"][0]["mlp"]["fc2"]
        assert qkv["lora_a"].get_value().sharding.spec == spec_of(("embed", None), qkv["lora_a"].get_value())
        assert qkv["lora_a"].get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp")
        assert qkv["lora_b"].get_value().sharding.spec == jax.sharding.PartitionSpec()
        assert fc2["lora_b"].get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        assert fc2["lora_a"].get_value().sharding.spec == spec_of(("mlp", None), fc2["lora_a"].get_value())
    mu = state.opt_state[1][0].mu["temporal_blocks"][0]["mlp"]["fc2"]["lora_b"].get_value()
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    plan_specs = {k: s.spec for k, s in _paths(sp.plan.shardings.params).items()}
    assert {k: x.sharding.spec for k, x in _paths(state.params).items()} == plan_specs


def test_ckpt_path_loads_the_base_and_starts_fresh_adapters(sharded, tmp_path):
    sp = sharded
    source = STDiT3(sp.model_config, rngs=nnx.Rngs(11))  # "pretrained" weights, not the run's init
    save_weights(str(tmp_path / "base"), source)
    state = weights_only_state(sp, str(tmp_path / "base"))
    assert sp.config.lora.base == str(tmp_path / "base")
    want = _flat(source)
    got = {tuple(str(p) for p in k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state.frozen)}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))
    fresh = jax.device_get(fresh_state(sp).params)
    for x, y in zip(jax.tree.leaves(fresh), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(x, y)  # adapters: the run's own fresh init (B = 0)


def test_a_lora_checkpoint_is_refused_where_its_adapters_would_be_dropped(tmp_path):
    c = small_config(tmp_path, mesh=(1, 1, 1))
    plain = setup_run(c)
    src = STDiT3(plain.model_config, rngs=nnx.Rngs(0))
    save_weights(str(tmp_path / "lora_ckpt"), src, extra_config={"lora": dict(rank=4, alpha=8.0, targets=["all"])})
    with pytest.raises(lora.LoRAError, match=r"is a LoRA checkpoint \(rank 4, alpha 8, targets all\) and this run "
                                             r"has no LoRA: merge its adapters .*tools.lora merge") as e:
        weights_only_state(plain, str(tmp_path / "lora_ckpt"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["attention,mlp", "('attention','mlp')", "attention, mlp"])
def test_targets_from_the_command_line(value):
    """The README's spellings of several targets on the command line: a comma-separated value, or the
    Python tuple; both reach the model as the same two presets."""
    import os

    from absl import flags
    from ml_collections import config_flags

    from jaxsora.config_files import register_configs_package

    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "lora_example.py")
    register_configs_package(path)
    fv = flags.FlagValues()
    argv = ["prog", f"--config={path}", f"--config.lora.targets={value}"]
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    assert lora.normalize_targets(fv.config.lora.targets) == ("attention", "mlp")
    assert lora.LoRASpec.from_config(fv.config.lora).targets == ("attention", "mlp")
