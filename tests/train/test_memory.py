"""Memory before step 0: the dry run prints every bucket's compiled memory; a run refuses, before
writing anything, buckets that cannot fit and names the largest batch that would; the batch-size
search finds, by compiling, the largest batch under the limit and writes a bucket config a run
can use. The search's command line, on the demo config and its 0.3 GiB boundary, is a step of the README
walk (tests/test_readme_walk.py, `_search_found_the_boundary`)."""
import json
import os

import pytest

from jaxsora.tools.search_bs import search
from jaxsora.train.plan import memory
from jaxsora.train.run.loop import RunOptions, train
from jaxsora.train.run.setup import setup_run
from tests.train.common import small_config
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
    assert not os.path.exists(tmp_path / "run")  # refused: the folder it made is taken back


def _tree(root):
    """Every path under root with its bytes (the shared compilation cache aside: a cache, not a run's)."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "jax_cache"]
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
        out[os.path.relpath(d, root) + "/"] = b""
    return out


@pytest.mark.slow
def test_a_refused_run_leaves_nothing_behind(peaks, tmp_path):
    """Numbered runs, --run-dir of an existing empty folder and a --load resume, each refused by the
    memory check: the outputs folder is byte for byte what it was, and the next new run takes the
    number the refused one would have had."""
    outputs = tmp_path / "outputs"
    ok = small_config(outputs, mesh=(1, 1, 1), max_steps=2, ckpt_every=2, experiment="ok")
    first = train(ok, RunOptions(), loader_factory=_factory(2))["outputs"]
    number = int(os.path.basename(first).split("-")[0])
    (outputs / "empty").mkdir()
    before = _tree(outputs)
    tight = (peaks[2] + peaks[3]) / 2 / memory.GIB
    for opts in (RunOptions(), RunOptions(run_dir=str(outputs / "empty")), RunOptions(load=first)):
        cfg = small_config(outputs, mesh=(1, 1, 1), max_steps=4, experiment="big" if not opts.load else "ok")
        cfg.train.device_memory_gib = tight
        with pytest.raises(memory.MemoryPlanError):
            train(cfg, opts, loader_factory=_factory(4))
        after = _tree(outputs)
        assert after.keys() == before.keys(), (opts, sorted(set(after) ^ set(before)))
        assert after == before, (opts, [k for k in after if after[k] != before[k]])
    again = train(small_config(outputs, mesh=(1, 1, 1), max_steps=1, experiment="next"), RunOptions(),
                  loader_factory=_factory(2))["outputs"]
    assert os.path.basename(again) == f"{number + 1:03d}-next"


def test_dry_run_refuses_a_bucket_that_does_not_fit(peaks, tmp_path, capsys):
    """The dry run prints its plan and table, then ends with the real start's refusal and suggestion
    (MemoryPlanError: exit code 2 from the CLI), so a script or CI gate can use it."""
    cfg = small_config(tmp_path, mesh=(1, 1, 1))
    cfg.train.device_memory_gib = (peaks[2] + peaks[3]) / 2 / memory.GIB
    with pytest.raises(memory.MemoryPlanError, match=r"largest per-device batch that fits: 2"):
        train(cfg, RunOptions(dry_run=True, run_dir=str(tmp_path / "run")), loader_factory=_factory(4))
    assert "per-device memory of the compiled train step" in capsys.readouterr().out  # the table came first


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


def test_search_bs_reads_the_bucket_config_file(peaks, tmp_path):
    """--config.data.bucket_config_file replaces the inline bucket config for the search, as it does for
    the trainer: a resolution only the file names is searched, the inline one is not."""
    cfg = small_config(tmp_path, mesh=(1, 1, 1))
    cfg.data.resolutions = {"s16": [("1.00", (16, 16))], "s8": [("1.00", (8, 8))]}
    cfg.data.bucket_config = {"s8": {4: (1.0, 2)}}
    path = tmp_path / "file.json"
    path.write_text(json.dumps({"s16": {"4": [0.5, 64]}}))
    cfg.data.bucket_config_file = str(path)
    cfg.train.device_memory_gib = (peaks[3] + peaks[4]) / 2 / memory.GIB
    result = search(cfg, fraction=1.0, use_table=False, progress=False)
    assert result["bucket_config"] == {"s16": {"4": [0.5, 3]}}
    assert [(r["resolution"], r["height"], r["width"]) for r in result["rows"]] == [("s16", 16, 16)]
