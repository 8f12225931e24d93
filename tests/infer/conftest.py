"""Shared checkpoints for the sampling tests (built once per session):

* `converted`: the real tiny STDiT3 fixture converted by `python -m jaxsora.convert from-torch`
  (no run config: 4 latent channels, 32-d captions of 8 tokens);
* `tiny_vae`: weights of the tiny OpenSora VAE architecture (random), for the converted model;
* `run`: a 2-step training run of the loop tests' small config (pixel-space IdentityVAE with 2×
  spatial pooling, tiny text encoder, 32×32 8-frame `sample` section).
"""
import json
import os

import numpy as np
import pytest

from tests.conftest import FIXTURES

REF_SD = str(FIXTURES / "stdit3_tiny_ref.safetensors")


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    from jaxsora.convert.__main__ import main as convert

    out = tmp_path_factory.mktemp("converted") / "ck"
    assert convert(["from-torch", REF_SD, str(out), "--model", "tiny"]) == 0
    return str(out)


@pytest.fixture(scope="session")
def tiny_vae(tmp_path_factory):
    from safetensors.numpy import save_file

    from jaxsora.models import vae as vae_lib

    path = tmp_path_factory.mktemp("vae") / "vae_tiny.safetensors"
    sd = vae_lib.to_state_dict(vae_lib.OpenSoraVAE.from_config("tiny", seed=0))
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(path))
    return json.dumps({"kind": "opensora", "path": str(path), "config": "tiny", "dtype": "float32"})


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    from jaxsora.train.run.loop import RunOptions, train
    from tests.train.common import CUT_LENGTHS, small_config
    from tests.train.fake_loader import FakeLoader

    out = tmp_path_factory.mktemp("outputs")
    os.environ.setdefault("WANDB_MODE", "disabled")
    # its data.text_lengths: the sampler cuts prompts as training cut batches (tests/infer/test_pipeline.py)
    cfg = small_config(out, max_steps=2, ckpt_every=2, mesh=(1, 1, 1), experiment="run", text_lengths=CUT_LENGTHS)
    res = train(cfg, RunOptions(), loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp,
                                                                              per_device_batch=2, text_inputs=t))
    return res["outputs"]


@pytest.fixture(scope="session")
def pipe(run):
    from jaxsora.infer import Pipeline
    from jaxsora.infer.pipeline import default_mesh

    return Pipeline.load(run, mesh=default_mesh(1))
