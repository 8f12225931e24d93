"""Memory before step 0: the dry run prints every bucket's compiled memory; a run refuses, before
writing anything, buckets that cannot fit and names the largest batch that would; the batch-size
search finds, by compiling, the largest batch under the limit and writes a bucket config a run
can use."""
import json
import os
import subprocess
import sys

import pytest

from jaxsora.tools.search_bs import search
from jaxsora.train import memory
from jaxsora.train.loop import RunOptions, train
from jaxsora.train.setup import setup_run
from tests.train.common import REPO, small_config
from tests.train.fake_loader import FakeLoader

SIZE = (4, 16, 16)  # the fake loader's bucket: 4 frames of 16×16


def _factory(per_device_batch):
    def factory(config, dp, text_inputs):
        return FakeLoader(data_parallel_size=dp, per_device_batch=per_device_batch, text_inputs=text_inputs)
    return factory


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """Compiled peak bytes per device at per-device batch 1..5 on one device."""
    setup = setup_run(small_config(tmp_path_factory.mktemp("peaks"), mesh=(1, 1, 1)))
    return {b: memory.peak_bytes(setup, SIZE, b) for b in range(1, 6)}


def test_peak_memory_grows_with_the_batch(peaks):
    assert all(peaks[b + 1] > peaks[b] for b in range(1, 5))


def test_dry_run_prints_compiled_memory_per_bucket(tmp_path, capsys):
    res = train(small_config(tmp_path, mesh=(1, 1, 1)), RunOptions(dry_run=True, run_dir=str(tmp_path / "run")),
                loader_factory=_factory(2))
    out = capsys.readouterr().out
    assert "per-device memory of the compiled train step" in out and "peak GiB" in out
    (row,) = res["buckets"]
    assert row.bucket == ("fake", *SIZE) and row.global_batch == 2
    assert row.info.temp_bytes > 0 and row.info.argument_bytes > 0 and row.info.seconds > 0
    assert not os.path.exists(tmp_path / "run" / "checkpoints")  # a dry run writes no checkpoint


def test_run_refuses_a_bucket_that_does_not_fit(peaks, tmp_path):
    cfg = small_config(tmp_path, mesh=(1, 1, 1))
    cfg.train.device_memory_gib = (peaks[2] + peaks[3]) / 2 / memory.GIB  # batch 2 fits, 3 does not
    with pytest.raises(memory.MemoryPlanError, match=r"fake 4×16×16: per-device batch 4 .* largest per-device "
                                                     r"batch that fits: 2"):
        train(cfg, RunOptions(run_dir=str(tmp_path / "run")), loader_factory=_factory(4))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")  # refused before anything was written


def test_largest_batch_is_the_boundary(peaks, tmp_path):
    setup = setup_run(small_config(tmp_path, mesh=(1, 1, 1)))
    for b in (1, 3):
        limit = (peaks[b] + peaks[b + 1]) // 2
        assert memory.largest_batch(setup, SIZE, limit, start=5) == b
    assert memory.largest_batch(setup, SIZE, peaks[1] - 1, start=5) == 0


def test_search_bs_writes_a_usable_bucket_config(peaks, tmp_path):
    cfg = small_config(tmp_path, mesh=(1, 1, 1))
    cfg.data.resolutions = {"s16": [("1.00", (16, 16))]}
    cfg.data.bucket_config = {"s16": {4: (0.5, 64)}}
    cfg.train.device_memory_gib = (peaks[3] + peaks[4]) / 2 / memory.GIB
    result = search(cfg, fraction=1.0, use_table=False, progress=False)
    assert result["bucket_config"] == {"s16": {"4": [0.5, 3]}}  # keep probability kept, batch found
    path = tmp_path / "bc.json"
    path.write_text(json.dumps(result["bucket_config"]))
    cfg.data.bucket_config_file = str(path)
    from jaxsora.config import validate_config

    validate_config(cfg)
    assert dict(cfg.data.bucket_config["s16"]) == {"4": [0.5, 3]}


def test_search_bs_cli(tmp_path):
    out = tmp_path / "bc.json"
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "jaxsora.tools.search_bs", "--config", os.path.join(REPO, "configs", "demo.py"),
           "--config.train.device_memory_gib=0.3", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(out.read_text())["demo32"]
    assert 1 <= found["8"][1] < found["1"][1]  # 8-frame clips fit fewer per device than images
    assert "peak GiB" in r.stdout
