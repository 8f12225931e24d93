"""Table paths beyond the local disk: samples and tables read through fsspec (``memory://`` stands in
for s3/gs here) give the frames the local files give; ``file://`` URLs are local paths; a missing
remote file is skipped for the same reason as a missing local one."""
import os
import shutil
import uuid

import fsspec
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from data_tools.synthetic import generate
from jaxsora.data.loader import VideoLoader
from jaxsora.data.tables import TableIndex, check_table, read_table
from jaxsora.data.video import DecodeError, load_sample, write_mp4


@pytest.fixture
def memfs():
    """A fresh folder of fsspec's in-process memory file system, as (fs, 'memory://<folder>'). Left
    in place (it goes with the test process): a loader's prefetch threads may still be decoding from
    it after the test took its batches."""
    fs = fsspec.filesystem("memory")
    root = f"/jaxsora-test-{uuid.uuid4().hex[:8]}"
    fs.mkdir(root)
    return fs, f"memory://{root}"


def _clip(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (1, 24, 40, 3), dtype=np.uint8).repeat(20, axis=0)
    frames = np.stack([np.roll(f, 2 * i, axis=1) for i, f in enumerate(frames)])
    return write_mp4(frames, str(tmp_path / "clip.mp4"), 8)


def test_a_clip_in_memory_gives_the_frames_of_the_local_file(tmp_path, memfs):
    fs, root = memfs
    local = _clip(tmp_path)
    fs.pipe(f"{root}/videos/clip.mp4", open(local, "rb").read())
    for t, seed in [(8, 0), (8, 1), (1, 2), (16, 3)]:
        kw = dict(frame_interval=1, num_frames_hint=20)
        want, fps = load_sample(local, t, 24, 32, rng=np.random.default_rng(seed), **kw)
        got, got_fps = load_sample(f"{root}/videos/clip.mp4", t, 24, 32, rng=np.random.default_rng(seed), **kw)
        np.testing.assert_array_equal(got, want)
        assert got_fps == fps
        by_url, _ = load_sample("file://" + local, t, 24, 32, rng=np.random.default_rng(seed), **kw)
        np.testing.assert_array_equal(by_url, want)


def test_remote_files_fail_for_the_local_reasons(tmp_path, memfs):
    fs, root = memfs
    kw = dict(frame_interval=1, rng=np.random.default_rng(0), num_frames_hint=12)
    with pytest.raises(DecodeError) as e:
        load_sample(f"{root}/nothing.mp4", 8, 16, 16, **kw)
    assert e.value.reason == "missing"
    with pytest.raises(DecodeError) as e:
        load_sample("file://" + str(tmp_path / "nothing.mp4"), 8, 16, 16, **kw)
    assert e.value.reason == "missing"
    fs.pipe(f"{root}/empty.mp4", b"")
    with pytest.raises(DecodeError) as e:
        load_sample(f"{root}/empty.mp4", 8, 16, 16, **kw)
    assert e.value.reason == "unreadable"
    fs.pipe(f"{root}/junk.mp4", b"\x00not a video" * 50)
    with pytest.raises(DecodeError) as e:
        load_sample(f"{root}/junk.mp4", 8, 16, 16, **kw)
    assert e.value.reason == "unreadable"
    with pytest.raises(DecodeError) as e:
        load_sample("nosuchprotocol://bucket/x.mp4", 8, 16, 16, **kw)
    assert e.value.reason == "unreadable"


def test_a_protocol_without_its_package_stops_instead_of_skipping_every_row():
    import importlib.util

    from jaxsora.errors import UserError

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed")
    with pytest.raises(UserError, match="s3fs") as e:
        load_sample("s3://bucket/clip.mp4", 8, 16, 16, frame_interval=1, rng=np.random.default_rng(0))
    assert not isinstance(e.value, DecodeError)


def test_an_image_in_memory_reads_like_a_local_one(tmp_path, memfs):
    fs, root = memfs
    picture = np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    Image.fromarray(picture).save(tmp_path / "p.png")
    fs.pipe(f"{root}/p.png", (tmp_path / "p.png").read_bytes())
    kw = dict(frame_interval=1)
    want, _ = load_sample(str(tmp_path / "p.png"), 1, 24, 24, rng=np.random.default_rng(0), **kw)
    got, fps = load_sample(f"{root}/p.png", 1, 24, 24, rng=np.random.default_rng(0), **kw)
    np.testing.assert_array_equal(got, want)
    assert fps == 120


RES = {"s32": [("1.00", (32, 32)), ("0.60", (24, 40)), ("1.67", (40, 24))]}
BUCKETS = {"s32": {1: (1.0, 2), 8: (1.0, 2)}}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate(str(out), num_videos=10, num_images=3, sizes=[(32, 32), (24, 40)], frames=[12], fps=8, seed=0,
             progress=False)
    return out


def _copy_to(fs, local_dir, root):
    for dirpath, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), local_dir)
            fs.pipe(f"{root}/{rel}", open(os.path.join(dirpath, name), "rb").read())


def test_a_table_in_memory_loads_the_batches_of_its_local_copy(dataset, memfs):
    """The table and its clips copied into memory://: relative paths resolve against the table's URL,
    the fingerprint (paths relative to the dataset's folder) is the local copy's, and the batches are
    the same."""
    fs, root = memfs
    _copy_to(fs, dataset, root)
    assert check_table(f"{root}/meta.csv") == len(read_table(str(dataset / "meta.csv")))
    df = read_table(f"{root}/meta.csv")
    assert all(p.startswith(f"{root}/") for p in df["path"]), df["path"][:3]
    kw = dict(seed=3, data_parallel_size=1, extra_resolutions=RES, progress=False)
    local = VideoLoader(str(dataset / "meta.csv"), BUCKETS, **kw)
    remote = VideoLoader(f"{root}/meta.csv", BUCKETS, **kw)
    assert remote.fingerprint == local.fingerprint
    for a, b in zip(_take(local, 3), _take(remote, 3)):
        np.testing.assert_array_equal(a["row"], b["row"])
        np.testing.assert_array_equal(a["video"], b["video"])
    folder = VideoLoader(root, BUCKETS, **kw)  # the folder of the table, as for local tables
    assert folder.fingerprint == local.fingerprint


def test_file_urls_are_local_tables_and_paths(dataset, tmp_path):
    shutil.copytree(dataset, tmp_path / "d")
    df = pd.read_csv(tmp_path / "d" / "meta.csv")
    df["path"] = ["file://" + str(tmp_path / "d" / p) for p in df["path"]]
    df.to_csv(tmp_path / "d" / "urls.csv", index=False)
    plain = read_table(str(tmp_path / "d" / "meta.csv"))
    urls = read_table("file://" + str(tmp_path / "d" / "urls.csv"))
    assert urls["path"].tolist() == plain["path"].tolist()  # file:// rows become the local paths
    index = TableIndex.build("file://" + str(tmp_path / "d" / "meta.csv"), progress=False)
    assert index.fingerprint == TableIndex.build(str(tmp_path / "d" / "meta.csv"), progress=False).fingerprint


def test_a_url_table_index_is_reused_until_the_table_changes(dataset, memfs, tmp_path):
    fs, root = memfs
    _copy_to(fs, dataset, root)
    first = TableIndex.build(f"{root}/meta.csv", str(tmp_path / "index"), progress=False)
    stamp = os.stat(tmp_path / "index" / "index.json").st_mtime_ns
    again = TableIndex.build(f"{root}/meta.csv", str(tmp_path / "index"), progress=False)
    assert os.stat(tmp_path / "index" / "index.json").st_mtime_ns == stamp and again.fingerprint == first.fingerprint
    df = pd.read_csv(f"{root}/meta.csv")
    df.loc[0, "text"] = "edited"
    df.to_csv(f"{root}/meta.csv", index=False)
    changed = TableIndex.build(f"{root}/meta.csv", str(tmp_path / "index"), progress=False)
    assert changed.fingerprint != first.fingerprint and changed.text(0) == "edited"


def test_a_missing_remote_clip_is_skipped_as_missing(dataset, memfs, capsys):
    fs, root = memfs
    _copy_to(fs, dataset, root)
    df = pd.read_csv(f"{root}/meta.csv")
    loader = VideoLoader(f"{root}/meta.csv", BUCKETS, seed=3, data_parallel_size=1, extra_resolutions=RES,
                         progress=False)
    # the plan reads the table only: the victim is a clip the epoch does train on, whatever the set's draws
    planned = {r for p in loader.plan(0) for r in p.rows}
    victim = next(i for i in df.index[df.num_frames > 1] if i in planned)
    fs.rm(f"{root}/{df.path[victim]}")
    for batch in _take(loader, loader.steps_per_epoch(0)):
        assert victim not in batch["row"] and len(batch["row"]) == 2
    assert set(loader.skip_counts) == {"missing"}
    assert f"skipped row {victim} (missing): missing file: {root}/{df.path[victim]}" in capsys.readouterr().err


def test_a_parquet_table_in_memory(dataset, memfs):
    fs, root = memfs
    _copy_to(fs, dataset, root)
    pd.read_csv(str(dataset / "meta.csv")).to_parquet(f"{root}/meta.parquet")
    fs.rm(f"{root}/meta.csv")
    assert check_table(f"{root}/meta.parquet") == len(read_table(str(dataset / "meta.csv")))
    assert read_table(f"{root}/meta.parquet")["path"].tolist() == read_table(f"{root}/*.parquet")["path"].tolist()


def _take(loader, n):
    it = iter(loader)
    try:
        return [next(it) for _ in range(n)]
    finally:
        it.close()
