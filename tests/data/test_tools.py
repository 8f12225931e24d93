"""data_tools: meta recovers what the synthetic generator wrote; bad files go to the sidecar; shards
read back as the same table."""
import os
import shutil

import pandas as pd

from data_tools import meta, shard
from data_tools.synthetic import generate
from jaxsora.data.tables import fingerprint, read_table


def test_meta_equals_generator_and_lists_bad_files(tmp_path):
    generate(str(tmp_path), num_videos=4, num_images=2, sizes=[(32, 32), (24, 40)], frames=[12, 20], fps=8, seed=1,
             progress=False)
    truth = pd.read_csv(tmp_path / "meta.csv")
    bare = truth[["path", "text"]].copy()
    bare.loc[len(bare)] = ["videos/missing.mp4", "gone"]
    open(tmp_path / "videos" / "empty.mp4", "wb").close()
    bare.loc[len(bare)] = ["videos/empty.mp4", "empty"]
    bare.to_csv(tmp_path / "bare.csv", index=False)
    assert meta.main(["--input", str(tmp_path / "bare.csv"), "--output", str(tmp_path / "out.csv"),
                      "--num-workers", "2"]) == 0
    out = pd.read_csv(tmp_path / "out.csv")
    assert len(out) == len(truth)
    for col in ("num_frames", "height", "width", "resolution"):
        assert (out[col].to_numpy() == truth[col].to_numpy()).all(), col
    assert ((out.fps == truth.fps) | (out.fps.isna() & truth.fps.isna())).all()
    bad = pd.read_csv(str(tmp_path / "out.csv") + ".unreadable.csv")
    assert sorted(bad.path) == ["videos/empty.mp4", "videos/missing.mp4"]


def test_shards_read_back_as_one_table(tmp_path):
    generate(str(tmp_path / "d"), num_videos=5, num_images=2, sizes=[(32, 32)], frames=[12], fps=8, seed=2,
             progress=False)
    assert shard.main(["--input", str(tmp_path / "d" / "meta.csv"), "--num-shards", "3",
                       "--out-dir", str(tmp_path / "shards")]) == 0
    assert len(os.listdir(tmp_path / "shards")) == 3
    whole, parts = read_table(str(tmp_path / "d" / "meta.csv")), read_table(str(tmp_path / "shards"))
    assert whole["path"].tolist() == parts["path"].tolist()  # relative paths rewritten for the shards' folder
    assert fingerprint(str(tmp_path / "d" / "meta.csv")) == fingerprint(str(tmp_path / "shards"))
    assert fingerprint(str(tmp_path / "shards" / "meta_0001.csv")) != fingerprint(str(tmp_path / "shards"))
    shutil.rmtree(tmp_path / "shards")
