"""Training on the real loader (synthetic videos), with T5 in the step and decoding in the train
process, then from a text-state cache and decoding in a grain worker process: the first step's loss
is the same either way."""
import json
import os

import pytest

from data_tools.synthetic import generate
from jaxsora.data.cache import write_cache
from jaxsora.models.t5 import build_text_encoder
from jaxsora.train.run.loop import RunOptions, train
from tests.train.common import small_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    generate(str(out), num_videos=12, num_images=4, sizes=[(32, 32)], frames=[12], fps=8, seed=0, progress=False)
    return out


def _config(out, dataset, **data):
    c = small_config(out, max_steps=2, ckpt_every=100, mesh=(1, 1, 1))
    c.data.table = str(dataset / "meta.csv")
    c.data.resolutions = {"s32": [("1.00", (32, 32))]}
    c.data.bucket_config = {"s32": {1: (1.0, 2), 8: (1.0, 2)}}
    c.data.update(data)
    return c


def _loss(run_dir, step):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return next(json.loads(ln)["loss"] for ln in f if json.loads(ln)["step"] == step)


def test_train_on_videos_with_and_without_text_cache(dataset, tmp_path):
    cfg = _config(tmp_path / "t5", dataset)
    res = train(cfg, RunOptions(run_dir=str(tmp_path / "t5" / "run")))
    assert res["steps"] == 2
    encoder = build_text_encoder(cfg.text_encoder.to_dict())
    texts = list(__import__("pandas").read_csv(dataset / "meta.csv")["text"])
    write_cache(str(tmp_path / "cache"), texts, encoder, encoder_config=cfg.text_encoder.to_dict(), num_shards=2,
                batch_size=8, store_dtype="float32", table_path=str(dataset / "meta.csv"))
    cached = train(_config(tmp_path / "cached", dataset, text_cache=str(tmp_path / "cache"), num_workers=1),
                   RunOptions(run_dir=str(tmp_path / "cached" / "run")))
    assert cached["steps"] == 2
    assert _loss(tmp_path / "cached" / "run", 1) == pytest.approx(_loss(tmp_path / "t5" / "run", 1), rel=1e-5)
