"""The feature cache from several processes: `data_tools.precompute --latents` run as 2
`jax.distributed` processes on 127.0.0.1 (1 CPU device each: the config's 2-device mesh spans both,
so each process encodes its shards on its one device, one clip per call) writes the very cache one
process writes on 2 devices (two clips per call): the same records, assignment, TFDS metadata and
manifest, fingerprint included. An interrupted 2-process run resumes encoding only the missing shards;
a folder of another setup is refused by both processes in one line, neither waiting on the other.

The VAE is a sampling stand-in (the demo's IdentityVAE plus posterior noise drawn with the encode
key), so "the same" covers the posterior samples too: a row's sample may depend on the seed and the
row only, not on the process count or the batch it was encoded in.
"""
import json
import os
import subprocess
import time

import jax
import numpy as np
import pytest

from jaxsora.data.features import MANIFEST, PROGRESS, FeatureCacheError, FeatureStore, shard_name
from jaxsora.models.vae import IdentityVAE
from tests.data.test_features import table  # noqa: F401  (module fixture: 10 clips and 6 images, 2 buckets)
from tests.ports import free_port
from tests.train.common import REPO
from tests.zygote import PYTHON, kill

SHARD_SIZE = 4  # 10 clips + 6 images → 3 + 2 = 5 shards: process 0 encodes shards 0, 2, 4 and process 1 shards 1, 3
NUM_SHARDS = 5
NOISE = 0.1  # the stand-in posterior's std (pixel-space latents lie in [-1, 1])
RUNNER = os.path.join(os.path.dirname(__file__), "run_precompute_procs.py")
TIMEOUT = 120  # seconds per 2-process command (each takes 5-20 s here)
# The config as a command line: the demo's tiny T5 shrunk further, and a 2-device data-parallel mesh.
OVERRIDES = ["--config.mesh.data=2", "--config.text_encoder.d_model=16", "--config.text_encoder.num_layers=1",
             "--config.text_encoder.d_ff=32", "--config.text_encoder.model_max_length=16"]


class SampledVAE(IdentityVAE):
    """IdentityVAE whose `encode` samples a posterior as the OpenSora VAE does: mean + NOISE·N(0, 1)
    drawn with `key`. video [B, 3, T, H, W] → [B, 3, T/ft, H/fh, W/fw]."""

    def encode(self, video, key):
        z = self.encode_mean(video)
        return z + NOISE * jax.random.normal(key, z.shape, z.dtype)


def install_sampled_vae(set_attr) -> None:
    """Make `build_vae_from_config` give a `SampledVAE` for the identity VAE (`set_attr` is `setattr`,
    or a monkeypatch's)."""
    from jaxsora.train import build

    original = build.build_vae_from_config

    def build_vae(cfg, *, abstract=False):
        vae = original(cfg, abstract=abstract)
        return SampledVAE(vae.downsample, vae.scale) if isinstance(vae, IdentityVAE) else vae

    set_attr(build, "build_vae_from_config", build_vae)


def precompute_args(table_path, out, *extra) -> list[str]:
    return ["--latents", "--config", os.path.join(REPO, "configs", "demo.py"), "--input", table_path,
            "--output", str(out), "--shard-size", str(SHARD_SIZE), "--workers", "2", "--no-progress", *OVERRIDES,
            *extra]


def two_processes(args, log_dir, stop_after=None) -> list[subprocess.CompletedProcess]:
    """Run the precompute command as 2 jax.distributed processes; their exit codes and outputs (also
    in `log_dir`/process{i}.log). A process still running after TIMEOUT fails the test with both outputs."""
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
           "JAX_NUM_PROCESSES": "2", "JAXSORA_INIT_TIMEOUT": "60"}  # a process that never comes fails in a minute
    cmd = [PYTHON, RUNNER, *(["--stop-after", str(stop_after)] if stop_after else []), *args]
    logs = [open(os.path.join(log_dir, f"process{i}.log"), "w+") for i in range(2)]
    procs = [subprocess.Popen(cmd, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=log, stderr=subprocess.STDOUT,
                              text=True) for i, log in enumerate(logs)]
    deadline = time.monotonic() + TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        kill(procs[i])
        procs[i].wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    if hung:  # a process waiting at a barrier for a peer that left: show what both said
        pytest.fail(f"process(es) {hung} still running after {TIMEOUT} s:\n\n" + "\n\n".join(
            f"process {i}:\n{o[-3000:]}" for i, o in enumerate(outs)))
    return [subprocess.CompletedProcess(cmd, p.returncode, o) for p, o in zip(procs, outs)]


def _ok(results):
    assert all(r.returncode == 0 for r in results), "\n\n".join(
        f"process {i} exited {r.returncode}:\n{r.stdout[-3000:]}" for i, r in enumerate(results))


@pytest.fixture(scope="module")
def reference(table, tmp_path_factory):  # noqa: F811
    """The cache one process writes (the pytest process: the mesh's 2 devices, 2 clips per encoder call)."""
    from data_tools.precompute import main

    out = tmp_path_factory.mktemp("reference") / "f"
    with pytest.MonkeyPatch.context() as mp:
        install_sampled_vae(mp.setattr)
        manifest = main(precompute_args(table, out))
    assert manifest["num_records"] == 16 and len(manifest["shards"]) == NUM_SHARDS
    return str(out)


def assert_same_cache(got: str, expected: str) -> None:
    """Two finished feature folders hold the same cache: manifest (fingerprint included), TFDS
    metadata, assignment and every record's latents, text states and metadata."""
    a, b = FeatureStore(got), FeatureStore(expected)
    assert a.manifest == b.manifest
    for name in ("dataset_info.json", "features.json"):
        with open(os.path.join(got, name)) as fa, open(os.path.join(expected, name)) as fb:
            assert json.load(fa) == json.load(fb), name
    np.testing.assert_array_equal(a.record_rows, b.record_rows)
    np.testing.assert_array_equal(a.record_bucket, b.record_bucket)
    rows = a.record_rows.tolist()
    for ra, rb in zip(a.read(rows), b.read(rows)):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_array_equal(np.asarray(ra[k]), np.asarray(rb[k]), err_msg=f"row {ra['row']}: {k}")


def _progress(out) -> dict[str, float]:
    folder = os.path.join(out, PROGRESS)
    return {f: os.path.getmtime(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


def test_two_processes_write_the_one_process_cache(table, reference, tmp_path):  # noqa: F811
    out = tmp_path / "f"
    results = two_processes(precompute_args(table, out), tmp_path)
    _ok(results)
    assert "jax.distributed: 2 processes, 2 devices" in results[0].stdout  # the command joined the processes
    # process 0 alone writes the metadata and reports; process 1 returns once its shards are written
    assert "wrote 16 clips" in results[0].stdout and "wrote" not in results[1].stdout
    assert len(_progress(out)) == NUM_SHARDS
    assert_same_cache(str(out), reference)


def test_interrupted_two_process_precompute_resumes(table, reference, tmp_path):  # noqa: F811
    out = tmp_path / "f"
    _ok(two_processes(precompute_args(table, out), tmp_path, stop_after=1))
    # each process encoded the first of its own shards (shard i is process i mod 2's); no manifest yet
    assert list(_progress(out)) == [shard_name(i, NUM_SHARDS) + ".json" for i in (0, 1)]
    assert not os.path.exists(out / MANIFEST)
    with pytest.raises(FeatureCacheError, match="did not finish"):
        FeatureStore(str(out))
    stamps = _progress(out)
    results = two_processes(precompute_args(table, out), tmp_path)
    _ok(results)
    assert "resuming: 1 of 3 shards already encoded" in results[0].stdout
    done = _progress(out)
    assert {k: done[k] for k in stamps} == stamps and len(done) == NUM_SHARDS  # shards 0 and 1 not encoded again
    assert_same_cache(str(out), reference)
    # another setup into the folder: process 0 refuses it, and process 1 leaves too instead of waiting
    results = two_processes(precompute_args(table, out, "--config.data.seed=7"), tmp_path)
    assert [r.returncode for r in results] == [2, 2], [r.stdout[-3000:] for r in results]
    assert "another setup (changed: seed)" in results[0].stdout
    assert "process 0 could not prepare the output folder" in results[1].stdout
    assert not any("Traceback" in r.stdout for r in results), [r.stdout[-3000:] for r in results]
    assert _progress(out) == done
