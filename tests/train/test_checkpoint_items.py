"""Weights apart from the optimizer: every part of the TrainState is an orbax item of its
own (params, frozen, ema, opt_state — step and rng go with opt_state), so a copy of a run without
`opt_state/` still serves --ckpt-path, `convert to-torch` and sampling, a weights-only restore never
opens the optimizer's folder and verifies only what it reads, and --load of such a copy stops with
one line naming the item. The older layout (the whole TrainState in one `state/` item, with or
without integrity.json) keeps loading everywhere: `_save_old_layout` below writes it as the previous
version of `Checkpointer` did.

The first half uses a small TrainState-like tree on the 8-device fsdp mesh (seconds); the second a
real 2-step training run of the loop tests' small config (the model, nnx.State, optax tuples)."""
import contextlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsora import checkpoint as ck
from jaxsora import ckpt as ckpt_cli
from jaxsora.checkpoint import Checkpointer, CheckpointError, restore
from jaxsora.checkpoint import fingerprint as fp
from tests.train.test_checkpoint import _abstract, _assert_tree_equal, _flip_bytes, _mesh, _no_traceback

OLD_ITEMS = ("state", "config", "data", "meta")


def _state(k: int, mesh) -> dict:
    """A TrainState-like tree with every field: params, frozen, ema, opt_state (a tuple), step, rng."""
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    w = jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128) * 0.01 + k
    leaves = {
        "step": (jnp.array(k, jnp.int32), rep),
        "params": {"w": (w, fsdp), "b": (jnp.linspace(-1, 1, 32).astype(jnp.bfloat16) * k, rep)},
        "frozen": {"buf": (jnp.arange(64, dtype=jnp.float32) - k, fsdp)},
        "opt_state": ({"mu": (w[:64, :32] * 0.5, fsdp), "count": (jnp.array([k], jnp.int32), rep)},
                      {"mask": (jnp.arange(16, dtype=jnp.int8) - k, rep)}),
        "ema": {"w": (w * 0.5 - 1, fsdp), "b": (jnp.linspace(-1, 1, 32).astype(jnp.float32) * k, rep)},
        "rng": (jnp.array([7, k], jnp.uint32), rep),
    }
    return jax.tree.map(lambda t: jax.device_put(*t), leaves, is_leaf=lambda t: isinstance(t, tuple) and
                        len(t) == 2 and isinstance(t[1], NamedSharding))


def _jsons(step):
    return dict(config={"model": {"depth": 1}}, data={"epoch": 0, "index": step}, meta={"wandb_id": "abc"})


def _save(root, steps, mesh):
    c = Checkpointer(str(root), keep=0)
    for s in steps:
        assert c.save(s, _state(s, mesh), **_jsons(s))
    c.close()


def _save_old_layout(root, step, state, *, config, data, meta, record: bool = True):
    """A checkpoint as this project wrote it before the per-item layout: the whole state in one
    `state` item; record=True: checkpoint_format 2 with its integrity.json (format 1: arrays keyed
    by name, no items), written after the save (the old writer wrote the same file just before
    orbax's rename); record=False: what came before integrity records."""
    meta = {**meta, "checkpoint_format": 2} if record else {k: v for k, v in meta.items() if k != "checkpoint_format"}
    jsons = dict(config=config, data=data, meta=meta)
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(str(root), options=opts, item_names=OLD_ITEMS) as m:
        m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             **{k: ocp.args.JsonSave(v) for k, v in jsons.items()}))
    if record:
        names, info, dev = fp.device_fingerprints(state)
        doc = dict(complete=True, format=1, step=step, jaxsora="0.old", fingerprint=ck.FINGERPRINT_METHOD,
                   state_bytes=sum(int(x.nbytes) for x in jax.tree.leaves(state)),
                   json_sha256={k: ck._json_digest(v) for k, v in jsons.items()},
                   arrays={n: dict(i, fingerprint=f) for n, i, f in zip(names, info, fp.fetch_fingerprints(dev))})
        with open(os.path.join(str(root), str(step), ck.INTEGRITY_FILE), "w") as f:
            json.dump(doc, f)


def _largest_file(item_dir) -> str:
    """The largest data file of an item's OCDBT database (`<item>/d/*`, what restore reads)."""
    d = os.path.join(item_dir, "d")
    return max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)


def _poison(item_dir):
    """Replace an item by garbage under orbax's file names (and, when not root, no permissions):
    any read of it — metadata, manifest or data — fails."""
    shutil.rmtree(item_dir)
    os.makedirs(os.path.join(item_dir, "d"))
    for name in ("_METADATA", "_sharding", "manifest.ocdbt", "_CHECKPOINT_METADATA", os.path.join("d", "0" * 32)):
        with open(os.path.join(item_dir, name), "wb") as f:
            f.write(b"\x00not an orbax item\xff" * 8)
    if os.geteuid() != 0:
        os.chmod(item_dir, 0)


def _unpoison(path):
    for d, dirs, _ in os.walk(str(path)):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(d, name), 0o755)


def _weights(tree: dict) -> dict:
    return {k: tree[k] for k in ck.WEIGHT_ITEMS}


# ----------------------------------------------------------------------------------------------
# the layout
# ----------------------------------------------------------------------------------------------
def test_each_part_is_an_item_of_its_own(tmp_path, capsys):
    mesh = _mesh(8)
    _save(tmp_path, [1], mesh)
    step_dir = tmp_path / "1"
    assert {"params", "frozen", "ema", "opt_state", "config", "data", "meta", "integrity.json"} <= set(
        os.listdir(step_dir))
    assert not (step_dir / "state").exists()
    for item, fields in (("params", {"params"}), ("frozen", {"frozen"}), ("ema", {"ema"}),
                         ("opt_state", {"opt_state", "step", "rng"})):
        assert set(ck.item_metadata_tree(str(step_dir / item))) == fields, item
        assert (step_dir / item / "manifest.ocdbt").is_file(), item  # its own OCDBT database
    rec = json.load(open(step_dir / "integrity.json"))
    assert rec["format"] == 2 and set(rec["items"]) == set(ck.ARRAY_ITEMS)
    assert rec["items"]["params"]["arrays"] == 2 and rec["items"]["opt_state"]["arrays"] == 5
    flat = jax.tree_util.tree_flatten_with_path(_state(1, mesh))[0]
    assert sorted(rec["arrays"]) == sorted(fp.array_name(p) for p, _ in flat)  # every item is covered
    assert {n: e["item"] for n, e in rec["arrays"].items() if not n.startswith("opt_state.")} == {
        "params.w": "params", "params.b": "params", "frozen.buf": "frozen", "ema.w": "ema", "ema.b": "ema",
        "step": "opt_state", "rng": "opt_state"}
    ema_w = _state(1, mesh)["ema"]["w"]
    assert rec["arrays"]["ema.w"]["fingerprint"] == fp.format_fingerprint(fp.host_fingerprint(ema_w))
    assert json.load(open(step_dir / "meta" / "metadata"))["checkpoint_format"] == 3
    assert ckpt_cli.main(["list", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[0] == "1" and row[3] == "full" and row[4] == "intact"


def test_full_restore_is_bit_exact_on_any_mesh(tmp_path, capfd):
    _save(tmp_path, [1, 2], _mesh(8))
    capfd.readouterr()
    for n in (8, 1):
        mesh = _mesh(n)
        res = restore(str(tmp_path), _abstract(_state(0, mesh)))
        assert res["step"] == 2 and res["skipped"] == [] and res["items"] == list(ck.ARRAY_ITEMS)
        _assert_tree_equal(res["state"], _state(2, mesh))
        assert res["data"] == {"epoch": 0, "index": 2} and res["meta"]["wandb_id"] == "abc"
        for got, want in zip(jax.tree.leaves(res["state"]), jax.tree.leaves(_state(2, mesh))):
            assert got.sharding == want.sharding and got.dtype == want.dtype
    host = restore(str(tmp_path), None, step=1)
    _assert_tree_equal(host["state"], {k: v for k, v in sorted(_state(1, _mesh(1)).items())})
    assert capfd.readouterr().err == ""


# ----------------------------------------------------------------------------------------------
# weights only
# ----------------------------------------------------------------------------------------------
def test_weights_only_restore_never_opens_opt_state(tmp_path, capfd):
    mesh = _mesh(8)
    _save(tmp_path, [1, 2], mesh)
    for s in (1, 2):
        _poison(str(tmp_path / str(s) / "opt_state"))
    try:
        capfd.readouterr()
        target = _abstract(_state(0, mesh))
        res = restore(str(tmp_path), target, items=(*ck.WEIGHT_ITEMS, "config", "meta"))
        assert res["step"] == 2 and res["skipped"] == [] and res["items"] == list(ck.WEIGHT_ITEMS)
        assert sorted(res["state"]) == sorted(ck.WEIGHT_ITEMS) and "data" not in res
        _assert_tree_equal(res["state"], _weights(_state(2, mesh)))
        host = restore(str(tmp_path / "1"), None, items=("ema",))
        _assert_tree_equal(host["state"], {"ema": _state(1, mesh)["ema"]})
        assert ck.read_weights(str(tmp_path / "2"), ["params", "frozen"]).keys() == {"params", "frozen"}
        assert capfd.readouterr().err == ""  # nothing skipped, nothing unverified
        # the poison works: a full restore does read opt_state/ and fails on it
        with pytest.raises(CheckpointError, match=r"step 2 \(opt_state unreadable .*step 1 \(opt_state unreadable"):
            restore(str(tmp_path), target)
        _no_traceback(capfd.readouterr().err)
    finally:
        _unpoison(tmp_path)


def test_weights_only_restore_verifies_only_what_it_reads(tmp_path, capfd):
    mesh = _mesh(8)
    _save(tmp_path, [1, 2, 3], mesh)
    target = _abstract(_state(0, mesh))
    _flip_bytes(_largest_file(str(tmp_path / "3" / "opt_state")))
    _flip_bytes(_largest_file(str(tmp_path / "2" / "ema")))
    capfd.readouterr()
    res = restore(str(tmp_path), target, items=("params", "frozen"))  # neither flipped item is read
    assert res["step"] == 3 and res["skipped"] == []
    res = restore(str(tmp_path), target, items=ck.WEIGHT_ITEMS)  # step 3's weights are intact
    assert res["step"] == 3 and res["skipped"] == []
    res = restore(str(tmp_path), target)  # the full restore reads opt_state: 3 and 2 are skipped
    assert res["step"] == 1 and [s for s, _ in res["skipped"]] == [3, 2]
    assert res["skipped"][0][1].startswith(("checksum mismatch in opt_state.", "opt_state unreadable"))
    assert res["skipped"][1][1].startswith(("checksum mismatch in ema.", "ema unreadable"))
    with pytest.raises(CheckpointError, match="step 2 .*(checksum mismatch in ema.|ema unreadable)"):
        restore(str(tmp_path), target, step=2, items=ck.WEIGHT_ITEMS)
    _no_traceback(capfd.readouterr().err)


def test_copy_without_opt_state(tmp_path, capsys):
    """`rsync -a --exclude opt_state`: the weights restore and verify; --load stops at once, in one
    line naming the item (no fallback to an older step, even one that has it)."""
    mesh = _mesh(8)
    _save(tmp_path / "run", [1, 2], mesh)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy, ignore=shutil.ignore_patterns("opt_state"))
    target = _abstract(_state(0, mesh))
    res = restore(str(copy), target, items=ck.WEIGHT_ITEMS + ck.JSON_ITEMS)
    assert res["step"] == 2 and res["skipped"] == []
    _assert_tree_equal(res["state"], _weights(_state(2, mesh)))
    shutil.copytree(tmp_path / "run" / "1" / "opt_state", copy / "1" / "opt_state")  # step 1 is whole again
    for kw in ({}, {"step": 2}):
        with pytest.raises(CheckpointError) as ei:
            restore(str(copy), target, **kw)
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith(f"checkpoint step 2 in {copy} has no opt_state item")
        assert "--ckpt-path" in msg
    assert restore(str(copy), target, step=1)["step"] == 1
    # the same answer from the folders alone (before anything compiles)
    with pytest.raises(CheckpointError) as early:
        ck.check_resumable(str(copy))
    assert str(early.value) == msg
    ck.check_resumable(str(copy), step=1)
    ck.check_resumable(str(tmp_path / "run"))
    capsys.readouterr()
    assert ckpt_cli.main(["verify", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "step 2: intact [weights only]" in out and "step 1: intact\n" in out
    assert ckpt_cli.main(["list", str(copy)]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[2:]}
    assert "weights only" in rows["2"] and "intact" in rows["2"] and "full" in rows["1"]


def test_missing_weight_item_is_partial(tmp_path):
    mesh = _mesh(8)
    _save(tmp_path, [1, 2], mesh)
    shutil.rmtree(tmp_path / "2" / "frozen")
    res = restore(str(tmp_path), _abstract(_state(0, mesh)), items=ck.WEIGHT_ITEMS)
    assert res["step"] == 1 and res["skipped"] == [(2, "partial: no frozen folder")]
    assert ck.verify_step(str(tmp_path), 2).status == "partial"


# ----------------------------------------------------------------------------------------------
# the older layout: one `state/` item
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("record", [True, False])
def test_old_layout_restores_full_and_weights_only(tmp_path, capfd, record):
    mesh = _mesh(8)
    for s in (1, 2):
        _save_old_layout(tmp_path, s, _state(s, mesh), **_jsons(s), record=record)
    target = _abstract(_state(0, _mesh(1)))  # another mesh
    capfd.readouterr()
    res = restore(str(tmp_path), target)
    assert res["step"] == 2 and res["skipped"] == [] and res["data"]["index"] == 2
    _assert_tree_equal(res["state"], _state(2, mesh))
    res = restore(str(tmp_path), target, items=ck.WEIGHT_ITEMS)
    assert sorted(res["state"]) == sorted(ck.WEIGHT_ITEMS)
    _assert_tree_equal(res["state"], _weights(_state(2, mesh)))
    host = restore(str(tmp_path), None, items=("params",))
    _assert_tree_equal(host["state"], {"params": _state(2, mesh)["params"]})
    assert isinstance(host["state"]["params"]["w"], np.ndarray)
    err = capfd.readouterr().err.strip().splitlines()
    if record:
        assert err == []
    else:
        assert len(err) == 3 and all("has no integrity.json" in ln and "restored unverified" in ln for ln in err)
    assert ck.verify_step(str(tmp_path), 2).status == ("intact" if record else "unverified")
    assert ck.step_contents(str(tmp_path / "2"))[1] == "full (state/ layout)"


def test_old_layout_weights_only_restore_checks_the_weights(tmp_path, capfd):
    """A weights-only read of an old checkpoint verifies the weight arrays it reads (the record's
    names carry no item: it follows from the field) and ignores a corrupt optimizer state."""
    mesh = _mesh(8)
    for s in (1, 2):
        _save_old_layout(tmp_path, s, _state(s, mesh), **_jsons(s))
    rec = json.load(open(tmp_path / "2" / "integrity.json"))
    bad = dict(rec, arrays={**rec["arrays"], "opt_state.0.mu": dict(rec["arrays"]["opt_state.0.mu"],
                                                                    fingerprint="0" * 16)})
    json.dump(bad, open(tmp_path / "2" / "integrity.json", "w"))
    target = _abstract(_state(0, mesh))
    capfd.readouterr()
    assert restore(str(tmp_path), target, items=ck.WEIGHT_ITEMS)["skipped"] == []
    assert restore(str(tmp_path), target)["skipped"] == [(2, "checksum mismatch in opt_state.0.mu")]
    bad["arrays"]["ema.w"] = dict(rec["arrays"]["ema.w"], fingerprint="0" * 16)
    json.dump(bad, open(tmp_path / "2" / "integrity.json", "w"))
    assert restore(str(tmp_path), target, items=("params",))["skipped"] == []
    assert restore(str(tmp_path), target, items=ck.WEIGHT_ITEMS)["skipped"] == [(2, "checksum mismatch in ema.w")]
    assert ckpt_cli.main(["verify", str(tmp_path)]) == 1
    out = capfd.readouterr().out
    assert "step 2: corrupt (checksum mismatch in ema.w and 1 more) [full (state/ layout)]" in out
    assert "step 1: intact [full (state/ layout)]" in out


def test_a_run_resumed_from_the_old_layout_saves_the_new_one(tmp_path):
    mesh = _mesh(8)
    _save_old_layout(tmp_path, 1, _state(1, mesh), **_jsons(1))
    res = restore(str(tmp_path), _abstract(_state(0, mesh)))
    c = Checkpointer(str(tmp_path), keep=0)
    assert c.save(2, res["state"], **_jsons(2))
    c.close()
    assert ck.is_legacy_layout(str(tmp_path / "1")) and not ck.is_legacy_layout(str(tmp_path / "2"))
    res = restore(str(tmp_path), _abstract(_state(0, mesh)))
    assert res["step"] == 2
    _assert_tree_equal(res["state"], _state(1, mesh))
    assert ckpt_cli.main(["verify", str(tmp_path)]) == 0


# ----------------------------------------------------------------------------------------------
# a real training run: --ckpt-path, convert to-torch, Pipeline.load, --load
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A 2-step run; a copy without opt_state (rsync --exclude); a copy with opt_state poisoned;
    the same step in the older layout, with and without integrity.json."""
    from jaxsora.train.run.setup import setup_run
    from tests.train.common import small_config
    from tests.train.test_loop import _run

    out = tmp_path_factory.mktemp("real")
    res = _run(small_config(out, max_steps=2, ckpt_every=2, mesh=(1, 1, 1), experiment="run"))
    assert res["steps"] == 2
    run = out / "run"
    copy, poisoned = out / "copy", out / "poisoned"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("opt_state"))
    shutil.copytree(run, poisoned)
    for s in ck.checkpoint_steps(str(poisoned / "checkpoints")):
        _poison(str(poisoned / "checkpoints" / str(s) / "opt_state"))
    setup = setup_run(small_config(out, mesh=(1, 1, 1), experiment="setup"))
    full = restore(str(run), setup.plan.abstract_sharded, step=2)
    olds = {}
    for name, record in (("old", True), ("older", False)):
        olds[name] = out / name
        _save_old_layout(olds[name] / "checkpoints", 2, full["state"], config=full["config"], data=full["data"],
                         meta=full["meta"], record=record)
    yield dict(out=out, run=run, copy=copy, poisoned=poisoned, setup=setup, state=full["state"], **olds)
    _unpoison(out)


SOURCES = ("copy", "poisoned", "old", "older")


def test_real_old_layout_restores_bit_exact(real, capfd):
    target = real["setup"].plan.abstract_sharded
    for name in ("old", "older"):
        res = restore(str(real[name]), target)
        assert res["step"] == 2
        _assert_tree_equal(res["state"], real["state"])
        weights = restore(str(real[name]), target, items=ck.WEIGHT_ITEMS)["state"]
        _assert_tree_equal(weights, {k: getattr(real["state"], k) for k in ck.WEIGHT_ITEMS})
    err = capfd.readouterr().err
    assert err.count("restored unverified") == 2 and "skipped" not in err  # the "older" one, twice
    for name, contents in (("copy", "weights only"), ("poisoned", "full"), ("old", "full (state/ layout)")):
        assert ck.step_contents(str(real[name] / "checkpoints" / "2"))[1] == contents


def test_ckpt_path_reads_a_copy_without_opt_state(real):
    from jaxsora.train.run.setup import weights_only_state
    from jaxsora.train.step.state import model_variables

    setup = real["setup"]
    ref = weights_only_state(setup, str(real["run"] / "checkpoints"))
    want = {p: np.asarray(v) for p, v in model_variables(ref).items()}
    assert want
    for name in SOURCES:
        got = model_variables(weights_only_state(setup, str(real[name] / "checkpoints")))
        assert got.keys() == want.keys()
        for p, v in got.items():
            np.testing.assert_array_equal(np.asarray(v), want[p], err_msg=f"{name} {p}")


def test_convert_to_torch_from_a_copy_without_opt_state(real, tmp_path):
    from jaxsora.convert.__main__ import main as convert
    from jaxsora.convert.torch import read_state_dict

    for ema in ([], ["--ema"]):
        assert convert(["to-torch", str(real["run"] / "checkpoints"), str(tmp_path / "ref.safetensors"), *ema]) == 0
        ref = read_state_dict(str(tmp_path / "ref.safetensors"))
        for name in SOURCES:
            out = tmp_path / f"{name}.safetensors"
            assert convert(["to-torch", str(real[name] / "checkpoints"), str(out), *ema]) == 0
            got = read_state_dict(str(out))
            assert sorted(got) == sorted(ref)
            for k in ref:
                np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{name} {k}")


def test_pipeline_loads_a_copy_without_opt_state(real):
    from jaxsora.infer import Pipeline
    from jaxsora.infer.pipeline import default_mesh

    ref = Pipeline.load(str(real["run"]), mesh=default_mesh(1))
    for name in SOURCES:
        pipe = Pipeline.load(str(real[name]), mesh=default_mesh(1))
        assert pipe.step == 2 and pipe.weights == "ema" and pipe.run_config is not None
        for a, b in zip(jax.tree.leaves(pipe.state), jax.tree.leaves(ref.state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_weights_readers_refuse_corrupt_weights(real, tmp_path):
    """What sampling and conversion read is checked against integrity.json (one line)."""
    from jaxsora.convert import native
    from jaxsora.errors import WeightsError
    from jaxsora.infer import Pipeline
    from jaxsora.infer.pipeline import default_mesh

    bad = tmp_path / "bad"
    shutil.copytree(real["copy"], bad)
    step_dir = bad / "checkpoints" / "2"
    rec = json.load(open(step_dir / "integrity.json"))
    name = next(n for n in sorted(rec["arrays"]) if n.startswith("ema.") and "kernel" in n)
    rec["arrays"][name]["fingerprint"] = "0" * 16
    json.dump(rec, open(step_dir / "integrity.json", "w"))
    with pytest.raises(WeightsError, match=f"checksum mismatch in {name}"):
        native.load_weights(str(bad / "checkpoints"), ema=True)
    native.load_weights(str(bad / "checkpoints"), ema=False)  # the params are fine
    with pytest.raises(CheckpointError) as ei:
        Pipeline.load(str(bad), mesh=default_mesh(1))
    assert "\n" not in str(ei.value) and f"checksum mismatch in {name}" in str(ei.value)


def test_load_of_a_copy_without_opt_state_is_one_line(real):
    from jaxsora.train.run.loop import RunOptions
    from tests.train.common import small_config
    from tests.train.test_loop import _run

    with pytest.raises(CheckpointError) as ei:
        _run(small_config(real["out"], max_steps=3, mesh=(1, 1, 1), experiment="resumed"),
             RunOptions(load=str(real["copy"])))
    msg = str(ei.value)
    assert "\n" not in msg and "has no opt_state item" in msg and "--ckpt-path" in msg


def test_load_of_the_old_layout_continues_like_the_new(real):
    """--load of the same step in the older layout (with and without integrity.json) continues the
    run bit for bit like --load of the run itself, and saves the new layout."""
    from jaxsora.train.run.loop import RunOptions
    from tests.train.common import small_config
    from tests.train.test_loop import _params, _run

    results = {}
    for name in ("run", "old", "older"):
        _run(small_config(real["out"], max_steps=3, mesh=(1, 1, 1), experiment=f"from-{name}"),
             RunOptions(load=str(real[name])))
        folder = real["out"] / f"from-{name}"
        assert not ck.is_legacy_layout(str(folder / "checkpoints" / "3"))
        results[name] = _params(str(folder), step=3)[1]
    for name in ("old", "older"):
        assert results[name].keys() == results["run"].keys()
        for k, v in results["run"].items():
            np.testing.assert_array_equal(results[name][k], v, err_msg=f"{name} {k}")


def test_damaged_item_metadata_is_one_line(real, tmp_path):
    """An item whose orbax metadata file is damaged (reads as no tree) stops conversion and sampling
    with one line naming the item, not a TypeError from inside orbax's metadata object."""
    from jaxsora.convert import native
    from jaxsora.convert.__main__ import main as convert
    from jaxsora.errors import UserError, run_cli

    bad = tmp_path / "bad"
    shutil.copytree(real["copy"], bad)
    meta = bad / "checkpoints" / "2" / "ema" / "_METADATA"
    assert meta.is_file()
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])  # truncated
    with pytest.raises(UserError) as ei:
        native.load_weights(str(bad / "checkpoints"), ema=True)
    assert "\n" not in str(ei.value) and "ema" in str(ei.value) and "metadata is unreadable" in str(ei.value)
    argv = ["to-torch", str(bad / "checkpoints"), str(tmp_path / "x.safetensors"), "--ema"]
    with pytest.raises(SystemExit) as ex:  # as `python -m jaxsora.convert` runs it
        run_cli("jaxsora.convert", lambda: convert(argv), argv)
    assert ex.value.code == 2
