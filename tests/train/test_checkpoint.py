"""Checkpoint integrity: per-array fingerprints (device = host, any mesh), fallback past corrupt or
partial steps with one line each, explicit steps, old checkpoints, disk-full saves, keep=0, the
`python -m jaxsora.ckpt` CLI, and one end-to-end resume of the training loop past a corrupt step.

Most tests save a small TrainState-like tree of arrays sharded over an 8-device fsdp mesh (the
8 CPU devices of tests/conftest.py) — seconds, not the loop's minutes."""
import errno
import glob
import json
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsora import checkpoint as ck
from jaxsora import ckpt as ckpt_cli
from jaxsora.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    resolve_checkpoint,
    restore,
)
from jaxsora.checkpoint import fingerprint as fp
from tests.train.common import REPO
from tests.zygote import PYTHON


def _mesh(n):
    return jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))


def _state(k: int, mesh) -> dict:
    """A TrainState-like tree: sharded and replicated leaves, 4-, 2- and 1-byte dtypes, a tuple."""
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    # params.w (128 KiB) is by far the largest array: its chunk fills the largest data file
    w = jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128) * 0.01 + k
    leaves = {
        "step": (jnp.array(k, jnp.int32), rep),
        "params": {"w": (w, fsdp), "b": (jnp.linspace(-1, 1, 32).astype(jnp.bfloat16) * k, rep)},
        "opt_state": ({"mu": (w[:64, :32] * 0.5, fsdp), "count": (jnp.array([k], jnp.int32), rep)},
                      {"mask": (jnp.arange(16, dtype=jnp.int8) - k, rep)}),
        "rng": (jnp.array([7, k], jnp.uint32), rep),
    }
    return jax.tree.map(lambda t: jax.device_put(*t), leaves, is_leaf=lambda t: isinstance(t, tuple) and
                        len(t) == 2 and isinstance(t[1], NamedSharding))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _save(root, steps, mesh, **kw):
    c = Checkpointer(str(root), keep=kw.pop("keep", 0), **kw)
    for s in steps:
        assert c.save(s, _state(s, mesh), config={"model": {"depth": 1}}, data={"epoch": 0, "index": s},
                      meta={"wandb_id": None})
    c.close()


def _assert_tree_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(p))


def _largest_array_file(step_dir) -> str:
    """The largest chunk-data file of the OCDBT array items (`<item>/**/d/*`)."""
    files = [f for f in glob.glob(os.path.join(step_dir, "*", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    return max(files, key=os.path.getsize)


def _flip_bytes(path, n=3):
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    for i in range(n):
        data[mid + i] ^= 0xFF
    open(path, "wb").write(bytes(data))


# What flipped bytes in the largest array file are found as: a checksum mismatch when they land in an
# uncompressed chunk, "unreadable" when they land in a zstd-compressed one (the chunks' order in the
# OCDBT data file varies between saves). Both are refusals of the step; tests accept either.
FLIPPED = r"(checksum mismatch in params\.w|params unreadable \(.*\))"


def _no_traceback(err: str):
    for needle in ("Traceback", "Event loop is closed", "Exception ignored", "never retrieved"):
        assert needle not in err, err[-3000:]


# ----------------------------------------------------------------------------------------------
# fingerprints
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "uint8", "bool", "int32", "uint32"])
def test_device_fingerprint_equals_host_fingerprint(dtype):
    rng = np.random.default_rng(0)
    mesh = _mesh(8)
    for shape, spec in [((), P()), ((5,), P()), ((16, 3), P("fsdp")), ((8, 4, 5), P(None, None))]:
        x = jnp.asarray(rng.standard_normal(shape) * 100).astype(dtype)
        arr = jax.device_put(x, NamedSharding(mesh, spec))
        names, info, dev = fp.device_fingerprints({"a": arr}, on_host=False)
        assert names == ["a"] and info == [dict(shape=list(shape), dtype=dtype)]
        assert isinstance(dev[0], jax.Array)  # the jitted program ran
        assert fp.fetch_fingerprints(dev) == [fp.format_fingerprint(fp.host_fingerprint(np.asarray(x)))], shape
        # by default CPU arrays held whole are read with numpy: the same record
        auto = fp.device_fingerprints({"a": arr})
        assert isinstance(auto[2][0], np.ndarray) and fp.fetch_fingerprints(auto[2]) == fp.fetch_fingerprints(dev)


def test_fingerprint_of_8_byte_dtypes_with_x64():
    with jax.enable_x64(True):
        for dtype in ("float64", "int64", "uint64"):
            x = (np.arange(-6, 6).reshape(3, 4) * 1e9 + 0.25).astype(dtype)
            dev = fp.fetch_fingerprints(fp.device_fingerprints([jnp.asarray(x)], on_host=False)[2])
            assert dev == [fp.format_fingerprint(fp.host_fingerprint(x))], dtype


def test_fingerprint_is_layout_independent_and_position_sensitive():
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    fps = {fp.fetch_fingerprints(fp.device_fingerprints([jax.device_put(x, NamedSharding(_mesh(n), spec))],
                                                        on_host=False)[2])[0]
           for n, spec in [(1, P()), (8, P("fsdp")), (8, P(None, "fsdp")), (4, P("fsdp"))]}
    assert len(fps) == 1  # the same on every mesh and sharding
    base = fp.host_fingerprint(x)
    flipped = x.copy()
    flipped.view(np.uint32)[10, 3] ^= 1 << 7  # one bit
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values elsewhere
    assert fp.host_fingerprint(flipped) != base and fp.host_fingerprint(swapped) != base
    assert fp.host_fingerprint(x.reshape(32, 64)) == base  # the shape is recorded beside it


def test_fingerprint_function_traces_once_per_tree(tmp_path):
    mesh = _mesh(8)
    leaves = jax.tree.leaves(_state(1, mesh))
    fn = fp._fingerprint_fn(leaves)
    before = fn._cache_size()
    for k in (2, 3, 4):
        fp.device_fingerprints(_state(k, mesh), on_host=False)
    assert fn._cache_size() - before <= 1


# ----------------------------------------------------------------------------------------------
# saving: the integrity record, keep
# ----------------------------------------------------------------------------------------------
def test_save_writes_integrity_record(tmp_path):
    mesh = _mesh(8)
    _save(tmp_path, [1], mesh)
    rec = json.load(open(tmp_path / "1" / "integrity.json"))
    assert rec["complete"] is True and rec["step"] == 1 and rec["jaxsora"]
    state = _state(1, mesh)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    assert sorted(rec["arrays"]) == sorted(fp.array_name(p) for p, _ in flat)
    assert rec["arrays"]["params.w"]["fingerprint"] == fp.format_fingerprint(fp.host_fingerprint(state["params"]["w"]))
    assert rec["arrays"]["opt_state.1.mask"]["dtype"] == "int8"
    assert set(rec["json_sha256"]) == {"config", "data", "meta"}
    assert not glob.glob(str(tmp_path / f"*{ck.TMP_SUFFIX}*"))


@pytest.mark.parametrize("keep,expect", [(0, [1, 2, 3, 4, 5]), (None, [1, 2, 3, 4, 5]), (2, [4, 5])])
def test_keep_zero_keeps_all(tmp_path, keep, expect):
    _save(tmp_path, [1, 2, 3, 4, 5], _mesh(1), keep=keep)
    assert ck.checkpoint_steps(str(tmp_path)) == expect


# ----------------------------------------------------------------------------------------------
# restoring: fallback, explicit steps, meshes, old checkpoints
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def three_steps(tmp_path):
    """Steps 1, 2, 3 saved on the 8-device fsdp mesh."""
    mesh = _mesh(8)
    _save(tmp_path / "checkpoints", [1, 2, 3], mesh)
    return tmp_path, mesh


def test_flipped_bytes_fall_back_to_previous_step(three_steps, capfd):
    run, mesh = three_steps
    _flip_bytes(_largest_array_file(run / "checkpoints" / "3"))
    capfd.readouterr()
    res = restore(str(run), _abstract(_state(0, mesh)))
    err = capfd.readouterr().err
    assert res["step"] == 2
    assert [s for s, _ in res["skipped"]] == [3] and re.fullmatch(FLIPPED, res["skipped"][0][1]), res["skipped"]
    _assert_tree_equal(res["state"], _state(2, mesh))
    assert res["data"] == {"epoch": 0, "index": 2}
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(rf"\[jaxsora\] checkpoint step 3 skipped: {FLIPPED}; trying step 2",
                                            lines[0]), lines
    _no_traceback(err)


def test_truncated_file_falls_back_without_tracebacks(tmp_path, capfd):
    """Bigger arrays, so that other reads are still running when one fails (what made orbax print
    'Event loop is closed' tracebacks)."""
    mesh = _mesh(8)
    big = lambda k: {f"w{i}": jax.device_put(jax.random.normal(jax.random.key(10 * k + i), (256, 256)),  # noqa: E731
                                             NamedSharding(mesh, P("fsdp"))) for i in range(12)}
    c = Checkpointer(str(tmp_path), keep=0)
    for k in (1, 2):
        c.save(k, big(k), config={}, data={}, meta={})
    c.close()
    path = _largest_array_file(tmp_path / "2")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    capfd.readouterr()
    res = restore(str(tmp_path), _abstract(big(0)), items=("state", "meta"))
    import gc

    gc.collect()  # abandoned read coroutines report at collection
    err = capfd.readouterr().err
    assert res["step"] == 1 and res["skipped"][0][0] == 2
    assert "opt_state unreadable" in res["skipped"][0][1]  # w0..w11 are not weights: the opt_state item
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    _no_traceback(err)


def test_empty_and_partial_step_folders_are_skipped(three_steps, capfd):
    run, mesh = three_steps
    root = run / "checkpoints"
    shutil.rmtree(root / "3")
    os.mkdir(root / "3")  # empty
    shutil.rmtree(root / "2" / "data")  # an item folder missing
    os.remove(root / "1" / "integrity.json")  # a save that did not finish (new format, no marker)
    shutil.copytree(root / "1", root / "0")
    (root / "0" / "integrity.json").write_text(json.dumps({"complete": False, "arrays": {}}))
    capfd.readouterr()
    with pytest.raises(CheckpointError) as ei:
        restore(str(run), _abstract(_state(0, mesh)))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"no intact checkpoint in {root}")
    for s, why in [(3, "empty folder"), (2, "partial: no data folder"), (1, "partial: no integrity.json"),
                   (0, "partial: integrity.json does not mark the save complete")]:
        assert f"step {s} ({why}" in msg
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 4 and "no older checkpoint left" in err
    _no_traceback(err)


def test_explicit_step(three_steps):
    run, mesh = three_steps
    root = run / "checkpoints"
    target = _abstract(_state(0, mesh))
    assert restore(str(run), target, step=1)["step"] == 1
    for path in (root / "2", str(root / "2") + "/"):
        res = restore(str(path), target)
        assert res["step"] == 2 and res["skipped"] == []
        _assert_tree_equal(res["state"], _state(2, mesh))
    assert resolve_checkpoint(str(run)) == (str(root), None)
    assert resolve_checkpoint(str(root), 3) == (str(root), 3)
    assert resolve_checkpoint(str(root / "2") + "/") == (str(root), 2)
    with pytest.raises(CheckpointError, match="step 2, but step 3"):
        resolve_checkpoint(str(root / "2"), 3)
    _flip_bytes(_largest_array_file(root / "2"))
    with pytest.raises(CheckpointError) as ei:
        restore(str(root / "2"), target)
    # Flipped bytes land in an uncompressed chunk (checksum mismatch) or a zstd-compressed one (unreadable),
    # as the chunks' order in the OCDBT data file varies between saves: both are the refusal asked for.
    msg = str(ei.value)
    assert "\n" not in msg and "step 2" in msg and ("checksum mismatch" in msg or "params unreadable" in msg), msg
    with pytest.raises(CheckpointError, match="not usable"):
        restore(str(run), target, step=2)
    with pytest.raises(CheckpointNotFoundError, match=r"has no checkpoint of step 9 \(it has \[1, 2, 3\]\)"):
        restore(str(run), target, step=9)
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        restore(str(run / "nope"), target)
    os.makedirs(run / "empty")
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        restore(str(run / "empty"), target)
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):  # the early check of --load
        resolve_checkpoint(str(run / "empty"))
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint of step 9"):
        resolve_checkpoint(str(run), 9)


def test_saved_on_8_devices_verifies_on_1(three_steps, capfd):
    run, _ = three_steps
    one = _mesh(1)
    res = restore(str(run), _abstract(_state(0, one)))
    assert res["step"] == 3 and res["skipped"] == []
    _assert_tree_equal(res["state"], _state(3, one))
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(res["state"]))
    host = restore(str(run), None)  # numpy, no target: verified with the host fingerprints
    assert host["step"] == 3 and isinstance(host["state"]["params"]["w"], np.ndarray)
    assert "skipped" not in capfd.readouterr().err


OLD_ITEMS = ("state", "config", "data", "meta")  # the single-item layout (checkpoint_format 2 and older)


def _save_old_format(root, step, state):
    """A checkpoint as the previous version of this project wrote it: no integrity record."""
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(str(root), options=opts, item_names=OLD_ITEMS) as m:
        m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave({}),
                                             data=ocp.args.JsonSave({}), meta=ocp.args.JsonSave({})))


def test_old_checkpoint_restores_unverified(tmp_path, capfd):
    mesh = _mesh(8)
    _save_old_format(tmp_path, 5, _state(5, mesh))
    capfd.readouterr()
    res = restore(str(tmp_path), _abstract(_state(0, mesh)))
    assert res["step"] == 5 and res["skipped"] == []
    _assert_tree_equal(res["state"], _state(5, mesh))
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["[jaxsora] checkpoint step 5 has no integrity.json (written before integrity records): "
                   "restored unverified"]


def test_a_skipped_step_is_replaced_by_the_next_save(three_steps):
    run, mesh = three_steps
    root = run / "checkpoints"
    _flip_bytes(_largest_array_file(root / "3"))
    assert restore(str(run), _abstract(_state(0, mesh)))["step"] == 2
    c = Checkpointer(str(root), keep=0)
    assert c.save(2, _state(2, mesh), config={}, data={}, meta={}) is False  # intact: kept
    assert c.save(3, _state(3, mesh), config={}, data={}, meta={}) is True  # corrupt: rewritten
    c.close()
    res = restore(str(run), _abstract(_state(0, mesh)))
    assert res["step"] == 3 and res["skipped"] == []


# ----------------------------------------------------------------------------------------------
# failed writes
# ----------------------------------------------------------------------------------------------
def _fail_json_writes_of_step(monkeypatch, step):
    """Make orbax's JSON item writes of `step` fail with ENOSPC (in orbax's async save thread)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh

    real = jh.JsonCheckpointHandler._save_fn

    async def failing(self, x, directory):
        if f"{os.sep}{step}{ck.TMP_SUFFIX}" in str(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(jh.JsonCheckpointHandler, "_save_fn", failing)


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_save_is_one_line_and_keeps_earlier_steps(tmp_path, monkeypatch, capfd, async_save):
    mesh = _mesh(8)
    c = Checkpointer(str(tmp_path), keep=0, async_save=async_save)
    c.save(1, _state(1, mesh), config={}, data={}, meta={})
    c.wait()
    _fail_json_writes_of_step(monkeypatch, 2)
    capfd.readouterr()
    with pytest.raises(CheckpointWriteError) as ei:
        c.save(2, _state(2, mesh), config={}, data={}, meta={})
        c.wait()  # async: the error surfaces when the save is waited for
    c.close()  # already reported: no second error
    msg = str(ei.value)
    assert "\n" not in msg and "No space left on device" in msg and " free" in msg and "step 2" in msg
    assert str(tmp_path / "2") in msg
    assert ck.checkpoint_steps(str(tmp_path)) == [1] and not ck.unfinished_saves(str(tmp_path))
    _no_traceback(capfd.readouterr().err)
    monkeypatch.undo()
    res = restore(str(tmp_path), _abstract(_state(0, mesh)))
    assert res["step"] == 1 and res["skipped"] == []
    # the checkpointer works again once there is space
    c = Checkpointer(str(tmp_path), keep=0)
    assert c.save(2, _state(2, mesh), config={}, data={}, meta={})
    c.close()
    assert restore(str(tmp_path), _abstract(_state(0, mesh)))["step"] == 2


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount permission; skipped otherwise)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_really_full_disk(tiny_disk, capfd):
    """tensorstore's own ENOSPC (a ValueError naming os_error_code 28) from orbax's write thread."""
    c = Checkpointer(str(tiny_disk / "ck"), keep=0)
    c.save(1, {"a": jnp.ones(1000)}, config={}, data={}, meta={})
    c.wait()
    capfd.readouterr()
    with pytest.raises(CheckpointWriteError, match=r"No space left on device \(it needs about 4\.0 MiB, .* free\)"):
        big = jax.random.normal(jax.random.key(0), (1024, 1024))  # 4 MiB that do not compress
        c.save(2, {"a": jnp.ones(1000), "b": big}, config={}, data={}, meta={})
        c.wait()
    c.close()
    _no_traceback(capfd.readouterr().err)
    assert ck.checkpoint_steps(str(tiny_disk / "ck")) == [1] and not ck.unfinished_saves(str(tiny_disk / "ck"))
    assert restore(str(tiny_disk / "ck"), None)["step"] == 1


# ----------------------------------------------------------------------------------------------
# the CLI
# ----------------------------------------------------------------------------------------------
def test_cli_verify_and_list(three_steps, capsys):
    run, _ = three_steps
    root = run / "checkpoints"
    assert ckpt_cli.main(["verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 1: intact" in out and "step 3: intact" in out and "3 checkpoint(s)" in out
    _flip_bytes(_largest_array_file(root / "3"))
    _save_old_format(root, 4, _state(4, _mesh(1)))
    shutil.copytree(root / "1", root / f"5{ck.TMP_SUFFIX}")
    assert ckpt_cli.main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"step 3: corrupt \({FLIPPED}\)", out), out
    assert "step 4: unverified" in out and "step 2: intact" in out
    assert ckpt_cli.main(["verify", str(root / "2")]) == 0  # one step folder
    assert capsys.readouterr().out.count("step ") == 1
    assert ckpt_cli.main(["list", str(run)]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[2:]}
    assert rows.keys() == {"1", "2", "3", "4", "5"}
    assert "intact" in rows["1"] and re.search(f"corrupt \\({FLIPPED}", rows["3"]) and "unverified" in rows["4"]
    assert "unfinished save" in rows["5"] and "KiB" in rows["1"]
    mistakes = (["verify", str(run / "missing")], ["list", str(run / "missing")], ["verify", str(root), "--step", "9"])
    for argv in mistakes:
        with pytest.raises(SystemExit) as ei:
            ckpt_cli.run(argv)
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("jaxsora.ckpt: "), err


def test_cli_module_exit_codes(three_steps):
    run, _ = three_steps
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [PYTHON, "-m", "jaxsora.ckpt"]
    r = subprocess.run(cmd + ["verify", str(run)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "3 intact" in r.stdout, r.stderr[-2000:]
    _flip_bytes(_largest_array_file(run / "checkpoints" / "2"))
    r = subprocess.run(cmd + ["verify", str(run)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "step 2: corrupt" in r.stdout
    _no_traceback(r.stderr)
    r = subprocess.run(cmd + ["list", str(run / "nothing")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not found" in r.stderr
    r = subprocess.run(cmd + ["--help"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "verify" in r.stdout


# ----------------------------------------------------------------------------------------------
# end to end: the training loop resumes past a corrupt newest checkpoint
# ----------------------------------------------------------------------------------------------
def test_training_resumes_past_a_corrupt_checkpoint(tmp_path, capfd):
    from jaxsora.train.run.loop import RunOptions
    from tests.train.common import small_config
    from tests.train.test_loop import _run

    res = _run(small_config(tmp_path, max_steps=6, ckpt_every=3, mesh=(1, 1, 1)))
    assert res["steps"] == 6
    root = tmp_path / "run" / "checkpoints"
    assert ckpt_cli.main(["verify", str(root)]) == 0  # the real TrainState (nnx.State, optax tuples) verifies
    _flip_bytes(_largest_array_file(root / "6"))
    capfd.readouterr()
    res = _run(small_config(tmp_path, max_steps=7, ckpt_every=3, mesh=(1, 1, 1)),
               RunOptions(load=str(tmp_path / "run")))
    out, err = capfd.readouterr()
    assert res["steps"] == 7
    assert "resumed" in out and "at step 3" in out
    # flipped bytes in zstd-compressed chunks fail either the checksum or the decompression
    assert "[jaxsora] checkpoint step 6 skipped: " in err and "; trying step 3" in err
    assert "checksum mismatch in " in err or "unreadable" in err
    _no_traceback(err)
    assert ckpt_cli.main(["verify", str(root)]) == 0  # step 6 was written again, intact


# ----------------------------------------------------------------------------------------------
# two processes: process 0 writes the record, every process takes the same fallback
# ----------------------------------------------------------------------------------------------
def _two_processes(args):
    from tests.ports import free_port

    env = {**os.environ, "PYTHONPATH": REPO, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
           "JAX_NUM_PROCESSES": "2"}
    script = os.path.join(os.path.dirname(__file__), "run_ckpt_procs.py")
    procs = [subprocess.Popen([PYTHON, script, *args], env={**env, "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for _, e in outs]
    return [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o, _ in outs], [e for _, e in outs]


def test_two_processes_save_and_fall_back_together(tmp_path):
    _two_processes([str(tmp_path), "save"])
    assert ck.checkpoint_steps(str(tmp_path)) == [1, 2, 3]
    assert ckpt_cli.main(["verify", str(tmp_path)]) == 0  # the record of the 2-process save verifies on 1
    _flip_bytes(_largest_array_file(tmp_path / "3"))
    results, errs = _two_processes([str(tmp_path), "restore"])
    assert results == [{"step": 2, "skipped": [3], "values_ok": True}] * 2
    assert re.search(f"step 3 skipped: {FLIPPED}", errs[0]) and "skipped" not in errs[1]  # process 0 says it
