"""The loader: deterministic plans, host shares, exact resume (grain worker processes too, across
epochs), refusal of changed data, a moved dataset accepted, bad files and bad rows (skipped,
counted per reason, replayed on resume), two jax.distributed hosts, nothing left behind (worker
processes after a kill -9, shared memory, temporary table indexes)."""
import contextlib
import json
import os
import pickle
import shutil
import subprocess
import time

import numpy as np
import pandas as pd
import pytest

from data_tools.synthetic import generate
from jaxsora.data.loader import VideoLoader
from jaxsora.data.plan import DataStateMismatch
from jaxsora.data.tables import TableIndex, read_table
from jaxsora.data.video import to_model_range
from tests.ports import free_port
from tests.zygote import PYTHON, command_pid, kill

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


def test_codec_threads_share_the_cores_and_leave_the_batches_unchanged(dataset, reference_batches):
    from jaxsora.data.loader import default_codec_threads

    assert default_codec_threads(8, 1, cores=16) == 2  # 8 workers on 16 cores
    assert default_codec_threads(8, 1, cores=2) == 1
    assert default_codec_threads(0, 1, cores=64) == 4  # in-process decoding: capped
    assert default_codec_threads(2, 2, cores=12) == 3  # workers × read threads share the cores
    assert _loader(dataset / "meta.csv", num_workers=8).codec_threads == default_codec_threads(8)
    threaded = _loader(dataset / "meta.csv", codec_threads=3)
    assert threaded.codec_threads == 3
    for a, b in zip(_take(threaded, 3), reference_batches):
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



def test_two_jax_distributed_hosts_assemble_the_one_host_batches(dataset, tmp_path):
    """Two processes (jax.distributed on 127.0.0.1, 2 CPU devices each; one decodes in grain worker
    processes) agree on the plan, each decodes only its half, and the global arrays they assemble
    equal the batches one process reads alone."""
    port = free_port()
    procs = [subprocess.Popen(
        [PYTHON, os.path.join(REPO, "tests", "data", "run_host.py"), str(dataset / "meta.csv"),
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


# ---- rows that cannot fill their bucket -----------------------------------------------------------

BAD_REASONS = {"image_in_video_bucket", "animated_image", "too_short", "missing", "unreadable", "empty_caption"}


@pytest.fixture(scope="module")
def bad_table(dataset, tmp_path_factory):
    """The synthetic set plus one row per kind of bad row (all 32×32, declared 12 frames: the 8-frame
    bucket). → (table path, {row: the reason it must be skipped for})."""
    from PIL import Image

    from jaxsora.data.video import write_mp4

    d = tmp_path_factory.mktemp("bad") / "d"
    shutil.copytree(dataset, d)
    df = pd.read_csv(d / "meta.csv")
    good = df.index[(df.num_frames == 12) & (df.height == 32) & (df.width == 32)][0]
    image = df.index[df.num_frames == 1][0]
    os.makedirs(d / "bad")
    frames = [Image.fromarray(np.full((32, 32, 3), v, np.uint8)) for v in (40, 120, 200)]
    frames[0].save(d / "bad" / "anim.gif", save_all=True, append_images=frames[1:], duration=100)
    write_mp4(np.zeros((1, 32, 32, 3), np.uint8), str(d / "bad" / "one.mp4"), 8)
    blob = (d / df.path[good]).read_bytes()
    (d / "bad" / "truncated.mp4").write_bytes(blob[: len(blob) // 2])
    shutil.copy(d / df.path[good], d / "bad" / "uncaptioned.mp4")
    shutil.copy(d / df.path[good], d / "bad" / "blank.mp4")
    row = dict(num_frames=12, height=32, width=32, aspect_ratio=1.0, resolution=1024, fps=8.0)
    bad = [(df.path[image], "an image declared as a clip", "image_in_video_bucket"),
           ("bad/anim.gif", "an animated gif declared as a clip", "animated_image"),
           ("bad/one.mp4", "one real frame", "too_short"),
           ("bad/gone.mp4", "a missing file", "missing"),
           ("bad/truncated.mp4", "half a file", "unreadable"),
           ("bad/uncaptioned.mp4", "", "empty_caption"),
           ("bad/blank.mp4", "  ", "empty_caption")]
    df = pd.concat([df, pd.DataFrame([dict(row, path=p, text=t) for p, t, _ in bad])], ignore_index=True)
    df.to_csv(d / "meta.csv", index=False)
    return d / "meta.csv", {len(df) - len(bad) + i: reason for i, (_, _, reason) in enumerate(bad)}


def _expected_skips(loader, bad, epoch, n):
    """The skips of the first n batches of `epoch` by the documented rule: a bad row in slot s of
    batch i is replaced by row pool[rng([seed, epoch, i, s, attempt]).integers(len(pool))], pool =
    the bucket's rows this epoch, until a good one comes up. → ({reason: count}, planned bad rows)."""
    counts, planned = {}, set()
    for i, pb in enumerate(loader.plan(epoch)[:n]):
        pool = np.concatenate([p.rows for p in loader.plan(epoch) if p.bucket == pb.bucket])
        for s, row in enumerate(pb.rows.tolist()):
            planned |= {row} & set(bad)
            attempt = 0
            while row in bad:
                counts[bad[row]] = counts.get(bad[row], 0) + 1
                attempt += 1
                row = int(pool[np.random.default_rng([loader.seed, epoch, i, s, attempt]).integers(len(pool))])
    return counts, planned


def test_bad_rows_are_skipped_counted_and_replaced(bad_table, capsys):
    table, bad = bad_table
    loader = _loader(table)
    n = loader.steps_per_epoch(0)
    expected, planned = _expected_skips(loader, bad, 0, n)
    assert {bad[r] for r in planned} == BAD_REASONS  # every kind of bad row is met in this epoch
    for batch in _take(loader, n):
        _, t, h, w = batch["bucket"]
        assert batch["video"].shape == (len(batch["row"]), 3, t, h, w) and batch["video"].dtype == np.uint8
        assert not set(bad) & set(batch["row"].tolist())
        assert all(batch["text"])
    assert loader.skip_counts == expected and set(expected) == BAD_REASONS
    assert loader.num_skipped == sum(expected.values())
    assert loader.state()["skipped"] == expected
    warnings = [line for line in capsys.readouterr().err.splitlines() if "skipped row" in line]
    assert len(warnings) == loader.num_skipped
    for reason in BAD_REASONS:
        assert any(f"({reason}):" in line for line in warnings), reason


def test_a_sample_of_the_wrong_shape_is_skipped_not_stacked(dataset, monkeypatch):
    """Whatever a decoder returns, a batch only stacks samples of the bucket's [3, T, H, W]."""
    import jaxsora.data.loader as loader_mod

    loader = _loader(dataset / "meta.csv")
    victim = int(loader.plan(0)[0].rows[0])
    real = loader_mod.load_sample

    def load(path, t, h, w, **kw):
        video, fps = real(path, t, h, w, **kw)
        return (video[:, :, :-1], fps) if path == loader.table.path(victim) else (video, fps)

    monkeypatch.setattr(loader_mod, "load_sample", load)
    batch = _take(loader, 1)[0]
    _, t, h, w = batch["bucket"]
    assert batch["video"].shape == (len(batch["row"]), 3, t, h, w) and victim not in batch["row"]
    assert loader.skip_counts == {"bad_shape": 1}


@pytest.fixture(scope="module")
def bad_reference(bad_table):
    """The uninterrupted run over the bad table, past the end of epoch 0, with the counts after each batch."""
    loader = _loader(bad_table[0])
    batches, counts = [], []
    for batch in loader:
        batches.append(batch)
        counts.append(dict(loader.skip_counts))
        if len(batches) == loader.steps_per_epoch(0) + 3:
            break
    return batches, counts


@pytest.mark.parametrize("first_workers,resumed_workers", [(2, 0), (0, 2)])
def test_resume_replays_skips_exactly(bad_table, bad_reference, first_workers, resumed_workers):
    ref, ref_counts = bad_reference
    first = _loader(bad_table[0], num_workers=first_workers)
    for a, b in zip(_take(first, 5), ref):
        np.testing.assert_array_equal(a["row"], b["row"])
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    assert state["skipped"] == ref_counts[4]
    resumed = _loader(bad_table[0], num_workers=resumed_workers)
    resumed.restore(state)
    for a, b in zip(_take(resumed, len(ref) - 5), ref[5:]):
        np.testing.assert_array_equal(a["row"], b["row"])
        np.testing.assert_array_equal(a["video"], b["video"])
    assert resumed.skip_counts == ref_counts[-1] and ref[-1]["epoch"] == 1


def test_skip_counts_restore_from_old_states_and_reset(bad_table):
    loader = _loader(bad_table[0])
    old = {k: v for k, v in loader.state().items() if k != "skipped"}  # saved before the counts existed
    old["index"] = 2
    loader.skip_counts = {"missing": 3}
    loader.restore(old)
    assert (loader.index, loader.skip_counts, loader.num_skipped) == (2, {}, 0)
    loader.restore(dict(old, skipped={"missing": 3, "too_short": 1}))
    assert loader.skip_counts == {"missing": 3, "too_short": 1} and loader.num_skipped == 4
    loader.restore(old, reset=True)
    assert (loader.epoch, loader.index, loader.skip_counts) == (0, 0, {})


# ---- nothing left behind ------------------------------------------------------------------------

def test_batches_leave_no_shared_memory_names(dataset):
    """Batches from worker processes arrive in shared memory; their /dev/shm names are gone once
    received, so batches still referenced when the process exits leak nothing."""
    it = iter(_loader(dataset / "meta.csv", num_workers=2))
    kept = [next(it) for _ in range(3)]
    it.close()
    names = [v.shm.name for b in kept for v in b.values() if getattr(v, "shm", None) is not None]
    assert names  # the video (at least) came through shared memory
    assert not [n for n in names if os.path.exists(os.path.join("/dev/shm", n.lstrip("/")))]
    np.testing.assert_array_equal(kept[0]["video"], _take(_loader(dataset / "meta.csv"), 1)[0]["video"])


_ITERATE_FOREVER = """
import sys, time
from tests.data.test_loader import _loader
if __name__ == "__main__":
    it = iter(_loader(sys.argv[1], num_workers=2))
    next(it)
    print("ready", flush=True)
    time.sleep(600)
"""


def _alive(procs):
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_workers_exit_when_the_trainer_is_killed(dataset, tmp_path):
    import psutil

    script = tmp_path / "iterate.py"
    script.write_text(_ITERATE_FOREVER)
    proc = subprocess.Popen([PYTHON, str(script), str(dataset / "meta.csv")], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, text=True)
    children = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        children = psutil.Process(command_pid(proc)).children(recursive=True)
        workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) >= 2  # the two grain workers (and the resource tracker)
        kill(proc)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(children), [c.cmdline() for c in _alive(children)]
    finally:  # on failure: stop what the test started; the resource tracker then cleans up and exits
        for p in [proc] + [c for c in _alive(children) if "resource_tracker" not in " ".join(c.cmdline())]:
            with contextlib.suppress(Exception):
                p.kill()
        proc.stdout.close()


_BUILD_INDEX = """
import sys
import time
from jaxsora.data.tables import TableIndex
index = TableIndex.build(sys.argv[1], progress=False)
print(index.directory, flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()  # until the test closes stdin (or kills us)
"""


def test_temporary_table_indexes_are_removed_at_exit_and_after_a_kill(dataset, tmp_path, monkeypatch):
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def start(mode):
        p = subprocess.Popen([PYTHON, "-c", _BUILD_INDEX, str(dataset / "meta.csv"), mode], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return p, p.stdout.readline().strip()

    done, done_dir = start("exit")
    assert done.wait(timeout=60) == 0 and done_dir.startswith(str(tmp)) and not os.path.exists(done_dir)
    killed, killed_dir = start("wait")
    live, live_dir = start("wait")
    kill(killed)
    killed.wait(timeout=30)
    assert os.path.isdir(killed_dir) and os.path.isdir(live_dir)  # nobody ran the dead one's exit hooks
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    ours = TableIndex.build(str(dataset / "meta.csv"), progress=False)  # a temporary build sweeps first
    assert not os.path.exists(killed_dir)  # its owner is dead
    assert os.path.isdir(live_dir) and os.path.isdir(ours.directory)  # their owners run
    assert f"jaxsora-table-{os.getpid()}-" in ours.directory
    live.communicate("", timeout=60)  # a normal exit
    assert live.returncode == 0 and not os.path.exists(live_dir)


def test_rows_left_out_of_the_plan_are_said(dataset, tmp_path):
    """Clips of exactly a bucket's frame count fit no video bucket (Open-Sora takes T > f frames): a table of
    8-frame clips with an 8-frame bucket trains on its images alone — the loader says so, with the count."""
    df = read_table(str(dataset / "meta.csv"))
    eight = df.assign(num_frames=np.where(df.num_frames > 1, 8, 1))
    eight.to_csv(tmp_path / "meta.csv", index=False)  # the plan reads the table only
    loader = _loader(tmp_path / "meta.csv", extra_resolutions=RES)
    note = loader.left_out_note(0)
    videos = int((eight.num_frames > 1).sum())
    assert note is not None and f"trains on {len(eight) - videos} of {len(eight)} rows" in note, note
    assert f"{videos} are clips of too few frames for every video bucket" in note, note
    full = _loader(dataset / "meta.csv", extra_resolutions=RES, seed=3)
    assigned = sum(d[3] for d in full.describe_plan(0))
    assert (full.left_out_note(0) is None) == (assigned == full.num_rows)
