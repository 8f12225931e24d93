"""The loader: deterministic plans, host shares, exact resume, refusal of changed data, bad files."""
import os
import shutil

import numpy as np
import pandas as pd
import pytest

from data_tools.synthetic import generate
from jaxsora.data.loader import VideoLoader
from jaxsora.data.plan import DataStateMismatch

RES = {"s32": [("1.00", (32, 32)), ("0.60", (24, 40)), ("1.67", (40, 24))]}
BUCKETS = {"s32": {1: (1.0, 2), 8: (1.0, 2), 16: (0.5, 1)}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate(str(out), num_videos=30, num_images=6, sizes=[(32, 32), (24, 40), (40, 24)], frames=[12, 20], fps=8,
             seed=0, progress=False)
    return out


def _loader(table, **kw):
    args = dict(seed=3, data_parallel_size=1, extra_resolutions=RES)
    args.update(kw)
    return VideoLoader(str(table), BUCKETS, **args)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_plan_is_deterministic_and_uses_reference_shapes(dataset):
    a, b = _loader(dataset / "meta.csv"), _loader(dataset / "meta.csv")
    pa, pb = a.plan(0), b.plan(0)
    assert [p.rows.tolist() for p in pa] == [p.rows.tolist() for p in pb]
    assert [p.rows.tolist() for p in a.plan(1)] != [p.rows.tolist() for p in pa]  # re-drawn each epoch
    for batch in _take(a, 6):
        assert batch["video"].shape[2:] == batch["bucket"][1:]
        assert batch["video"].min() >= -1 and batch["video"].max() <= 1
    desc = a.describe_plan(0)
    assert sum(d[1] for d in desc) == a.steps_per_epoch(0)
    assert sum(d[3] for d in desc) <= len(a.df)


def test_host_shares_partition_the_global_batch(dataset):
    one = _loader(dataset / "meta.csv", data_parallel_size=2)
    hosts = [_loader(dataset / "meta.csv", data_parallel_size=2, process_index=i, process_count=2) for i in range(2)]
    for g, h0, h1 in zip(_take(one, 4), _take(hosts[0], 4), _take(hosts[1], 4)):
        assert not set(h0["row"]) & set(h1["row"])
        np.testing.assert_array_equal(np.concatenate([h0["row"], h1["row"]]), g["row"])
        np.testing.assert_array_equal(np.concatenate([h0["video"], h1["video"]]), g["video"])


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_is_exact(dataset, workers):
    ref = _take(_loader(dataset / "meta.csv"), 10)
    first = _loader(dataset / "meta.csv", num_workers=2)
    _take(first, 4)
    state = first.state()
    resumed = _loader(dataset / "meta.csv", num_workers=workers)
    resumed.restore(state)
    for a, b in zip(_take(resumed, 6), ref[4:]):
        np.testing.assert_array_equal(a["row"], b["row"])
        np.testing.assert_array_equal(a["video"], b["video"])


def test_changed_table_refused_unless_reset(dataset, tmp_path):
    state = _loader(dataset / "meta.csv").state()
    df = pd.read_csv(dataset / "meta.csv")
    df.loc[0, "text"] = "a different caption"
    shutil.copytree(dataset, tmp_path / "d")
    df.to_csv(tmp_path / "d" / "meta.csv", index=False)
    changed = _loader(tmp_path / "d" / "meta.csv")
    with pytest.raises(DataStateMismatch, match="dataset table"):
        changed.restore(state)
    with pytest.raises(DataStateMismatch, match="data-parallel size"):
        _loader(dataset / "meta.csv", data_parallel_size=2).restore(state)
    changed.restore(state, reset=True)
    assert changed.state()["epoch"] == 0 and changed.state()["index"] == 0


def test_bad_files_are_skipped_and_replaced(dataset, tmp_path, capsys):
    shutil.copytree(dataset, tmp_path / "d")
    df = pd.read_csv(tmp_path / "d" / "meta.csv")
    videos = df.index[df.num_frames > 1].tolist()
    open(tmp_path / "d" / df.path[videos[0]], "wb").close()  # zero-length
    with open(tmp_path / "d" / df.path[videos[1]], "wb") as f:  # corrupt
        f.write(b"\x00not a video" * 100)
    os.remove(tmp_path / "d" / df.path[videos[2]])  # missing
    loader = _loader(tmp_path / "d" / "meta.csv")
    bad = {videos[0], videos[1], videos[2]}
    for batch in _take(loader, loader.steps_per_epoch(0)):
        assert len(batch["row"]) == len(batch["text"]) == batch["video"].shape[0]  # always full
        assert not bad & set(batch["row"].tolist())
    assert loader.num_skipped >= 1
    assert "skipped row" in capsys.readouterr().err


def test_table_errors_name_the_problem(tmp_path):
    pd.DataFrame({"path": ["a.mp4"], "text": ["x"]}).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['num_frames', 'height', 'width'\]"):
        _loader(tmp_path / "t.csv")
    with pytest.raises(ValueError, match="table not found"):
        _loader(tmp_path / "missing.csv")
