"""`python -m jaxsora.tools.average`: the (weighted) mean of checkpoints' weights, streamed a group of
arrays at a time, written as a weights-only step that `ckpt verify`, `convert to-torch` and the
sharded weight reader (sampling, --ckpt-path) accept; every mistake is one line with exit code 2.

The inputs are checkpoints of the "tiny" STDiT3 (its params shifted per step, an EMA beside them)
written by `jaxsora.checkpoint.Checkpointer`, as training writes them; one test adds the older
single `state/` layout and a synthetic tree with bf16 and integer arrays."""
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxsora import checkpoint as ck
from jaxsora import ckpt as ckpt_cli
from jaxsora.checkpoint.fingerprint import array_name
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3, trainable_filter
from jaxsora.tools import average as avg
from jaxsora.tools import lazy_save
from tests.conftest import REPO
from tests.train.test_checkpoint import _flip_bytes, _no_traceback
from tests.train.test_checkpoint_items import _largest_file, _poison, _save_old_layout, _unpoison
from tests.zygote import PYTHON

STEPS = (400, 500, 600)


@pytest.fixture(scope="module")
def tiny():
    """(config, params, frozen) of the "tiny" STDiT3 as nnx.States of numpy arrays (random values:
    an abstract model filled on the host, much faster than initializing one)."""
    cfg = get_model_config("tiny")
    _, params, frozen = nnx.split(nnx.eval_shape(lambda: STDiT3(cfg, rngs=nnx.Rngs(0))), trainable_filter(cfg), ...)
    rng = np.random.default_rng(0)
    fill = lambda a: (rng.standard_normal(a.shape) * 0.1).astype(a.dtype)  # noqa: E731
    return cfg, jax.tree.map(fill, params), jax.tree.map(fill, frozen)


def _state(tiny, k: int) -> dict:
    """A TrainState of the tiny model as a dict of fields: params and EMA differ per k."""
    _, params, frozen = tiny
    return {"params": jax.tree.map(lambda x: x * np.float32(1 + 0.25 * k) + np.float32(0.01 * k), params),
            "frozen": frozen,
            "ema": jax.tree.map(lambda x: x * np.float32(0.5) - np.float32(0.1 * k), params),
            "opt_state": {"mu": jax.tree.map(lambda x: np.full_like(x, k), params), "count": np.array([k], np.int32)},
            "step": np.array(k, np.int32), "rng": np.array([7, k], np.uint32)}


def _write(root, tiny, steps=STEPS, **state_kw):
    c = ck.Checkpointer(str(root), keep=0)
    for s in steps:
        state = _state(tiny, s // 100)
        state.update(state_kw)
        assert c.save(s, state, config={"model": tiny[0].to_dict(), "vae": {"kind": "identity"}},
                      data={"epoch": 0, "index": s}, meta={"wandb_id": "abc"})
    c.close()
    return str(root)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny):
    return _write(tmp_path_factory.mktemp("run") / "checkpoints", tiny)


def _weights(step_dir, fields=("params", "ema", "frozen")) -> dict:
    """{stored name: numpy array} of a step's weight items, read with the weights-only reader."""
    have = [f for f in fields if os.path.isdir(os.path.join(step_dir, f)) or ck.is_legacy_layout(step_dir)]
    tree = ck.read_weights(step_dir, have)
    return {array_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _expected(inputs, weights, field) -> dict:
    """numpy's weighted average of `field` over the inputs, cast to each array's dtype."""
    got = [_weights(d, (field,)) for d in inputs]
    out = {}
    for name, x in got[0].items():
        stack = np.stack([np.asarray(g[name], np.float64) for g in got])
        out[name] = np.average(stack, axis=0, weights=weights).astype(x.dtype)
    return out


def _assert_close(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name].astype(np.float64), w.astype(np.float64), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


def _user_error(capsys, argv) -> str:
    """Run the CLI expecting a user error: exit code 2 and one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as ei:
        avg.run(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    _no_traceback(err)
    lines = [line for line in err.splitlines() if not line.startswith(f"[{avg.PROG}]")]
    assert len(lines) == 1 and lines[0].startswith(f"{avg.PROG}: "), err
    return lines[0]


# ----------------------------------------------------------------------------------------------
# the average
# ----------------------------------------------------------------------------------------------
def test_groups_of_consecutive_arrays():
    e = [avg.Entry(str(i), (n,), "float32") for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # 40, 40, 120, 20 ... bytes
    assert avg._groups(e, 100) == [[0, 1], [2], [3, 4, 5]]
    assert avg._groups(e, 0) == [[0], [1], [2], [3], [4], [5]]
    assert avg._groups(e, 1 << 20) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("group_bytes", [avg.GROUP_BYTES, 64 << 10])  # 64 KiB: many groups, larger arrays alone
def test_uniform_average_of_three_steps_equals_numpy(run, tmp_path, monkeypatch, capsys, group_bytes):
    monkeypatch.setattr(avg, "GROUP_BYTES", group_bytes)
    out = tmp_path / "avg"
    assert avg.main([run, "--steps", "400,500,600", "--out", str(out), "--no-progress"]) == 0
    assert f"wrote {out}/600: params (" in capsys.readouterr().out
    step_dir = str(out / "600")
    inputs = [os.path.join(run, str(s)) for s in STEPS]
    got = _weights(step_dir)
    for field in ("params", "ema"):
        _assert_close({n: v for n, v in got.items() if n.startswith(field + ".")}, _expected(inputs, None, field))
    first = _weights(inputs[0], ("frozen",))
    assert first and all(np.array_equal(got[n], x) for n, x in first.items())  # frozen: the first input's
    assert sorted(os.listdir(out)) == ["600"]
    assert {"params", "ema", "frozen", "config", "data", "meta", "integrity.json"} == set(os.listdir(step_dir))
    meta = ck.read_json_item(step_dir, "meta")
    assert meta["checkpoint_format"] == 3
    assert [(s["step"], s["weight"]) for s in meta["average"]["sources"]] == [(s, pytest.approx(1 / 3)) for s in STEPS]
    assert ck.read_json_item(step_dir, "config") == ck.read_json_item(inputs[0], "config")


def test_arrays_are_computed_while_orbax_writes_them(run, tmp_path, monkeypatch):
    """The streaming path really runs with this orbax: every output array is computed inside
    `Checkpointer.save`, in the tree's order (not all of them before it, which would hold the
    whole item in memory). An equality test alone would pass if it never ran."""
    import orbax.checkpoint as ocp

    assert lazy_save.can_stream()
    saving, log = [False], []
    save = ocp.Checkpointer.save

    def tracked_save(self, *a, **kw):
        saving[0] = True
        try:
            return save(self, *a, **kw)
        finally:
            saving[0] = False

    take = avg._ItemJob.take

    def tracked_take(self, i):
        log.append((self.out_field, i, saving[0]))
        return take(self, i)

    monkeypatch.setattr(ocp.Checkpointer, "save", tracked_save)
    monkeypatch.setattr(avg._ItemJob, "take", tracked_take)
    assert avg.main([run, "--steps", "400,500", "--out", str(tmp_path / "avg"), "--no-progress"]) == 0
    assert log and all(during for _, _, during in log)
    for field in ("params", "ema"):
        assert [i for f, i, _ in log if f == field] == list(range(sum(f == field for f, _, _ in log)))


def test_without_the_orbax_hook_the_output_is_the_same(run, tmp_path, monkeypatch, capsys):
    """An orbax without `NumpyHandler._open_and_write(value, tspec, ts_context)` (it is private):
    each item is computed whole, then written; the result is the same checkpoint, and it is said."""
    assert avg.main([run, "--steps", "400,500,600", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    monkeypatch.setattr(lazy_save, "can_stream", lambda: False)
    monkeypatch.setattr(lazy_save, "_said_no_streaming", False)
    capsys.readouterr()
    assert avg.main([run, "--steps", "400,500,600", "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "has no numpy write hook to stream through" in capsys.readouterr().err
    a, b = _weights(str(tmp_path / "a" / "600")), _weights(str(tmp_path / "b" / "600"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a)
    assert ckpt_cli.main(["verify", str(tmp_path / "b")]) == 0


def test_weighted_average_of_step_folders(run, tmp_path):
    inputs = [os.path.join(run, str(s)) for s in STEPS]
    out = tmp_path / "avg"
    assert avg.main([*inputs, "--weights", "1,2,7", "--out", str(out), "--out-step", "7", "--no-progress"]) == 0
    got = _weights(str(out / "7"))
    for field in ("params", "ema"):
        _assert_close({n: v for n, v in got.items() if n.startswith(field + ".")},
                      _expected(inputs, [0.1, 0.2, 0.7], field))
    meta = ck.read_json_item(str(out / "7"), "meta")
    assert [s["weight"] for s in meta["average"]["sources"]] == pytest.approx([0.1, 0.2, 0.7])


def test_ema_into_params(run, tmp_path):
    inputs = [os.path.join(run, str(s)) for s in STEPS]
    out = tmp_path / "avg"
    assert avg.main([*inputs[:2], "--ema", "--out", str(out), "--no-progress"]) == 0
    step_dir = str(out / "500")
    assert not os.path.exists(os.path.join(step_dir, "ema"))
    got = _weights(step_dir, ("params",))
    want = {"params" + n[len("ema"):]: x for n, x in _expected(inputs[:2], None, "ema").items()}
    _assert_close(got, want)


# ----------------------------------------------------------------------------------------------
# the readers accept the output
# ----------------------------------------------------------------------------------------------
def test_output_verifies_converts_and_loads(run, tiny, tmp_path, capsys):
    from jaxsora.convert import torch as tconv
    from jaxsora.convert.__main__ import main as convert
    from jaxsora.convert.sharded import read_native_weights
    from jaxsora.io.weights import open_state_dict

    out = tmp_path / "avg"
    assert avg.main([run, "--steps", "400,600", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert ckpt_cli.main(["verify", str(out)]) == 0
    assert "step 600: intact [weights only]" in capsys.readouterr().out
    # the step the way training records it: a weights-only copy (--load names the missing item)
    with pytest.raises(ck.CheckpointError, match="has no opt_state item"):
        ck.check_resumable(str(out))

    step_dir = str(out / "600")
    got = _weights(step_dir)
    for field in ("params", "ema"):
        f = tmp_path / f"{field}.safetensors"
        assert convert(["to-torch", str(out), str(f)] + (["--ema"] if field == "ema" else [])) == 0
        flat = {tuple(n.split(".")[1:-1]): x for n, x in got.items() if n.split(".", 1)[0] in (field, "frozen")}
        want = tconv.to_torch_state_dict(flat, config=tiny[0])
        sd = open_state_dict(str(f))
        assert sorted(sd) == sorted(want)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(sd[k][...]), v, err_msg=k)

    # the sharded reader of sampling and --ckpt-path (verified against the output's integrity.json)
    abstract = nnx.eval_shape(lambda: STDiT3(tiny[0], rngs=nnx.Rngs(0)))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {tuple(str(p) for p in path): jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
               for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Variable))}
    for field in ("params", "ema"):
        loaded = read_native_weights(str(out), targets, ema=field == "ema")
        for path, x in loaded.items():
            name = ".".join(path) + ".value"
            np.testing.assert_array_equal(np.asarray(x), got.get(f"{field}.{name}", got.get(f"frozen.{name}")))


def test_optimizer_item_is_never_opened(run, tmp_path):
    copy = tmp_path / "copy"
    for s in STEPS[:2]:
        shutil.copytree(os.path.join(run, str(s)), copy / str(s))
    _poison(str(copy / "400" / "opt_state"))  # any read of it would fail
    shutil.rmtree(copy / "500" / "opt_state")
    try:
        assert avg.main([str(copy), "--steps", "400,500", "--out", str(tmp_path / "avg"), "--no-progress"]) == 0
    finally:
        _unpoison(copy)
    assert ckpt_cli.main(["verify", str(tmp_path / "avg")]) == 0


def test_old_layout_bf16_and_integer_arrays(tmp_path, capsys):
    """An older `state/` checkpoint averages with per-item ones; bf16 is averaged and cast back,
    an integer array is copied from the first input (a note says it differs)."""
    def state(k):
        return {"params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * k,
                           "b": (jnp.linspace(-1, 1, 8) * k).astype(jnp.bfloat16),
                           "n": jnp.array([k, 2 * k], jnp.int32)},
                "frozen": {"buf": jnp.arange(4, dtype=jnp.float32)},
                "opt_state": {"mu": jnp.ones(3) * k}, "step": jnp.array(k), "rng": jnp.array([1, k], jnp.uint32)}

    jsons = dict(config={"model": {"depth": 1}}, data={"epoch": 0}, meta={"wandb_id": "x"})
    _save_old_layout(tmp_path / "old", 1, state(1), **jsons)
    c = ck.Checkpointer(str(tmp_path / "new"), keep=0)
    for k in (2, 3):
        c.save(k, state(k), **jsons)
    c.close()
    inputs = [str(tmp_path / "old" / "1"), str(tmp_path / "new" / "2"), str(tmp_path / "new" / "3")]
    assert avg.main([*inputs, "--weights", "3,1,1", "--out", str(tmp_path / "avg"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "params.n (not floating point) differs between the inputs" in err
    assert "has no EMA weights: the output has params only" in err
    got = _weights(str(tmp_path / "avg" / "3"), ("params", "frozen"))
    assert got["params.b"].dtype == ml_dtypes.bfloat16
    want_b = (np.asarray(state(1)["params"]["b"], np.float64) * 0.6 + np.asarray(state(2)["params"]["b"], np.float64)
              * 0.2 + np.asarray(state(3)["params"]["b"], np.float64) * 0.2).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got["params.b"], want_b)
    np.testing.assert_allclose(got["params.w"], np.arange(12, dtype=np.float32).reshape(3, 4) * 1.6, rtol=1e-6)
    np.testing.assert_array_equal(got["params.n"], [1, 2])
    assert ckpt_cli.main(["verify", str(tmp_path / "avg")]) == 0


# ----------------------------------------------------------------------------------------------
# mistakes: one line, exit code 2, nothing written
# ----------------------------------------------------------------------------------------------
def test_mismatched_trees(run, tiny, tmp_path, capsys):
    _, params, _ = tiny
    other = jax.tree.map(lambda x: x, params)
    other["x_embedder"]["proj"]["kernel"] = nnx.Param(np.zeros((1, 2, 2, 4, 32), np.float32))  # another width
    odd = _write(tmp_path / "odd", tiny, steps=(700,), params=other)
    out = tmp_path / "avg"
    line = _user_error(capsys, [os.path.join(run, "400"), os.path.join(odd, "700"), "--out", str(out)])
    assert "the checkpoints differ: params.x_embedder.proj.kernel.value is float32[1, 2, 2, 4, 64]" in line
    assert "but float32[1, 2, 2, 4, 32]" in line and os.path.join(run, "400") in line and odd in line
    assert not out.exists()


@pytest.mark.parametrize("weights, says", [
    ("0.5,0.5", "--weights has 2 values (0.5,0.5) for 3 checkpoints"),
    ("1,-1,1", "must be finite and non-negative"),
    ("0,0,0", "must not all be zero"),
    ("a,b,c", "--weights expects numbers"),
    ("1,nan,1", "must be finite and non-negative"),
])
def test_bad_weights(run, tmp_path, capsys, weights, says):
    line = _user_error(capsys, [run, "--steps", "400,500,600", "--weights", weights, "--out", str(tmp_path / "a")])
    assert says in line
    assert not (tmp_path / "a").exists()


def test_user_mistakes(run, tmp_path, capsys):
    step = os.path.join(run, "400")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "123").mkdir()
    shutil.copytree(os.path.join(run, "600"), tmp_path / "other" / "600")  # another run's checkpoints
    cases = [
        ([str(tmp_path / "nope"), step], "checkpoint folder not found"),
        ([str(tmp_path / "123"), step], "is not a jaxsora checkpoint"),
        ([step], "averaging needs two or more"),
        ([run, "--steps", "400,450"], "has no checkpoint of step 450"),
        ([run, "--steps", "4x"], "--steps expects step numbers"),
        ([step, os.path.join(run, "500"), "--steps", "400"], "is the folder of step 400"),
        ([step, step], "is given twice"),
        ([step, os.path.join(run, "500"), "--out", str(tmp_path / "full")],
         "exists and is not empty: pass --overwrite"),
        ([step, os.path.join(run, "500"), "--out", str(tmp_path / "full"), "--overwrite"],
         f"--overwrite replaces only an earlier average: {tmp_path / 'full'} holds notes.txt: not replaced"),
        ([step, os.path.join(run, "500"), "--out", str(tmp_path / "other"), "--overwrite"],
         f"{tmp_path / 'other' / '600'} was not written by jaxsora.tools.average"),
        ([step, os.path.join(run, "500"), "--out", run, "--overwrite"], "would hold or be inside the input"),
        ([step, os.path.join(run, "500"), "--out-step", "-1"], "--out-step must be >= 0"),
        ([step, os.path.join(run, "500")], "the following arguments are required: --out"),
    ]
    for argv, says in cases:
        if "--out" not in argv and "required" not in says:
            argv = [*argv, "--out", str(tmp_path / "avg")]
        assert says in _user_error(capsys, argv), argv
    assert not (tmp_path / "avg").exists() and (tmp_path / "full" / "notes.txt").exists()
    assert os.listdir(tmp_path / "other") == ["600"]
    assert sorted(os.listdir(run)) == [str(s) for s in STEPS]


def test_overwrite_replaces_an_earlier_average(run, tmp_path, capsys):
    out = tmp_path / "avg"
    assert avg.main([run, "--steps", "400,500", "--out", str(out), "--no-progress"]) == 0
    assert "exists and is not empty" in _user_error(capsys, [run, "--steps", "500,600", "--out", str(out)])
    assert avg.main([run, "--steps", "500,600", "--out", str(out), "--overwrite", "--no-progress"]) == 0
    assert sorted(os.listdir(out)) == ["600"]


def test_corrupt_or_unfinished_input_is_refused(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    for s in STEPS[:2]:
        shutil.copytree(os.path.join(run, str(s)), copy / str(s))
    _flip_bytes(_largest_file(str(copy / "500" / "ema")))
    out = tmp_path / "avg"
    line = _user_error(capsys, [str(copy), "--steps", "400,500", "--out", str(out)])
    assert f"checkpoint {copy}/500 is not usable: " in line and ("checksum mismatch in ema." in line
                                                                  or "ema unreadable" in line)
    assert not out.exists()  # the unfinished output was removed
    os.remove(copy / "500" / "integrity.json")  # a save that did not finish
    line = _user_error(capsys, [str(copy), "--steps", "400,500", "--out", str(out)])
    assert "is not usable: partial: no integrity.json" in line


def test_changed_array_is_refused_midway(run, tmp_path, capsys):
    """An input whose params item was rewritten with one value changed (readable, but not what its
    integrity.json records): the streamed read stops at that array's group, nothing is left behind."""
    import orbax.checkpoint as ocp

    copy = tmp_path / "copy"
    for s in STEPS[:2]:
        shutil.copytree(os.path.join(run, str(s)), copy / str(s))
    item = str(copy / "500" / "params")
    flat, treedef = jax.tree_util.tree_flatten_with_path(ck._host_item(item))
    leaves = [np.array(x) for _, x in flat]
    leaves[-1].flat[0] += 1  # the last array in the order: read in the last group
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as c:
        c.save(item, jax.tree_util.tree_unflatten(treedef, leaves))
    out = tmp_path / "avg"
    line = _user_error(capsys, [str(copy), "--steps", "400,500", "--out", str(out)])
    assert line.endswith(f"checkpoint {copy}/500 is not usable: checksum mismatch in {array_name(flat[-1][0])} "
                         f"(python -m jaxsora.ckpt verify {copy}/500 checks it all)"), line
    assert not out.exists()


def test_module_entry_point(run, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([PYTHON, "-m", "jaxsora.tools.average", run, "--steps", "400,500", "--weights", "1",
                        "--out", str(tmp_path / "a")], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip() == (
        "jaxsora.tools.average: --weights has 1 value (1) for 2 checkpoints"), r.stderr[-2000:]
    r = subprocess.run([PYTHON, "-m", "jaxsora.tools.average", "--help"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and "--weights" in r.stdout and "--ema" in r.stdout
