"""data_tools filter / dedup / merge / split / stats: streaming in small chunks gives what one chunk
gives, outputs load with jaxsora.data.tables and find the same files, stats agree with the bucket
assignment computed row by row, and user mistakes are one line with exit code 2."""
import collections
import json
import os
import subprocess

import numpy as np
import pandas as pd
import pytest

from data_tools import dedup, merge, split, stats
from data_tools import filter as filter_tool
from jaxsora.data.buckets import Buckets
from jaxsora.data.plan import epoch_plan
from jaxsora.data.tables import read_table
from tests.zygote import PYTHON

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["--no-progress"]


def make_table(root) -> str:
    """10 rows under root/data: v0..v9 (v9's file missing, v7 the same bytes as v3, row 8 the same
    file as row 2 spelled differently), scores as Open-Sora's datautil names them."""
    data = root / "data"
    (data / "vids").mkdir(parents=True)
    rows = []
    for i in range(10):
        name = f"vids/v{i}.mp4"
        if i == 8:
            name = "vids/../vids/v2.mp4"  # the same file as row 2
        elif i != 9:
            (data / name).write_bytes(b"clip-3" if i == 7 else f"clip-{i}".encode())
        rows.append(dict(path=name, text=" ".join(["word"] * (i + 1)) if i != 5 else "NA",
                         num_frames=[1, 17, 51, 102, 204, 16, 60, 51, 51, 80][i],
                         height=[240, 360, 240, 480, 720, 144, 256, 240, 240, 100][i],
                         width=[426, 640, 426, 854, 1280, 256, 256, 426, 426, 100][i],
                         fps=[np.nan, 24, 30, 25, 24, 24, 30, 30, 30, 24][i],
                         aes=4.0 + 0.3 * i, flow=[0.5, 1, 2, 3, 4, np.nan, 6, 7, 8, 9][i],
                         ocr=0.01 * i, match=0.2 + 0.01 * i))
    pd.DataFrame(rows).to_csv(data / "meta.csv", index=False)
    return str(data / "meta.csv")


def run_ok(tool, args, capsys=None):
    assert tool.main([*args, *QUIET]) == 0
    return capsys.readouterr().out if capsys else None


def rows_of(table) -> list:
    """(absolute path, caption, frames) per row, as the loader reads the table."""
    df = read_table(table)
    return list(zip(df["path"], df["text"], df["num_frames"]))


def test_filter_ranges_missing_and_chunks(tmp_path, capsys):
    table = make_table(tmp_path)
    args = ["--input", table, "--aes-min", "4.5", "--flow-max", "8", "--frames-min", "2", "--words-max", "8",
            "--remove-missing"]
    out = run_ok(filter_tool, [*args, "--output", str(tmp_path / "a" / "kept.csv"), "--chunk-size", "3"], capsys)
    run_ok(filter_tool, [*args, "--output", str(tmp_path / "b" / "kept.csv")])
    assert (tmp_path / "a" / "kept.csv").read_bytes() == (tmp_path / "b" / "kept.csv").read_bytes()
    # aes: rows 0, 1 (4.0, 4.3) out; flow: rows 5 (empty), 9 (9); frames: none left below 2; words: row 8
    # (9 words); missing: row 9, already out by flow
    assert "aesthetic score in [4.5, inf]" in out and "removed 2" in out
    kept = rows_of(str(tmp_path / "a" / "kept.csv"))
    base = str(tmp_path / "data" / "vids")
    assert [p for p, _, _ in kept] == [os.path.join(base, f"v{i}.mp4") for i in (2, 3, 4, 6, 7)]
    assert pd.read_csv(tmp_path / "a" / "kept.csv")["path"][0] == "../data/vids/v2.mp4"  # re-rooted, relative

    # --remove-missing alone drops exactly the row whose file does not exist; the caption "NA" stays text
    out = run_ok(filter_tool, ["--input", table, "--output", str(tmp_path / "c.parquet"), "--remove-missing",
                               "--chunk-size", "4"], capsys)
    assert "file missing" in out and "removed 1" in out
    kept = read_table(str(tmp_path / "c.parquet"))
    assert len(kept) == 9 and not kept["path"].str.endswith("v9.mp4").any()
    assert kept["text"][5] == "NA"
    assert pd.read_parquet(tmp_path / "c.parquet")["num_frames"].dtype == np.int64  # numbers, not CSV text

    # a parquet input read in chunks of 2 gives the rows a CSV input does
    run_ok(filter_tool, ["--input", str(tmp_path / "c.parquet"), "--output", str(tmp_path / "d.csv"),
                         "--range", "match=:0.245", "--chunk-size", "2"])
    assert [r[0] for r in rows_of(str(tmp_path / "d.csv"))] == kept["path"][:5].tolist()


def test_dedup_by_path_and_content(tmp_path, capsys):
    table = make_table(tmp_path)
    out = run_ok(dedup, ["--input", table, "--output", str(tmp_path / "p.csv"), "--chunk-size", "3"], capsys)
    assert "1 duplicates" in out
    assert len(read_table(str(tmp_path / "p.csv"))) == 9  # row 8 (vids/../vids/v2.mp4) was row 2's file

    out = run_ok(dedup, ["--input", table, "--output", str(tmp_path / "c3.csv"), "--by", "content",
                         "--chunk-size", "3"], capsys)
    run_ok(dedup, ["--input", table, "--output", str(tmp_path / "c.csv"), "--by", "content"])
    assert (tmp_path / "c3.csv").read_bytes() == (tmp_path / "c.csv").read_bytes()
    # v7 has v3's bytes under another name, row 8 is v2 again; v9 cannot be read and is kept
    assert "2 duplicates" in out and "1 rows kept as they are" in out
    names = [os.path.basename(p) for p, _, _ in rows_of(str(tmp_path / "c.csv"))]
    assert names == ["v0.mp4", "v1.mp4", "v2.mp4", "v3.mp4", "v4.mp4", "v5.mp4", "v6.mp4", "v9.mp4"]


def test_split_then_merge_round_trip(tmp_path, capsys):
    table = make_table(tmp_path)
    whole = sorted(rows_of(table))
    for k, how in enumerate((["--fractions", "train=0.7,val=0.3"], ["--num-shards", "3", "--format", "parquet"])):
        outs = []
        for chunk in ("3", "100"):
            folder = tmp_path / f"split{k}-{chunk}"
            run_ok(split, ["--input", table, "--output", str(folder), *how, "--seed", "1", "--chunk-size", chunk])
            outs.append({f: pd.read_parquet(folder / f) if f.endswith(".parquet") else (folder / f).read_text()
                         for f in sorted(os.listdir(folder))})
        assert outs[0].keys() == outs[1].keys() and len(outs[0]) == (2 if k == 0 else 3)
        for f, part in outs[0].items():  # row groups differ with the chunk size, the table does not
            assert part.equals(outs[1][f]) if k else part == outs[1][f]
        parts = [str(tmp_path / f"split{k}-3" / f) for f in outs[0]]
        run_ok(merge, ["--input", *parts, "--output", str(tmp_path / "m" / "merged.csv"), "--chunk-size", "2",
                       "--overwrite"])
        assert sorted(rows_of(str(tmp_path / "m" / "merged.csv"))) == whole
    assert sorted(os.listdir(tmp_path / "split0-3")) == ["train.csv", "val.csv"]
    assert sorted(rows_of(str(tmp_path / "split0-3"))) == whole  # the folder of parts is itself a table
    # the same file (rows 2 and 8) always lands in the same part
    for f in os.listdir(tmp_path / "split1-3"):
        paths = read_table(str(tmp_path / "split1-3" / f))["path"].tolist()
        assert paths.count(str(tmp_path / "data" / "vids" / "v2.mp4")) in (0, 2)


def test_merge_unions_columns_and_rewrites_paths(tmp_path, capsys):
    table = make_table(tmp_path)
    other = tmp_path / "elsewhere" / "deep"
    other.mkdir(parents=True)
    pd.DataFrame(dict(path=["../../data/vids/v1.mp4"], text=["x"], num_frames=[5], height=[8], width=[8],
                      extra=["e"])).to_parquet(other / "t.parquet")
    out = run_ok(merge, ["--input", table, str(other / "t.parquet"), "--output", str(tmp_path / "o" / "all.parquet")],
                 capsys)
    assert "11 rows, 11 columns" in out
    df = pd.read_parquet(tmp_path / "o" / "all.parquet")
    assert list(df.columns)[-1] == "extra" and df["extra"].isna().sum() == 10 and df["aes"].isna().sum() == 1
    rows = read_table(str(tmp_path / "o" / "all.parquet"))
    assert rows["path"].iloc[-1] == rows["path"].iloc[1] == str(tmp_path / "data" / "vids" / "v1.mp4")


def random_sizes(n, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.choice([1, 1, 16, 30, 60, 120, 250], n)
    h = rng.choice([100, 144, 240, 360, 480, 720, 1080], n)
    w = (h * rng.choice([0.5, 1.0, 1.78, 2.2], n)).astype(int)
    return t, h, w


BUCKETS = {"144p": {1: (0.6, 8), 16: (0.8, 4), 51: ((1.0, 0.5), 2)},
           "240p": {1: (0.5, 6), 16: (0.7, 3), 51: (0.5, 2)},
           "360p": {1: (0.3, 4), 102: (1.0, 1)}}


def direct_counts(t, h, w, bucket_config, seed, epoch, frame_interval=1):
    """Per-bucket counts from `Buckets.assign`, row by row (the scalar path, not the plan's)."""
    b = Buckets(bucket_config)
    counts = collections.Counter(b.assign(int(t[i]), int(h[i]), int(w[i]), b.row_seed(seed, epoch, i),
                                          frame_interval) for i in range(len(t)))
    return b, counts


def test_stats_counts_match_the_bucket_assignment(tmp_path, capsys):
    t, h, w = random_sizes(300)
    pd.DataFrame(dict(path=[f"v{i}.mp4" for i in range(300)], text="c", num_frames=t, height=h, width=w)).to_csv(
        tmp_path / "t.csv", index=False)
    (tmp_path / "b.json").write_text(json.dumps({r: {str(f): [list(p) if isinstance(p, tuple) else p, bs]
                                                     for f, (p, bs) in fr.items()} for r, fr in BUCKETS.items()}))
    outs = []
    for chunk in ("7", "1000"):
        out = run_ok(stats, ["--input", str(tmp_path / "t.csv"), "--bucket-config", str(tmp_path / "b.json"),
                             "--dp", "2", "--epoch", "3", "--seed", "5", "--chunk-size", chunk, "--output",
                             str(tmp_path / f"s{chunk}.json"), "--png", str(tmp_path / f"h{chunk}.png")], capsys)
        outs.append(json.loads((tmp_path / f"s{chunk}.json").read_text()))
    assert outs[0] == outs[1] and "steps per epoch" in out
    got = outs[0]
    b, counts = direct_counts(t, h, w, BUCKETS, seed=5, epoch=3)
    assert {(r["resolution"], r["frames"], r["aspect"]): r["rows"] for r in got["buckets"]} == \
        {k: v for k, v in counts.items() if k is not None}
    for r in got["buckets"]:
        assert r["global_batch"] == 2 * b.bucket_batch_size((r["resolution"], r["frames"], r["aspect"]))
        assert r["steps"] == r["rows"] // r["global_batch"]
    assert got["total"]["steps"] == len(epoch_plan((t, h, w), b, seed=5, epoch=3, dp=2))
    # fits no bucket: no draw of any epoch places the row (keep-all config, every row assigned or not)
    _, reach = direct_counts(t, h, w, {r: {f: (1.0, bs) for f, (p, bs) in fr.items()} for r, fr in BUCKETS.items()},
                             seed=5, epoch=3)
    assert got["total"]["fits_no_bucket"] == reach[None] > 0
    assert got["total"]["left_out_by_keep_prob"] == counts[None] - reach[None] > 0
    from PIL import Image

    assert Image.open(tmp_path / "h7.png").size[1] > 20 * len(got["buckets"])


def test_stats_with_a_training_config(tmp_path, capsys):
    from configs.base import STAGE1_BUCKETS

    t, h, w = random_sizes(200, seed=1)
    pd.DataFrame(dict(path="x.mp4", text="c", num_frames=t, height=h, width=w)).to_parquet(tmp_path / "t.parquet")
    run_ok(stats, ["--config", os.path.join(REPO, "configs", "stage1.py"), "--config.data.seed=7",
                   "--config.data.table=" + str(tmp_path / "t.parquet"), "--num-devices", "4", "--chunk-size", "64",
                   "--output", str(tmp_path / "s.csv")])
    got = pd.read_csv(tmp_path / "s.csv", dtype={"aspect": str})
    b, counts = direct_counts(t, h, w, STAGE1_BUCKETS, seed=7, epoch=0)
    assert dict(zip(zip(got.resolution, got.frames, got.aspect), got.rows)) == \
        {k: v for k, v in counts.items() if k is not None}
    assert (got.global_batch == 4 * got.batch).all()  # stage 1's mesh: fsdp over every device


def test_refuses_to_overwrite(tmp_path, capsys):
    table = make_table(tmp_path)
    (tmp_path / "out.csv").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        dedup.main(["--input", table, "--output", str(tmp_path / "out.csv"), *QUIET])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "out.csv").read_text() == "keep me"
    run_ok(dedup, ["--input", table, "--output", table, "--overwrite"])  # in place: written aside, then renamed
    assert len(read_table(table)) == 9 and sorted(os.listdir(tmp_path / "data")) == ["meta.csv", "vids"]


def cli_error(tmp_path, *args) -> str:
    """Run `python -m data_tools.<args>` as the user would: exit code 2, one line, no traceback."""
    r = subprocess.run([PYTHON, "-m", *args, "--output", str(tmp_path / "o.csv")], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o.csv").exists()
    return lines[0]


def test_missing_column_is_one_line(tmp_path):
    table = make_table(tmp_path)
    pd.read_csv(table).rename(columns={"ocr": "ocr_score"}).to_csv(table, index=False)
    line = cli_error(tmp_path, "data_tools.filter", "--input", table, "--aes-min", "5", "--ocr-max", "0.1")
    assert "no column 'ocr'" in line and "ocr_score" in line  # names the columns the table has


def test_missing_input_is_one_line(tmp_path):
    line = cli_error(tmp_path, "data_tools.dedup", "--by", "content", "--input", str(tmp_path / "missing.csv"))
    assert "no such table" in line and "missing.csv" in line
