"""One CLI style: every command's `--help` lists its flags with defaults; meta and shard
refuse an existing output without --overwrite (one line, exit code 2); shard reads a folder of shards
and keeps the old spelling `--out-dir`."""
import concurrent.futures as cf
import os
import subprocess

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from data_tools import meta, shard
from jaxsora.data.tables import read_table
from tests.zygote import PYTHON

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}

CLI_MODULES = (
    "data_tools.meta", "data_tools.shard", "data_tools.synthetic", "data_tools.filter", "data_tools.dedup",
    "data_tools.merge", "data_tools.split", "data_tools.stats", "data_tools.precompute", "data_tools.check",
    "jaxsora.tools.lora", "jaxsora.tools.average", "jaxsora.sample", "jaxsora.serve", "jaxsora.ckpt",
    "jaxsora.runs", "jaxsora.cluster", "jaxsora.train", "jaxsora.tools.search_bs",
)
# Not here: jaxsora.convert (its top level has only subcommands, no flag with a default).


def _cli(*args, cwd=None):
    return subprocess.run([PYTHON, "-m", *map(str, args)], env=ENV, cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=120)


def _assert_one_line_refusal(r, needle):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-2000:]
    assert needle in lines[0] and "--overwrite" in lines[0], lines[0]


@pytest.fixture
def images(tmp_path):
    """A table of 7 small PNGs, paths relative to the table's folder, sizes not filled in."""
    d = tmp_path / "data"
    (d / "img").mkdir(parents=True)
    rows = []
    for i in range(7):
        Image.fromarray(np.full((8 + i, 12, 3), 40 * i, np.uint8)).save(d / "img" / f"{i}.png")
        rows.append(dict(path=f"img/{i}.png", text=f"picture {i}", num_frames=0, height=0, width=0))  # meta fills them
    pd.DataFrame(rows).to_csv(d / "meta.csv", index=False)
    return d


@pytest.mark.parametrize("module", CLI_MODULES)
def test_help_lists_defaults(module, help_texts):
    r = help_texts[module]
    assert r.returncode == 0, (module, r.stderr[-2000:])
    assert "default" in r.stdout, (module, r.stdout)
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def help_texts():
    """`python -m MOD --help` of every command, run side by side."""
    with cf.ThreadPoolExecutor(8) as ex:
        return dict(zip(CLI_MODULES, ex.map(lambda m: _cli(m, "--help"), CLI_MODULES)))


def test_config_commands_help_with_a_config_too():
    """`--config X --help` is help as well (absl's own --help exits 1), and names the flags."""
    r = _cli("jaxsora.train", "--config", "configs/demo.py", "--help")
    assert r.returncode == 0 and "--data-path" in r.stdout and "--config.KEY=VALUE" in r.stdout, r.stderr[-2000:]


# A wrong value for an argparse flag: one line naming the flag, exit code 2 — never the usage block.
BAD_ARGS = [
    ("data_tools.filter", ["--input", "t.csv", "--output", "o.csv", "--frames-min", "abc"], "--frames-min"),
    ("data_tools.filter", ["--input", "t.csv", "--output", "o.csv", "--size-max", "50XB"], "--size-max"),
    ("data_tools.check", ["--input", "t.csv", "--output", "o.csv", "--shard", "3/2"], "--shard"),
    ("data_tools.meta", ["--input", "t.csv", "--output", "o.csv", "--layout", "webvid"], "--layout"),
    ("data_tools.dedup", ["--input", "t.csv", "--output", "o.csv", "--by", "colour"], "--by"),
    ("data_tools.precompute", ["--shard-size", "abc"], "--shard-size"),
    ("data_tools.synthetic", ["--output", "d", "--frames", "x"], "--frames"),
    ("data_tools.judge", [], "DIR"),
    ("jaxsora.sample", ["--num-sample", "two"], "--num-sample"),
    ("jaxsora.ckpt", ["frobnicate"], "frobnicate"),
    ("jaxsora.convert", ["to-torch"], "required"),
    ("jaxsora.serve", ["--interval", "soon"], "--interval"),
    ("jaxsora.runs", ["--nonsense"], "--nonsense"),
]


@pytest.mark.parametrize("module,args,needle", BAD_ARGS, ids=[m for m, *_ in BAD_ARGS])
def test_a_bad_argument_is_one_line(module, args, needle, tmp_path):
    r = _cli(module, *args, cwd=tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (module, r.stderr[-2000:])
    assert "usage:" not in r.stderr and needle in lines[0] and "(see --help)" in lines[0], lines[0]
    assert not os.listdir(tmp_path)  # nothing written


def test_meta_refuses_an_existing_output(images, tmp_path):
    out = tmp_path / "out" / "meta.csv"
    out.parent.mkdir()
    out.write_text("keep me\n")
    args = ["data_tools.meta", "--input", images / "meta.csv", "--output", out, "--num-workers", "1", "--no-progress"]
    _assert_one_line_refusal(_cli(*args), str(out))
    assert out.read_text() == "keep me\n"
    out.unlink()
    sidecar = tmp_path / "out" / "meta.csv.unreadable.csv"
    sidecar.write_text("keep me\n")
    _assert_one_line_refusal(_cli(*args), "unreadable.csv")
    assert not out.exists() and sidecar.read_text() == "keep me\n"
    r = _cli(*args, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    got = read_table(str(out))  # relative paths rewritten for the output's folder
    assert [os.path.normpath(p) for p in got["path"]] == [str(images / "img" / f"{i}.png") for i in range(7)]
    assert got["height"].tolist() == [8 + i for i in range(7)] and (got["width"] == 12).all()
    assert pd.read_csv(sidecar).empty


def test_meta_reads_a_folder_of_shards(images, tmp_path):
    assert shard.main(["--input", str(images / "meta.csv"), "--num-shards", "3", "--output", str(tmp_path / "s"),
                       "--no-progress"]) == 0
    out = tmp_path / "m.parquet"
    assert meta.main(["--input", str(tmp_path / "s"), "--output", str(out), "--num-workers", "1", "--chunk-size",
                      "2", "--no-progress"]) == 0
    got = pd.read_parquet(out)
    assert got["path"].tolist() == [f"data/img/{i}.png" for i in range(7)]
    assert got["num_frames"].tolist() == [1] * 7 and got["resolution"].tolist() == [(8 + i) * 12 for i in range(7)]


def test_shard_refuses_existing_shards(images, tmp_path):
    out = tmp_path / "shards"
    args = ["data_tools.shard", "--input", images / "meta.csv", "--num-shards", "2", "--output", out, "--no-progress"]
    assert _cli(*args).returncode == 0
    before = (out / "meta_0001.csv").read_text()
    (out / "meta_0001.csv").write_text("keep me\n")
    _assert_one_line_refusal(_cli(*args), "meta_0000.csv")
    assert (out / "meta_0001.csv").read_text() == "keep me\n"
    r = _cli(*args, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "meta_0001.csv").read_text() == before


def test_shard_reads_a_folder_of_shards(images, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b" / "c"
    assert shard.main(["--input", str(images / "meta.csv"), "--num-shards", "3", "--out-dir", str(first),
                       "--no-progress"]) == 0
    assert sorted(os.listdir(first)) == [f"meta_{i:04d}.csv" for i in range(3)]
    assert [len(pd.read_csv(first / f)) for f in sorted(os.listdir(first))] == [3, 2, 2]  # contiguous, as array_split
    assert shard.main(["--input", str(first), "--num-shards", "2", "--output", str(second), "--chunk-size", "2",
                       "--no-progress"]) == 0
    assert sorted(os.listdir(second)) == ["a_0000.csv", "a_0001.csv"]
    whole, parts = read_table(str(images / "meta.csv")), read_table(str(second))
    assert parts["path"].tolist() == whole["path"].tolist() and parts["text"].tolist() == whole["text"].tolist()
    # more shards than rows: the last ones are empty tables with the header
    assert shard.main(["--input", str(second), "--num-shards", "9", "--output", str(tmp_path / "d"),
                       "--no-progress"]) == 0
    assert [len(pd.read_csv(tmp_path / "d" / f"c_{i:04d}.csv")) for i in range(9)] == [1] * 7 + [0, 0]


def test_shard_never_replaces_its_input(images, tmp_path):
    folder = tmp_path / "x"
    folder.mkdir()
    pd.read_csv(images / "meta.csv").to_csv(folder / "x_0000.csv", index=False)
    r = _cli("data_tools.shard", "--input", folder, "--num-shards", "1", "--output", folder, "--overwrite")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "would replace an input file" in lines[0], r.stderr
    assert os.listdir(folder) == ["x_0000.csv"]
