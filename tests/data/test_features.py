"""The feature cache (`data_tools.precompute --latents` → `data.features=DIR`): a step from cached
latents and text states equals the step from the raw videos (same batch, noise and timesteps);
the cache is read through TFDS's own data source; an interrupted precompute resumes to the same
cache; the loader resumes exactly and refuses a changed cache; bad caches and settings are one line."""
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from data_tools.latents import precompute_features
from data_tools.synthetic import generate
from jaxsora.config import ConfigError, validate_config
from jaxsora.data.features import FeatureCacheError, FeatureLoader, FeatureStore
from jaxsora.data.plan import DataStateMismatch
from jaxsora.errors import OutputExists
from jaxsora.train.run.setup import default_loader, fresh_state, setup_run
from tests.train.common import REPO, small_config
from tests.zygote import PYTHON

ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


def _config(table, **data):
    c = small_config("/tmp/unused", mesh=(2, 1, 1))  # global batch 2 × 2 over two devices
    c.data.table = table
    c.data.batch_size_override = 2
    c.data.update(data)
    return c


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("videos")
    # 12-frame clips land in the 8-frame bucket (a random 8-frame window each), images in the 1-frame one.
    generate(str(out), num_videos=10, num_images=6, sizes=[(32, 32), (40, 32)], frames=[12], fps=8, seed=1,
             progress=False)
    return str(out / "meta.csv")


@pytest.fixture(scope="module")
def features(table, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("features") / "f")
    manifest = precompute_features(_config(table), out, shard_size=4, progress=False)
    return out, manifest


def _first_batch(loader):
    return next(iter(loader))


def test_manifest_and_tfds_reader(features, table):
    out, manifest = features
    assert manifest["num_records"] == 16 and not manifest["skipped"]
    import tensorflow_datasets as tfds

    ds = tfds.builder_from_directory(out).as_data_source("train")  # TFDS reads it as its own dataset
    assert len(ds) == 16
    store = FeatureStore(out)
    rec = store.read([int(store.record_rows[0])])[0]
    b = store.manifest["buckets"][int(rec["bucket"])]
    assert tuple(rec["latent"].shape) == tuple(b["latent"]) and rec["y"].shape == (rec["length"], 16)
    assert rec["text"] and (rec["num_frames"], rec["height"], rec["width"]) == tuple(b["size"])


def test_step_from_features_equals_step_from_video(features, table):
    out, _ = features
    raw_cfg, feat_cfg = _config(table), _config(table, features=out)
    raw, feat = setup_run(raw_cfg), setup_run(feat_cfg)
    assert feat.encoders.weights == {}  # no VAE and no T5 on any device
    raw_loader, feat_loader = default_loader(raw_cfg, raw.data_parallel_size, raw.encoders.text_inputs), \
        default_loader(feat_cfg, feat.data_parallel_size, None)
    assert [tuple(p.rows) for p in raw_loader.plan(0)] == [tuple(p.rows) for p in feat_loader.plan(0)]
    from jaxsora.train.step.train_step import global_batch

    it_raw, it_feat = iter(raw_loader), iter(feat_loader)
    for _ in range(2):  # both buckets' shapes come up in the first batches of this plan
        hr, hf = next(it_raw), next(it_feat)
        np.testing.assert_array_equal(hr["row"], hf["row"])
        assert "video" not in hf and hf["latents"].shape[1] == 3
        with jax.set_mesh(raw.mesh):
            state = fresh_state(raw)
            loss_r, g_r = raw.step.loss_and_grads(state, global_batch(hr, raw.mesh), raw.encoders.weights)
            loss_f, g_f = feat.step.loss_and_grads(state, global_batch(hf, feat.mesh), feat.encoders.weights)
        np.testing.assert_allclose(float(loss_f), float(loss_r), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_r)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def test_interrupted_precompute_resumes_to_the_same_cache(features, table, tmp_path):
    out = str(tmp_path / "f")
    assert precompute_features(_config(table), out, shard_size=4, progress=False, stop_after_shards=2) is None
    with pytest.raises(FeatureCacheError, match="did not finish"):
        FeatureStore(out)
    done = sorted(os.listdir(os.path.join(out, "progress")))
    assert len(done) == 2
    stamp = {d: os.path.getmtime(os.path.join(out, "progress", d)) for d in done}
    manifest = precompute_features(_config(table), out, shard_size=4, progress=False)
    assert {d: os.path.getmtime(os.path.join(out, "progress", d)) for d in done} == stamp  # not encoded again
    assert manifest["fingerprint"] == features[1]["fingerprint"]
    a, b = FeatureStore(out), FeatureStore(features[0])
    rows = a.record_rows.tolist()
    assert rows == b.record_rows.tolist()
    for ra, rb in zip(a.read(rows), b.read(rows)):
        np.testing.assert_array_equal(ra["latent"], rb["latent"])
        np.testing.assert_array_equal(ra["y"], rb["y"])
    # another setup into the same folder is refused, not mixed in
    with pytest.raises(OutputExists, match="another setup"):
        precompute_features(_config(table, seed=7), out, shard_size=4, progress=False)


def test_loader_resumes_exactly_and_refuses_a_changed_cache(features, table, tmp_path):
    out, _ = features
    cfg = _config(table, features=out)
    loader = default_loader(cfg, 2, None)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state()
    expected = next(it)
    again = default_loader(cfg, 2, None)
    again.restore(state)
    got = next(iter(again))
    np.testing.assert_array_equal(got["row"], expected["row"])
    np.testing.assert_array_equal(got["latents"], expected["latents"])
    # a cache made from another assignment (another seed) under the same run: refused, naming the dataset
    other = str(tmp_path / "other")
    precompute_features(_config(table, seed=3), other, shard_size=8, progress=False)
    changed = FeatureLoader(other, again.bucket_config, seed=again.seed, data_parallel_size=2,
                            extra_resolutions=again.extra_resolutions)
    with pytest.raises(DataStateMismatch, match="dataset table"):
        changed.restore(state)


def test_config_checks(features, table, tmp_path):
    out, _ = features
    cfg = _config("", features=out)  # no table needed
    validate_config(cfg)
    cfg = _config(table, features=out)
    cfg.text_encoder.d_model = 32  # not the encoder the states came from
    with pytest.raises(ConfigError, match="text_encoder"):
        setup_run(cfg)
    cfg = _config(table, features=out)
    cfg.eval.table = table
    with pytest.raises(ConfigError, match="eval.table"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="no such"):
        validate_config(_config(table, features=str(tmp_path / "missing")))


def test_a_features_run_reads_no_table(features, tmp_path):
    """The README's features run: `--config.data.features=feats/` with the config's own table unset or gone
    (stage1's is "", the demo's names a file that may not exist where the run trains) trains."""
    from jaxsora.train.run.loop import RunOptions, train

    out, _ = features
    for table in ("", str(tmp_path / "gone" / "meta.csv")):
        cfg = _config(table, features=out)
        cfg.train.update(dict(outputs=str(tmp_path), max_steps=1, ckpt_every=1))
        res = train(cfg, RunOptions(run_dir=str(tmp_path / f"run{len(table)}")))
        assert res["steps"] == 1, res


def _precompute(table, out, seed):
    """The README's precompute command (the demo config), in a process of its own hash seed."""
    cmd = [PYTHON, "-m", "data_tools.precompute", "--latents", "--config",
           os.path.join(REPO, "configs", "demo.py"), "--input", table, "--output", str(out), "--shard-size", "4",
           "--batch-size", "4", "--no-progress"]
    r = subprocess.run(cmd, env={**ENV, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


@pytest.mark.slow
def test_damaged_shards_are_refused_early_and_made_again(table, tmp_path):
    """Two runs of the same precompute write the same bytes (a cache can be checked by checksums). A
    truncated, a missing and a record-count-mismatched shard are each refused when the cache is opened —
    before a run takes a folder — naming the shard and the fix; the same precompute command re-makes it."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from jaxsora.train.run.loop import RunOptions, train

    a, b = tmp_path / "a", tmp_path / "b"
    _precompute(table, a, 1)
    _precompute(table, b, 2)
    want = _files(b)
    assert _files(a) == want
    shards = json.load(open(a / "manifest.json"))["shards"]
    assert len(shards) >= 2

    def truncate(p):
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 2)

    def one_record(p):
        os.remove(p)
        w = ArrayRecordWriter(str(p), "group_size:1")
        w.write(b"not a record")
        w.close()

    cases = ((truncate, "(is unreadable|holds 0 records)"), (os.remove, "is missing"), (one_record, "holds 1 records"))
    for damage, said in cases:
        damage(a / shards[1])
        with pytest.raises(FeatureCacheError, match=rf"shard {shards[1]} {said}.*run the same `python -m "
                                                     r"data_tools.precompute` command again"):
            FeatureStore(str(a))
        cfg = small_config(tmp_path / "outputs")
        cfg.data.features = str(a)
        with pytest.raises(FeatureCacheError):
            train(cfg, RunOptions(run_dir=str(tmp_path / "run")))
        assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "outputs")
        r = _precompute(table, a, 3)
        assert f"shard {shards[1]} " in r.stderr and "making it again" in r.stderr, r.stderr[-2000:]
        assert _files(a) == want


def test_corrupt_or_unfinished_cache_is_one_line(features, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(features[0], bad)
    shard = os.path.join(bad, json.load(open(os.path.join(bad, "manifest.json")))["shards"][0])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(FeatureCacheError, match="run the same `python -m data_tools.precompute` command again"):
        FeatureStore(bad)  # found when the cache is opened, not when a batch first reads the shard
    os.remove(os.path.join(bad, "manifest.json"))
    r = subprocess.run([PYTHON, "-m", "jaxsora.train", "--config", os.path.join(REPO, "configs", "demo.py"),
                        f"--config.data.features={bad}", "--run-dir", str(tmp_path / "run")], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "did not finish" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_precompute_cli_mistakes_are_one_line(tmp_path):
    cmd = [PYTHON, "-m", "data_tools.precompute", "--latents", "--out", str(tmp_path / "f")]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs --config" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(cmd + ["--config", os.path.join(REPO, "configs", "demo.py"), "--config.data.nope=1"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr, r.stderr
