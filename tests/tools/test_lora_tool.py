"""LoRA runs through the training loop, and `python -m jaxsora.tools.lora merge|export-adapters`:
the checkpoints hold the adapters, their optimizer state and EMA, and the frozen base; `--load`
resumes exactly; the merged output is W + scale·A·B as a jaxsora checkpoint (that `convert
to-torch` turns into the Open-Sora key set) or directly as a state dict; the adapters alone in
peft's layout; mistakes are one line with exit code 2."""
import dataclasses
import json
import os
import subprocess

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from jaxsora.convert import native
from jaxsora.convert import torch as tconv
from jaxsora.models import lora
from jaxsora.tools import lora as tool
from jaxsora.train.run.loop import RunOptions, train
from tests.train.common import REPO, small_config
from tests.train.fake_loader import FakeLoader
from tests.zygote import PYTHON

RANK, ALPHA = 4, 8.0
TARGETS = ("attention", "mlp.fc2", "t_block.1")


def _config(out, experiment, max_steps):
    c = small_config(out, max_steps=max_steps, ckpt_every=2, mesh=(1, 1, 1), experiment=experiment)
    c.lora.update(dict(rank=RANK, alpha=ALPHA, targets=TARGETS))
    return c


def _train(cfg, opts=None):
    def factory(c, dp, text_inputs):
        return FakeLoader(data_parallel_size=dp, per_device_batch=4 // dp, text_inputs=text_inputs)

    opts = dataclasses.replace(opts or RunOptions(), run_dir=os.path.join(cfg.train.outputs, cfg.train.experiment))
    return train(cfg, opts, loader_factory=factory)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A LoRA run of 4 steps (checkpoints 0, 2, 4) from a base model given with --ckpt-path."""
    out = tmp_path_factory.mktemp("outputs")
    base = str(out / "base")
    from flax import nnx

    from jaxsora.models.stdit3 import STDiT3
    from jaxsora.train.run.setup import setup_run

    mcfg = setup_run(small_config(out / "probe", mesh=(1, 1, 1))).model_config
    native.save_weights(base, STDiT3(mcfg, rngs=nnx.Rngs(7)))
    res = _train(_config(str(out), "lora", 4), RunOptions(ckpt_path=base))
    assert res["steps"] == 4 and np.isfinite(res["last_loss"])
    return str(out), os.path.join(str(out), "lora"), base


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _read(step_dir, item):
    """{stored path as a tuple of str: array} of one item of a step, e.g. ("params", "t_block", "1",
    "lora_a", "value")."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as c:
        tree = c.restore(os.path.join(step_dir, item))
    return {tuple(_key(k) for k in p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _cli(*args):
    return subprocess.run([PYTHON, "-m", "jaxsora.tools.lora", *args], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_the_checkpoint_holds_adapters_their_optimizer_state_and_the_base(run):
    _, rundir, base = run
    step = os.path.join(rundir, "checkpoints", "4")
    params, ema, opt = _read(step, "params"), _read(step, "ema"), _read(step, "opt_state")
    assert params and all(k[-2] in ("lora_a", "lora_b") for k in params), list(params)
    assert len(params) == 2 * (2 * 3 + 1)  # depth 1: (qkv, proj, fc2) × 2 blocks, and t_block.1
    assert {k[1:] for k in ema} == {k[1:] for k in params}
    arrays = [k for k, v in opt.items() if v.size > 1 and k[0] != "rng"]
    assert arrays and all("lora_a" in k or "lora_b" in k for k in arrays)
    frozen = _read(step, "frozen")
    assert not any("lora_a" in k or "lora_b" in k for k in frozen)
    # the base is the --ckpt-path weights, unchanged after 4 steps; the run config records where it came from
    _, want = native.load_weights(base)
    assert {k[1:-1] for k in frozen} == set(want)
    for k, v in frozen.items():
        np.testing.assert_array_equal(v, want[k[1:-1]], err_msg=str(k))
    config = native.read_config(step)
    assert config["lora"]["rank"] == RANK and config["lora"]["base"] == base
    assert native.read_config(os.path.join(rundir, "checkpoints", "0"))["lora"]["base"] == base


def test_load_resumes_exactly(run, tmp_path):
    out, rundir, base = run
    cfg = _config(str(tmp_path), "part", 2)
    _train(cfg, RunOptions(ckpt_path=base))
    cfg = _config(str(tmp_path), "part", 4)
    res = _train(cfg, RunOptions(load=os.path.join(str(tmp_path), "part")))
    assert res["steps"] == 4
    # the record of the base survives the resume (the resumed config did not name it)
    assert native.read_config(os.path.join(str(tmp_path), "part", "checkpoints", "4"))["lora"]["base"] == base
    for item in ("params", "ema", "frozen", "opt_state"):
        a = _read(os.path.join(rundir, "checkpoints", "4"), item)
        b = _read(os.path.join(str(tmp_path), "part", "checkpoints", "4"), item)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{item} {k}")


@pytest.mark.parametrize("ema", [False, True])
def test_merge_to_a_jaxsora_checkpoint_then_to_torch(run, tmp_path, ema):
    _, rundir, _ = run
    step_dir, config, spec, cfg, flat = tool.read_lora_checkpoint(rundir, ema=ema)
    assert step_dir.endswith(os.path.join("checkpoints", "4")) and spec.scale == ALPHA / RANK
    args = ["merge", "--ckpt", rundir, "--out", str(tmp_path / "merged")] + (["--ema"] if ema else [])
    assert tool.main(args) == 0
    mcfg, merged = native.load_weights(str(tmp_path / "merged"))
    assert mcfg == cfg and not any(lora.is_adapter_path(k) for k in merged)
    mods = lora.adapter_modules(flat)
    assert len(mods) == 7
    for path, v in merged.items():
        if path[:-1] in mods and path[-1] == "kernel":
            a, b = mods[path[:-1]]
            np.testing.assert_allclose(v, flat[path] + spec.scale * (a.astype(np.float64) @ b), rtol=1e-6, atol=1e-7)
            assert np.abs(v - flat[path]).max() > 0  # trained adapters: a real change
        else:
            np.testing.assert_array_equal(v, flat[path])
    config = native.read_config(os.path.join(str(tmp_path / "merged"), "4"))
    assert config["lora"]["rank"] == 0 and config["lora"]["merged"]["ema"] is ema
    assert config["vae"] == native.read_config(step_dir)["vae"]  # the run's encoders, for sampling
    # convert to-torch works on it: the Open-Sora key set and layouts
    from jaxsora.convert.__main__ import main as convert_main

    assert convert_main(["to-torch", str(tmp_path / "merged"), str(tmp_path / "m.safetensors")]) == 0
    sd = load_file(str(tmp_path / "m.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(s) for k, s in tconv.torch_shapes(cfg)}
    np.testing.assert_array_equal(sd["temporal_blocks.0.attn.qkv.weight"],
                                  merged[("temporal_blocks", "0", "attn", "qkv", "kernel")].T)


def test_merge_straight_to_a_state_dict(run, tmp_path):
    _, rundir, _ = run
    out = tmp_path / "merged.safetensors"
    assert tool.main(["merge", "--ckpt", os.path.join(rundir, "checkpoints"), "--step", "2", "--out", str(out)]) == 0
    _, _, spec, cfg, flat = tool.read_lora_checkpoint(rundir, step=2)
    want = tconv.to_torch_state_dict(lora.merge_flat(flat, spec.scale), config=cfg)
    sd = load_file(str(out))
    assert set(sd) == set(want)
    for k in want:
        np.testing.assert_array_equal(sd[k], want[k], err_msg=k)
    with safe_open(str(out), "np") as f:
        record = json.loads(f.metadata()["lora_merged"])
    assert record["rank"] == RANK and record["source"].endswith(os.path.join("checkpoints", "2"))


def test_export_adapters_in_peft_layout(run, tmp_path):
    _, rundir, _ = run
    out = tmp_path / "adapters.safetensors"
    assert tool.main(["export-adapters", "--ckpt", rundir, "--out", str(out)]) == 0
    _, _, spec, cfg, flat = tool.read_lora_checkpoint(rundir)
    sd = load_file(str(out))
    assert len(sd) == 2 * 7
    a = flat[("spatial_blocks", "0", "attn", "qkv", "lora_a")]
    b = flat[("spatial_blocks", "0", "attn", "qkv", "lora_b")]
    h = cfg.hidden_size
    np.testing.assert_array_equal(sd["spatial_blocks.0.attn.qkv.lora_A.weight"], a.T)  # [r, din]
    np.testing.assert_array_equal(sd["spatial_blocks.0.attn.qkv.lora_B.weight"], b.T)  # [dout, r]
    assert sd["spatial_blocks.0.attn.qkv.lora_A.weight"].shape == (RANK, h)
    assert sd["spatial_blocks.0.attn.qkv.lora_B.weight"].shape == (3 * h, RANK)
    assert sd["t_block.1.lora_B.weight"].shape == (6 * h, RANK)
    # the PyTorch form of the merge (peft's): weight + scale · lora_B @ lora_A
    merged = tconv.to_torch_state_dict(lora.merge_flat(flat, spec.scale), config=cfg)
    base = tconv.to_torch_state_dict({k: v for k, v in flat.items() if not lora.is_adapter_path(k)}, config=cfg)
    k = "temporal_blocks.0.mlp.fc2"
    np.testing.assert_allclose(merged[f"{k}.weight"], base[f"{k}.weight"] + spec.scale * (
        sd[f"{k}.lora_B.weight"].astype(np.float64) @ sd[f"{k}.lora_A.weight"]), rtol=1e-6, atol=1e-7)
    with safe_open(str(out), "np") as f:
        meta = f.metadata()
    assert (meta["lora_rank"], float(meta["lora_alpha"]), json.loads(meta["lora_targets"])) == (
        str(RANK), ALPHA, list(TARGETS))
    assert len(json.loads(meta["lora_modules"])) == 7


def _torch_skeleton(sd: dict):
    """A torch module tree holding a state dict under its own names: an nn.Linear wherever a 2-D
    `<m>.weight` is (with `<m>.bias` when there is one), plain parameters elsewhere — what peft needs
    to find and wrap Open-Sora STDiT3's Linear layers by name (the forward is not needed here)."""
    import torch

    root = torch.nn.Module()

    def module(path):
        m = root
        for part in [p for p in path.split(".") if p]:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        return m

    linears = {k[: -len(".weight")] for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2}
    for key, value in sd.items():
        path, _, name = key.rpartition(".")
        if path in linears:
            parent, _, leaf = path.rpartition(".")
            if not hasattr(module(parent), leaf):
                out_f, in_f = sd[path + ".weight"].shape
                module(parent).add_module(leaf, torch.nn.Linear(in_f, out_f, bias=path + ".bias" in sd))
        else:
            module(path).register_parameter(name, torch.nn.Parameter(torch.zeros(value.shape)))
    root.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in sd.items()}, strict=True)
    return root


def test_export_adapters_as_a_peft_folder(run, tmp_path):
    """`--output DIR` writes peft's own adapter folder: `PeftModel.from_pretrained` on the Open-Sora
    STDiT3 module tree loads every adapter (none left at its init) and merges to our merged weights."""
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    _, rundir, _ = run
    out = tmp_path / "adapters"
    assert tool.main(["export-adapters", "--ckpt", rundir, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    _, _, spec, cfg, flat = tool.read_lora_checkpoint(rundir)
    base = tconv.to_torch_state_dict({k: v for k, v in flat.items() if not lora.is_adapter_path(k)}, config=cfg)
    merged = tconv.to_torch_state_dict(lora.merge_flat(flat, spec.scale), config=cfg)
    model = peft.PeftModel.from_pretrained(_torch_skeleton(base), str(out))
    adapters = {n: p.detach().numpy() for n, p in model.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * 7, sorted(adapters)
    b = flat[("spatial_blocks", "0", "attn", "qkv", "lora_b")]
    got = next(v for n, v in adapters.items() if "spatial_blocks.0.attn.qkv.lora_B" in n)
    np.testing.assert_array_equal(got, b.T)  # loaded, not peft's zero init of B
    with torch.no_grad():
        x = torch.randn(3, cfg.hidden_size)
        layer = model.base_model.model.spatial_blocks.get_submodule("0.attn.qkv")
        want = x @ torch.from_numpy(merged["spatial_blocks.0.attn.qkv.weight"]).T + torch.from_numpy(
            merged["spatial_blocks.0.attn.qkv.bias"])
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)  # the adapted layer = the merged one
        sd = model.merge_and_unload().state_dict()
    assert set(sd) == set(merged)
    for k, v in merged.items():
        np.testing.assert_allclose(sd[k].numpy(), v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_mistakes_are_one_line(run, tmp_path):
    out, rundir, base = run
    cases = [
        (["merge", "--ckpt", base, "--out", str(tmp_path / "x")], "is not a LoRA checkpoint"),
        (["merge", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "checkpoint folder not found"),
        (["merge", "--ckpt", rundir, "--out", rundir], "exists and is not an empty folder"),
        (["export-adapters", "--ckpt", rundir, "--out", rundir], "exists and is not an empty folder"),
        (["merge", "--ckpt", rundir, "--step", "3", "--out", str(tmp_path / "y")], "has no checkpoint of step 3"),
        (["merge", "--ckpt", rundir], "the following arguments are required: --out"),
    ]
    for args, msg in cases:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0] and lines[0].startswith("jaxsora.tools.lora:"), r.stderr
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


@pytest.mark.parametrize("change, have", [(dict(rank=8), "lora rank 8, alpha 8"),
                                          (dict(targets=("attention",)), "lora rank 4, alpha 8, targets attention;"),
                                          (dict(rank=0), "no LoRA")])
def test_load_with_other_lora_settings_is_refused_in_one_line(run, change, have):
    from jaxsora.config import ConfigError

    out, rundir, _ = run
    cfg = _config(out, "lora", 6)
    cfg.lora.update(change)
    with pytest.raises(ConfigError, match=f"--load {rundir}: the checkpoint was trained with lora rank 4, alpha 8, "
                                          f"targets attention,mlp.fc2,t_block.1 but the config has {have}") as e:
        _train(cfg, RunOptions(load=rundir))
    assert "\n" not in str(e.value)


def test_readers_of_a_lora_run_use_the_adapters(run, tmp_path):
    """`convert to-torch` and the sampling pipeline, pointed at a LoRA run, give the merged model —
    never the base alone with the adapters silently dropped."""
    from flax import nnx

    from jaxsora.infer import Pipeline
    from jaxsora.infer.pipeline import default_mesh

    _, rundir, _ = run
    assert tool.main(["merge", "--ckpt", rundir, "--out", str(tmp_path / "merged")]) == 0
    cfg, merged = native.load_weights(str(tmp_path / "merged"))
    ckpts = os.path.join(rundir, "checkpoints")
    _, direct = native.load_weights(ckpts)  # what convert to-torch reads
    assert set(direct) == set(merged)
    for k in merged:
        np.testing.assert_array_equal(direct[k], merged[k], err_msg=str(k))
    _, base = native.load_weights(ckpts, merge_lora=False)
    assert any(np.abs(direct[k] - base[k]).max() > 0 for k in direct if k in base)  # the adapters count

    pipe = Pipeline.load(rundir, mesh=default_mesh(1), ema=False)
    ref = Pipeline.load(str(tmp_path / "merged"), mesh=default_mesh(1), ema=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, cfg.in_channels, 2, 8, 8)).astype(np.float32)
    y = rng.standard_normal((1, 1, cfg.model_max_length, cfg.caption_channels)).astype(np.float32)
    t = np.array([500.0], np.float32)
    fwd = nnx.jit(lambda m, x, t, y: m(x, t, y))
    model, ref_model = nnx.merge(pipe.graphdef, pipe.state), nnx.merge(ref.graphdef, ref.state)
    assert lora.has_adapters(model) and not lora.has_adapters(ref_model)
    np.testing.assert_allclose(np.asarray(fwd(model, x, t, y)), np.asarray(fwd(ref_model, x, t, y)),
                               rtol=1e-5, atol=1e-5)
