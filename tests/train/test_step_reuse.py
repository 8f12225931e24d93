"""A second run in one process reuses the first one's plan and compiled step when nothing the step is built
from changed (`jaxsora.train.run.setup`: `step_config`, `_step_key`). Reuse is numerically invisible — a
rebuilt step computes the same numbers — so these tests look at the objects: which runs share a step, that
every field the step is built from separates them, and that `setup_run` can read no other field."""
import jax
import pytest

from jaxsora.train.run import setup as setup_lib
from jaxsora.train.run.loop import RunOptions, train
from jaxsora.train.run.setup import STEP_FIELDS, setup_run, step_config
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader


def _factory(config, dp, text_inputs):
    return FakeLoader(data_parallel_size=dp, per_device_batch=2, text_inputs=text_inputs)


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(setup_lib, "_STEPS", type(setup_lib._STEPS)())
    return setup_lib._STEPS


def test_runs_that_differ_in_bookkeeping_share_the_compiled_step(fresh_cache, tmp_path):
    first = small_config(tmp_path / "a", mesh=(1, 1, 1), max_steps=1, ckpt_every=1)
    train(first, RunOptions(), loader_factory=_factory)
    (plan, step), = fresh_cache.values()
    assert len(step.executables) == 1 and plan.compiled_init is not None

    other = small_config(tmp_path / "b", mesh=(1, 1, 1), max_steps=2, ckpt_every=2, experiment="other")
    other.train.log_every = 2
    other.data.num_workers = 3
    other.eval.every = 7
    other.wandb.name = "x"
    again = setup_run(other)
    assert again.step is step and again.plan is plan and again.config is other
    lowered = []
    step.lower = lambda *a, _lower=step.lower: lowered.append(a) or _lower(*a)  # noqa: E731 — the traces asked for
    result = train(other, RunOptions(), loader_factory=_factory)
    assert result["steps"] == 2
    assert lowered == [] and len(step.executables) == 1 and len(fresh_cache) == 1  # not traced nor compiled again


# Every group of fields the step is built from, changed one at a time: each gets a plan and step of its own.
CHANGES = {
    "optim.lr": lambda c: c.optim.update(lr=5e-4),
    "optim.ema_decay": lambda c: c.optim.update(ema_decay=0.5),
    "model.depth": lambda c: c.model.update(depth=2),
    "model.remat": lambda c: c.model.update(remat="full"),
    "scheduler": lambda c: c.scheduler.update(use_timestep_transform=not c.scheduler.use_timestep_transform),
    "mask_ratios": lambda c: c.mask_ratios.update(random=0.5),
    "lora.rank": lambda c: c.lora.update(rank=2),
    "text_encoder.d_model": lambda c: c.text_encoder.update(d_model=32),
    "vae.downsample": lambda c: c.vae.update(downsample=(1, 4, 4)),
    "train.seed": lambda c: c.train.update(seed=c.train.seed + 1),
    "train.max_param_norm_growth": lambda c: c.train.update(max_param_norm_growth=3.0),
    # the budget model.remat="auto" chooses each bucket's remat under
    "train.device_memory_gib": lambda c: c.train.update(device_memory_gib=1.5),
    "train.remat_memory_fraction": lambda c: c.train.update(remat_memory_fraction=0.5),
    "mesh": lambda c: c.mesh.update(data=2),
}


def test_every_field_the_step_is_built_from_separates_runs(fresh_cache, tmp_path):
    base = setup_run(small_config(tmp_path, mesh=(1, 1, 1)))
    for name, change in CHANGES.items():
        cfg = small_config(tmp_path, mesh=(1, 1, 1))
        change(cfg)
        other = setup_run(cfg)
        assert other.step is not base.step and other.plan is not base.plan, name
        assert setup_run(cfg).step is other.step, name  # and that one is reused in turn
    # the abstract encoders of a dry run are not the real ones
    assert setup_run(small_config(tmp_path, mesh=(1, 1, 1)), abstract_encoders=True).step is not base.step


def test_a_jax_option_read_while_tracing_separates_runs(fresh_cache, tmp_path):
    base = setup_run(small_config(tmp_path, mesh=(1, 1, 1)))
    with jax.default_matmul_precision("bfloat16"):
        assert setup_run(small_config(tmp_path, mesh=(1, 1, 1))).step is not base.step


def test_compiler_options_separate_runs(fresh_cache, tmp_path, monkeypatch):
    """A step is jitted with the XLA options of its platform ($JAXSORA_GPU_XLA, $JAXSORA_CPU_MATMUL), read when it
    is built: a run under other options does not reuse it."""
    from jaxsora.parallel import compile_options

    base = setup_run(small_config(tmp_path, mesh=(1, 1, 1)))
    monkeypatch.setattr(compile_options, "of_mesh", lambda mesh: {"xla_cpu_enable_fast_math": False})
    assert setup_run(small_config(tmp_path, mesh=(1, 1, 1))).step is not base.step


def test_setup_reads_only_the_step_fields(tmp_path):
    cfg = small_config(tmp_path)
    sc = step_config(cfg)
    assert set(sc.keys()) <= set(STEP_FIELDS)
    for section in ("train", "data"):
        assert sorted(sc[section].keys()) == sorted(STEP_FIELDS[section])
    with pytest.raises(AttributeError):
        sc.train.outputs  # noqa: B018 — what setup_run builds from holds no run bookkeeping
    with pytest.raises(AttributeError):
        sc.data.table  # noqa: B018
    assert "wandb" not in sc and "eval" not in sc


def test_encoders_from_files_are_never_reused(tmp_path):
    cfg = small_config(tmp_path)
    sc = step_config(cfg)
    enc = setup_run(cfg).encoders
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    assert setup_lib._step_key(sc, mesh, (), enc, False) is not None
    for section, value in (("text_encoder", dict(kind="t5", path=str(tmp_path))),
                           ("vae", dict(kind="opensora", path=str(tmp_path)))):
        cfg = small_config(tmp_path)
        cfg[section] = value
        assert setup_lib._step_key(step_config(cfg), mesh, (), enc, False) is None, section
