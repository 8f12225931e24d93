"""data_tools.check, meta's dataset layouts and filter's sizes, on real clips made here with PyAV: every
bad clip is dropped with its reason and every good one kept (truncated, corrupt, shorter than its row,
missing, empty, a read that stalls, a worker that dies); the parts of a sharded check, run on two hosts by
`jaxsora.cluster launch` and merged, are the table one run writes; an interrupted check goes on without
redoing a finished clip and leaves no worker behind."""
import os
import pathlib
import signal
import subprocess
import time
import uuid

import numpy as np
import pandas as pd
import pytest

from data_tools import check, merge, meta, stream
from data_tools import filter as filter_tool
from data_tools.workers import Crashed, Stalled, Workers
from tests.cluster.conftest import cluster, wait_for  # noqa: F401, F811  (cluster: the fake cluster fixture)
from tests.data_tools.clips import corrupt, encode, truncate
from tests.zygote import PYTHON

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["--no-progress"]


GOOD = [("g0.mp4", 24, 48, 64), ("g1.mp4", 40, 32, 48), ("g2.mp4", 12, 64, 96), ("g3.mp4", 30, 48, 64),
        ("g4.mp4", 20, 40, 40), ("g5.mp4", 36, 32, 32)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    for i, (name, n, h, w) in enumerate(GOOD):
        encode(d / name, n, h, w, seed=i)
    truncate(encode(d / "truncated.mp4", 32, seed=10))
    corrupt(encode(d / "corrupt.mp4", 32, seed=11))
    encode(d / "short.mp4", 12, seed=12)  # its row says 24
    open(d / "empty.mp4", "wb").close()
    return d


def table(folder, rows) -> str:
    pd.DataFrame([dict(path=p, text=f"clip {p}", num_frames=n, height=h, width=w) for p, n, h, w in rows]).to_csv(
        folder / "t.csv", index=False)
    return str(folder / "t.csv")


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment holds `mark` (a run's workers inherit it)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def test_every_bad_clip_is_dropped_with_its_reason_every_good_one_kept(clips, tmp_path, capsys):
    os.mkfifo(tmp_path / "hung.mp4")  # no writer: open() blocks, as a read on a hung network mount does
    good = [(str(clips / name), n, h, w) for name, n, h, w in GOOD]
    bad = {str(clips / "truncated.mp4"): "truncated at frame ",
           str(clips / "corrupt.mp4"): "decoder error at frame ",
           str(clips / "short.mp4"): "fewer frames than the table says: 12 of 24",
           str(clips / "gone.mp4"): "missing file",
           str(clips / "empty.mp4"): "unreadable: zero-length file",
           f"local://{tmp_path}/hung.mp4": "stalled: no result within 2 s"}
    rows = good[:3] + [(p, 24 if "short" in p else 32, 48, 64) for p in bad] + good[3:]
    t = table(tmp_path, rows)
    out = tmp_path / "ok.csv"
    t0 = time.monotonic()
    assert check.main(["--input", t, "--output", str(out), "--num-workers", "2", "--time-limit", "2", *QUIET]) == 0
    assert time.monotonic() - t0 < 30
    kept = pd.read_csv(out)
    assert [os.path.normpath(os.path.join(tmp_path, p)) for p in kept["path"]] == [p for p, *_ in good]  # in order
    dropped = pd.read_csv(str(out) + ".dropped.csv")
    got = {p if "://" in p else os.path.normpath(os.path.join(tmp_path, p)): r
           for p, r in zip(dropped["path"], dropped["reason"])}
    assert set(got) == set(bad)
    for path, reason in bad.items():
        assert got[path].startswith(reason), (path, got[path])
    assert got[str(clips / "truncated.mp4")].endswith(" of 32")
    assert list(dropped.columns[:2]) == ["path", "reason"] and dropped["text"].str.startswith("clip ").all()
    summary = capsys.readouterr().out
    assert "6 clips kept" in summary and "6 dropped" in summary and "stalled" in summary
    assert not os.path.exists(check.progress_path(str(out)))


def test_workers_cut_off_a_stall_and_survive_a_crash():
    tasks = [(i, (w,), 1.0) for i, w in enumerate(["a", "crash", "b", "stall", "c"])]
    with Workers("tests.data_tools.worker_targets:crash_or_stall", 2) as workers:
        results = dict(workers.run(tasks))
    assert results[0] == "A" and results[2] == "B" and results[4] == "C"
    assert isinstance(results[1], Crashed) and "SIGSEGV" in str(results[1])
    assert isinstance(results[3], Stalled) and str(results[3]).startswith("stalled")


def test_parts_cover_the_table_once_balanced_by_decoding_work(tmp_path):
    rng = np.random.default_rng(0)
    n = 400
    frames = np.where(np.arange(n) < 280, rng.integers(50, 250, n), rng.integers(1500, 3600, n))  # short, then long
    pd.DataFrame(dict(path=[f"{i}.mp4" for i in range(n)], text="x", num_frames=frames, height=720,
                      width=1280)).to_csv(tmp_path / "t.csv", index=False)
    files = [str(tmp_path / "t.csv")]
    parts = [stream.shard_rows(files, (k, 24), chunk_rows=97, progress=False) for k in range(24)]
    assert parts[0][0] == 0 and parts[-1][1] == n and all(p[2] == n for p in parts)
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous: the parts in order are the table
    work = [frames[a:b].sum() for a, b, _ in parts]
    assert max(work) / min(work) < 1.3  # not 24 equal row counts: those would differ 10× in work
    assert parts[5] == stream.shard_rows(files, (5, 24), progress=False)  # the same on every host
    pd.DataFrame(dict(path=[f"{i}.mp4" for i in range(10)])).to_csv(tmp_path / "bare.csv", index=False)
    assert [stream.shard_rows([str(tmp_path / "bare.csv")], (k, 3), progress=False)[:2] for k in range(3)] == \
        [(0, 4), (4, 7), (7, 10)]  # no sizes: by rows, as data_tools.shard


def test_two_hosts_check_a_part_each_and_the_parts_merge_into_the_one_run_table(clips, cluster, capsys):  # noqa: F811
    """The docs' commands: `jaxsora.cluster launch` runs `check --shard auto` on two hosts (a fake ssh runs
    them here); `merge` of the parts equals the table (and the dropped list) of one run."""
    work = cluster.workdir
    rows = [(str(clips / name), n, h, w) for name, n, h, w in GOOD]
    rows.insert(2, (str(clips / "corrupt.mp4"), 32, 48, 64))
    rows.insert(5, (str(clips / "short.mp4"), 24, 48, 64))
    t = table(pathlib.Path(work), rows)
    hosts = cluster.hosts("node-a", "node-b")
    command = [PYTHON, "-m", "data_tools.check", "--input", t, "--output", "checked/ok.csv", "--shard", "auto",
               "--num-workers", "1", "--no-progress"]
    assert cluster.cli(hosts, "launch", "--run", "outputs/check", "--", *command) == 0
    for host in ("node-a", "node-b"):
        exit_file = os.path.join(cluster.logdir, f"{host}.exit")
        wait_for(lambda: os.path.exists(exit_file) and open(exit_file).read().strip(), timeout=120,
                 what=f"{host}'s check")
        assert open(exit_file).read().strip() == "0", cluster.log(host)
    parts = sorted(os.listdir(os.path.join(work, "checked")))
    assert parts == ["ok_0000-of-0002.csv", "ok_0000-of-0002.csv.dropped.csv", "ok_0001-of-0002.csv",
                     "ok_0001-of-0002.csv.dropped.csv"]
    assert check.main(["--input", t, "--output", f"{work}/one/ok.csv", "--num-workers", "2", *QUIET]) == 0
    assert merge.main(["--input", f"{work}/checked/ok_*-of-0002.csv", "--output", f"{work}/one/merged.csv",
                       *QUIET]) == 0
    assert merge.main(["--input", f"{work}/checked/ok_*-of-0002.csv.dropped.csv", "--output",
                       f"{work}/one/merged_dropped.csv", *QUIET]) == 0
    assert open(f"{work}/one/merged.csv").read() == open(f"{work}/one/ok.csv").read()
    assert open(f"{work}/one/merged_dropped.csv").read() == open(f"{work}/one/ok.csv.dropped.csv").read()
    assert len(pd.read_csv(f"{work}/one/ok.csv")) == len(GOOD)
    assert "part 0/2" in cluster.log("node-a") and "part 1/2" in cluster.log("node-b")


def test_an_interrupted_check_goes_on_without_redoing_finished_clips(clips, tmp_path):
    """Stopped (SIGTERM: exit 75) and killed (SIGKILL) while a read hangs; the workers go with it. The
    finished clips' files are then deleted: the run that goes on keeps them as checked, so it did not
    read them again."""
    for name, *_ in GOOD:
        os.link(clips / name, tmp_path / name)
    os.mkfifo(tmp_path / "hung.mp4")
    rows = [(name, n, h, w) for name, n, h, w in GOOD[:3]] + [(f"local://{tmp_path}/hung.mp4", 24, 48, 64)] + \
           [(name, n, h, w) for name, n, h, w in GOOD[3:]]
    t = table(tmp_path, rows)
    mark = f"JAXSORA_TEST_{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", mark: "1"}
    args = [PYTHON, "-m", "data_tools.check", "--input", t, "--output", str(tmp_path / "ok.csv"), "--num-workers", "1",
            "--time-limit", "600", *QUIET]
    progress = check.progress_path(str(tmp_path / "ok.csv"))

    def checked():
        try:
            return open(progress).read().count("\n") - 1
        except FileNotFoundError:
            return 0

    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: checked() >= 3 and len(marked_processes(mark)) >= 2, timeout=60,
                 what="three clips checked and the fourth hanging")
        time.sleep(0.3)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        if sig == signal.SIGTERM:
            assert p.returncode == 75, err
            assert [ln for ln in err.splitlines() if ln.strip()] == [
                "data_tools.check: stopped with 3 of 7 clips checked; the same command goes on from there"]
        else:
            assert p.returncode == -signal.SIGKILL
        wait_for(lambda: not marked_processes(mark), timeout=10, what="the workers to end with their parent")
    os.remove(tmp_path / "hung.mp4")
    os.link(clips / "g0.mp4", tmp_path / "hung.mp4")  # the mount is back
    for name, *_ in GOOD[:3]:
        os.remove(tmp_path / name)  # checked already: a run that read them again would find them missing
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "3 checked before, going on" in r.stdout and "7 clips kept" in r.stdout, r.stdout
    assert pd.read_csv(tmp_path / "ok.csv")["path"].tolist()[:4] == ["g0.mp4", "g1.mp4", "g2.mp4",
                                                                    f"local://{tmp_path}/hung.mp4"]
    assert not os.path.exists(progress)


def test_a_progress_file_of_another_table_is_refused(clips, tmp_path):
    t = table(tmp_path, [(str(clips / "g0.mp4"), 24, 48, 64)])
    out = str(tmp_path / "ok.csv")
    open(check.progress_path(out), "w").write('{"tool": "data_tools.check", "shard": [0, 1]}\n0\t\n')
    r = subprocess.run([PYTHON, "-m", "data_tools.check", "--input", t, "--output", out], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "delete it to start over" in lines[0], r.stderr


def test_meta_reads_openvid_and_miradata_tables_as_downloaded(clips, tmp_path, capsys, monkeypatch):
    """OpenVid-1M.csv (clips unzipped into one folder, --root) and miradata_v1_330k.csv (file_path under the
    download script's clip folder): our columns from theirs, theirs kept, file_size measured, empty captions
    left out with a count."""
    (tmp_path / "video_folder").mkdir()
    (tmp_path / "miradata" / "000000000001").mkdir(parents=True)
    for name, *_ in GOOD[:3]:
        os.link(clips / name, tmp_path / "video_folder" / name)
        os.link(clips / name, tmp_path / "miradata" / "000000000001" / name)
    openvid = pd.DataFrame({"video": [g[0] for g in GOOD[:3]], "caption": ["a dog runs", "", "a cat sits"],
                            "aesthetic score": [5.5, 4.0, 6.1], "motion score": [1.5, 2.0, 0.4],
                            "temporal consistency score": 0.9, "camera motion": "static", "frame": 24, "fps": 24.0,
                            "seconds": 1.0})
    openvid.to_csv(tmp_path / "OpenVid-1M.csv", index=False)
    mira = pd.DataFrame({"clip_id": ["1.0", "1.1", "1.2"], "source": "youtube", "video_url": "https://x",
                         "video_id": "abc", "width": 1280, "height": 720, "fps": 30.0, "seconds": 72.0,
                         "timestamp": "['0:00:01.000', '0:01:13.000']", "frame_number": 2160,
                         "framestamp": "[30, 2190]",
                         "file_path": [f"000000000001/{g[0]}" for g in GOOD[:3]],
                         "short_caption": ["short one", "short two", "short three"],
                         "dense_caption": ["dense one", "dense two", "dense three"],
                         "background_caption": "b", "main_object_caption": "m", "style_caption": "s",
                         "camera_caption": "c"})
    mira.to_csv(tmp_path / "miradata_v1_330k.csv", index=False)
    monkeypatch.chdir(tmp_path)
    assert meta.main(["--input", "OpenVid-1M.csv", "--root", "video_folder", "--output", "out/openvid.csv",
                      "--num-workers", "1", *QUIET]) == 0
    got = pd.read_csv("out/openvid.csv")
    assert got["path"].tolist() == ["../video_folder/g0.mp4", "../video_folder/g2.mp4"]  # the empty caption left out
    assert got["text"].tolist() == ["a dog runs", "a cat sits"] and got["aes"].tolist() == [5.5, 6.1]
    assert got["flow"].tolist() == [1.5, 0.4] and (got["camera motion"] == "static").all()
    assert got["num_frames"].tolist() == [24, 12] and got["height"].tolist() == [48, 64]
    assert got["file_size"].tolist() == [os.path.getsize(clips / "g0.mp4"), os.path.getsize(clips / "g2.mp4")]
    assert "video" not in got and "caption" not in got
    out = capsys.readouterr().out
    assert "OpenVid-1M's layout" in out and "1 with an empty caption" in out
    assert pd.read_csv("out/openvid.csv.unreadable.csv")["reason"].tolist() == ["empty caption"]

    assert meta.main(["--input", "miradata_v1_330k.csv", "--root", "miradata", "--output", "mira.csv",
                      "--num-workers", "1", *QUIET]) == 0
    got = pd.read_csv("mira.csv")
    assert got["text"].tolist() == ["dense one", "dense two", "dense three"]  # dense_caption by default
    assert got["short_caption"].tolist() == ["short one", "short two", "short three"]  # the others kept
    assert got["width"].tolist() == [64, 48, 96] and (got["frame_number"] == 2160).all()  # measured; theirs kept
    assert got["path"].tolist() == [f"miradata/000000000001/{g[0]}" for g in GOOD[:3]]
    for k in range(2):  # on two hosts: the parts merged are the table
        assert meta.main(["--input", "miradata_v1_330k.csv", "--root", "miradata", "--output", "parts/mira.csv",
                          "--shard", f"{k}/2", "--num-workers", "1", *QUIET]) == 0
    assert merge.main(["--input", "parts/mira_*-of-0002.csv", "--output", "mira_merged.csv", *QUIET]) == 0
    assert open("mira_merged.csv").read() == open("mira.csv").read()
    assert meta.main(["--input", "miradata_v1_330k.csv", "--root", str(tmp_path / "miradata"), "--caption",
                      "short_caption", "--output", "mira_short.csv", "--num-workers", "1", *QUIET]) == 0
    got = pd.read_csv("mira_short.csv")
    assert got["text"].tolist() == ["short one", "short two", "short three"] and "dense_caption" in got
    assert got["path"].tolist() == [str(tmp_path / "miradata" / "000000000001" / g[0]) for g in GOOD[:3]]


def test_mistakes_are_one_line(clips, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, *_ in stream.SHARD_ENV + tuple((n, None, None) for _, n, _ in stream.SHARD_ENV):
        monkeypatch.delenv(name, raising=False)
    pd.DataFrame({"clip": ["a.mp4"], "words": ["x"]}).to_csv("odd.csv", index=False)
    table(tmp_path, [(str(clips / "g0.mp4"), 24, 48, 64)])
    pd.DataFrame({"video": ["a.mp4"], "caption": ["x"], "text": ["y"]}).to_csv("both.csv", index=False)
    cases = [
        (meta, ["--input", "odd.csv", "--output", "o.csv"], "unknown table layout: its columns are ['clip', 'words']"),
        (meta, ["--input", "both.csv", "--output", "o.csv"], "'caption' would become it"),
        (meta, ["--input", "t.csv", "--output", "o.csv", "--caption", "words"], "needs column 'words'"),
        (meta, ["--input", "t.csv", "--output", "o.csv", "--root", "nowhere"], "--root nowhere"),
        (check, ["--input", "none.csv", "--output", "o.csv"], "no such table: none.csv"),
        (check, ["--input", "odd.csv", "--output", "o.csv"], "no column 'path', 'num_frames'"),
        (check, ["--input", "t.csv", "--output", "o.csv", "--shard", "2/2"], "--shard"),
        (check, ["--input", "t.csv", "--output", "o.csv", "--shard", "x"], "expected K/N"),
        (check, ["--input", "t.csv", "--output", "o.csv", "--time-limit", "0"], "--time-limit"),
        (check, ["--input", "t.csv", "--output", "o.csv", "--shard", "auto"], "--shard auto: none of JAX_PROCESS_ID"),
        (filter_tool, ["--input", "t.csv", "--output", "o.csv", "--size-max", "50XB"], "'50XB' is not a size"),
        (filter_tool, ["--input", "t.csv", "--output", "o.csv", "--size-max", "50MB"], "no column 'file_size'"),
    ]
    for tool, args, needle in cases:
        with pytest.raises(SystemExit) as e:
            tool.main(args)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, (args, err)
        assert needle in lines[0] and lines[0].startswith(f"data_tools.{tool.PROG}: "), lines[0]
    assert not any(f.startswith("o.csv") for f in os.listdir(tmp_path))


def test_filter_reads_sizes_as_people_write_them(tmp_path, capsys):
    mb, mib = 10 ** 6, 2 ** 20
    sizes = [49 * mb, 50 * mb, 50 * mb + 1, 50 * mib, 50 * mib + 1, 1000]
    pd.DataFrame(dict(path=[f"{i}.mp4" for i in range(6)], text="x", file_size=sizes)).to_csv(tmp_path / "t.csv",
                                                                                             index=False)

    def kept(*flags):
        assert filter_tool.main(["--input", str(tmp_path / "t.csv"), "--output", str(tmp_path / "o.csv"),
                                 "--overwrite", *flags, *QUIET]) == 0
        return pd.read_csv(tmp_path / "o.csv")["file_size"].tolist()

    assert kept("--size-max", "50MB") == [49 * mb, 50 * mb, 1000]  # inclusive, 10⁶ bytes a MB
    assert kept("--size-max", "50MiB") == kept("--size-max", "50M") == [49 * mb, 50 * mb, 50 * mb + 1, 50 * mib, 1000]
    assert kept("--size-min", "2kB", "--size-max", "52428800") == [49 * mb, 50 * mb, 50 * mb + 1, 50 * mib]
    assert "file size in [2kB, 52.43MB (50MiB)]" in capsys.readouterr().out
    assert filter_tool.parse_size("1.5 GB") == 1.5e9 and filter_tool.parse_size("2gib") == 2 * 2 ** 30
