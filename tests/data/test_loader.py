"""The loader: deterministic plans, host shares, exact resume (grain worker processes too, across
epochs), refusal of changed data, a moved dataset accepted, bad files, two jax.distributed hosts."""
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from data_tools.synthetic import generate
from jaxsora.data.loader import VideoLoader
from jaxsora.data.plan import DataStateMismatch
from jaxsora.data.tables import TableIndex, read_table
from jaxsora.data.video import to_model_range

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

RES = {"s32": [("1.00", (32, 32)), ("0.60", (24, 40)), ("1.67", (40, 24))]}
BUCKETS = {"s32": {1: (1.0, 2), 8: (1.0, 2), 16: (0.5, 1)}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate(str(out), num_videos=30, num_images=6, sizes=[(32, 32), (24, 40), (40, 24)], frames=[12, 20], fps=8,
             seed=0, progress=False)
    return out


def _loader(table, **kw):
    args = dict(seed=3, data_parallel_size=1, extra_resolutions=RES, progress=False)
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
        assert batch["video"].dtype == np.uint8
        x = to_model_range(batch["video"])
        assert x.min() >= -1 and x.max() <= 1 and x.max() > x.min()
    desc = a.describe_plan(0)
    assert sum(d[1] for d in desc) == a.steps_per_epoch(0)
    assert sum(d[3] for d in desc) <= a.num_rows


def test_table_index_equals_the_table_and_pickles_small(dataset):
    index = TableIndex.build(str(dataset / "meta.csv"), progress=False)
    df = read_table(str(dataset / "meta.csv"))
    assert len(index) == len(df)
    assert index.paths() == df["path"].tolist() and index.texts() == df["text"].tolist()
    np.testing.assert_array_equal(index.num_frames, df["num_frames"])
    blob = pickle.dumps(index)
    assert len(blob) < 500  # the folder name, not the table
    assert pickle.loads(blob).text(3) == df["text"][3]


def test_table_index_is_reused_until_the_table_changes(dataset, tmp_path):
    shutil.copy(dataset / "meta.csv", tmp_path / "meta.csv")
    first = TableIndex.build(str(tmp_path / "meta.csv"), str(tmp_path / "index"), progress=False)
    stamp = os.stat(tmp_path / "index" / "index.json").st_mtime_ns
    again = TableIndex.build(str(tmp_path / "meta.csv"), str(tmp_path / "index"), progress=False)
    assert os.stat(tmp_path / "index" / "index.json").st_mtime_ns == stamp  # reused, not rewritten
    assert again.fingerprint == first.fingerprint
    df = pd.read_csv(tmp_path / "meta.csv")
    df.loc[2, "text"] = "edited"
    df.to_csv(tmp_path / "meta.csv", index=False)
    changed = TableIndex.build(str(tmp_path / "meta.csv"), str(tmp_path / "index"), progress=False)
    assert changed.fingerprint != first.fingerprint and changed.text(2) == "edited"


def test_host_shares_partition_the_global_batch(dataset):
    one = _loader(dataset / "meta.csv", data_parallel_size=2)
    hosts = [_loader(dataset / "meta.csv", data_parallel_size=2, process_index=i, process_count=2) for i in range(2)]
    for g, h0, h1 in zip(_take(one, 4), _take(hosts[0], 4), _take(hosts[1], 4)):
        assert not set(h0["row"]) & set(h1["row"])
        np.testing.assert_array_equal(np.concatenate([h0["row"], h1["row"]]), g["row"])
        np.testing.assert_array_equal(np.concatenate([h0["video"], h1["video"]]), g["video"])


@pytest.fixture(scope="module")
def reference_batches(dataset):
    """The uninterrupted run, in this process: well past the end of epoch 0."""
    loader = _loader(dataset / "meta.csv")
    n = loader.steps_per_epoch(0) + 4
    return _take(loader, n)


@pytest.mark.parametrize("first_workers,resumed_workers,threads", [(2, 0, 1), (0, 3, 2)])
def test_mid_epoch_resume_is_exact(dataset, reference_batches, first_workers, resumed_workers, threads):
    """Stop after 4 batches with one worker count; resume with another (grain worker processes or
    none, several read threads): the same batches, across the epoch boundary."""
    ref = reference_batches
    first = _loader(dataset / "meta.csv", num_workers=first_workers)
    got = _take(first, 4)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a["video"], b["video"])
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    resumed = _loader(dataset / "meta.csv", num_workers=resumed_workers, decode_threads=threads)
    resumed.restore(state)
    for a, b in zip(_take(resumed, len(ref) - 4), ref[4:]):
        np.testing.assert_array_equal(a["row"], b["row"])
        np.testing.assert_array_equal(a["video"], b["video"])
        assert (a["epoch"], a["index"]) == (b["epoch"], b["index"])
    assert ref[-1]["epoch"] == 1  # the comparison crossed into epoch 1


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


def test_moved_dataset_keeps_its_fingerprint(dataset, tmp_path):
    """Relative paths are fingerprinted from the dataset's folder: moving it (or sharding the table
    into another folder) is not a data change; resuming there is exact."""
    ref = _take(_loader(dataset / "meta.csv"), 3)
    first = _loader(dataset / "meta.csv")
    _take(first, 2)
    shutil.copytree(dataset, tmp_path / "moved" / "elsewhere")
    moved = _loader(tmp_path / "moved" / "elsewhere" / "meta.csv")
    moved.restore(first.state())
    np.testing.assert_array_equal(_take(moved, 1)[0]["video"], ref[2]["video"])


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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_jax_distributed_hosts_assemble_the_one_host_batches(dataset, tmp_path):
    """Two processes (jax.distributed on 127.0.0.1, 2 CPU devices each; one decodes in grain worker
    processes) agree on the plan, each decodes only its half, and the global arrays they assemble
    equal the batches one process reads alone."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "data", "run_host.py"), str(dataset / "meta.csv"),
         str(tmp_path / f"host{i}.npz"), "--workers", str(i), "--batches", "3"],
        env={**os.environ, "PYTHONPATH": REPO, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
             "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    hosts = [dict(np.load(tmp_path / f"host{i}.npz")) for i in range(2)]
    single = _loader(dataset / "meta.csv", data_parallel_size=4)
    assert all(int(h["process_count"]) == 2 and int(h["dp"]) == 4 for h in hosts)
    assert str(hosts[0]["fingerprint"]) == str(hosts[1]["fingerprint"]) == str(single.fingerprint)
    np.testing.assert_array_equal(hosts[0]["plan0"], hosts[1]["plan0"])
    np.testing.assert_array_equal(hosts[0]["plan0"], np.concatenate([p.rows for p in single.plan(0)]))
    for i, ref in enumerate(_take(single, 3)):
        for h in hosts:
            np.testing.assert_array_equal(h[f"row{i}"], ref["row"])
            np.testing.assert_array_equal(h[f"video{i}"], ref["video"])
    np.testing.assert_array_equal(hosts[0]["state"], [single.state()["epoch"], single.state()["index"]])


def test_same_size_crop_equals_the_pil_path():
    from PIL import Image

    from jaxsora.data.video import resize_crop

    frames = np.random.default_rng(0).integers(0, 256, (2, 24, 40, 3), dtype=np.uint8)
    pil = np.stack([np.asarray(Image.fromarray(f).resize((40, 24), Image.BILINEAR)) for f in frames])
    np.testing.assert_array_equal(resize_crop(frames, 24, 40), pil)
    np.testing.assert_array_equal(resize_crop(frames, 24, 30), pil[:, :, 5:35])


class _RecordingTokenizer:
    """Byte tokenizer that records the process it ran in (picklable, as the grain workers need)."""

    def __init__(self, log):
        from jaxsora.models.t5 import ByteTokenizer

        self.inner, self.log = ByteTokenizer(16), str(log)

    def __call__(self, texts):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return self.inner(texts)


def test_text_inputs_are_made_in_the_loader_workers(dataset, tmp_path):
    from jaxsora.train.build import TextInputs

    in_process = _take(_loader(dataset / "meta.csv", text_inputs=TextInputs(
        tokenizer=_RecordingTokenizer(tmp_path / "main"))), 3)
    workers = _take(_loader(dataset / "meta.csv", num_workers=1, text_inputs=TextInputs(
        tokenizer=_RecordingTokenizer(tmp_path / "pids"))), 3)
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert pids and os.getpid() not in pids  # tokenized in the worker process only
    for a, b in zip(in_process, workers):
        np.testing.assert_array_equal(a["ids"], b["ids"])
        np.testing.assert_array_equal(a["text_mask"], b["text_mask"])
        assert a["ids"].shape == (len(a["text"]), 16) and a["ids"].dtype == np.int32
