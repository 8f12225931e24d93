"""`--ckpt-path` onto an 8-device FSDP mesh: every array arrives in its planned sharding with the
file's values, and no read of a sharded tensor is larger than one device's shard (the host never
holds a whole sharded tensor, let alone the model). From safetensors, .pth, PixArt-Σ-style files
and jaxsora checkpoints."""
import collections

import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import native, save_torch_state_dict, to_torch_state_dict
from jaxsora.convert.torch import torch_key
from jaxsora.io import weights as weights_io
from jaxsora.models.stdit3 import STDiT3
from jaxsora.train.run.setup import setup_run, weights_only_state
from jaxsora.train.step.state import model_variables
from tests.train.common import small_config


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory):
    """hidden 32 over fsdp 8: every `embed` dim is split 8 ways."""
    return setup_run(small_config(tmp_path_factory.mktemp("fsdp8"), mesh=(1, 8, 1)))


def _reference(setup, seed=7):
    model = STDiT3(setup.model_config, rngs=nnx.Rngs(seed))
    return model, {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Variable))}


def _check_state(setup, state, expected: dict):
    got = model_variables(state)
    want_sh = model_variables(setup.plan.shardings)
    assert set(got) == set(expected)
    for p, arr in got.items():
        assert arr.sharding == want_sh[p], p
        np.testing.assert_array_equal(np.asarray(arr), expected[p], err_msg=str(p))
    ema = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state.ema)}
    for p, arr in ema.items():
        np.testing.assert_array_equal(np.asarray(arr), expected[p])  # EMA starts at the loaded weights
    assert int(state.step) == 0


def _record_reads(monkeypatch):
    reads = collections.defaultdict(list)
    orig = weights_io.LazyTensor.__getitem__

    def spy(self, index):
        out = orig(self, index)
        reads[self.name].append(out.size)
        return out

    monkeypatch.setattr(weights_io.LazyTensor, "__getitem__", spy)
    return reads


@pytest.mark.parametrize("ext", [".safetensors", ".pth"])
def test_torch_file_loads_shard_by_shard(fsdp8, tmp_path, monkeypatch, ext):
    model, expected = _reference(fsdp8)
    path = str(tmp_path / f"w{ext}")
    save_torch_state_dict(to_torch_state_dict(model), path)
    reads = _record_reads(monkeypatch)
    _check_state(fsdp8, weights_only_state(fsdp8, path), expected)
    shard_elems = {torch_key(p): int(np.prod(s.shard_shape(expected[p].shape)))
                   for p, s in model_variables(fsdp8.plan.shardings).items()}
    sharded = [k for k, n in shard_elems.items() if n * 8 == np.prod(expected[_path(expected, k)].shape)]
    assert len(sharded) > 20, "the test model should have many FSDP-sharded tensors"
    for key in sharded:
        assert reads[key] and max(reads[key]) == shard_elems[key], (key, reads[key])


def _path(expected, key):
    return next(p for p in expected if torch_key(p) == key)


def test_pixart_style_file_keeps_init_for_what_it_lacks(fsdp8, tmp_path, capsys):
    model, expected = _reference(fsdp8)
    sd = to_torch_state_dict(model)
    pixart = {}
    for k, v in sd.items():
        if k.startswith("temporal_blocks.") or k in ("fps_embedder.mlp.0.weight",):
            continue  # PixArt has no temporal blocks (and this file no fps weight)
        k = k.replace("spatial_blocks.", "blocks.")
        pixart[k] = v[:, :, 0] if k == "x_embedder.proj.weight" else v  # a 2-D patch kernel
    pixart["y_embedder.y_embedding"] = sd["y_embedder.y_embedding"][:10]  # shorter: padded by its last row
    pixart["pos_embed"] = np.zeros((1, 4, 4), np.float32)  # dropped
    path = str(tmp_path / "pixart.safetensors")
    save_torch_state_dict(pixart, path)
    state = weights_only_state(fsdp8, path)
    out = capsys.readouterr().out
    assert "initialized" in out and "temporal_blocks.*" in out
    got = {p: np.asarray(a) for p, a in model_variables(state).items()}
    for p, arr in got.items():
        key = torch_key(p)
        if key.startswith("spatial_blocks.") or key == "x_embedder.proj.weight":
            np.testing.assert_array_equal(arr, expected[p])
    y = got[("y_embedder", "y_embedding")]
    np.testing.assert_array_equal(y[:10], expected[("y_embedder", "y_embedding")][:10])
    np.testing.assert_array_equal(y[10:], np.repeat(y[9:10], y.shape[0] - 10, 0))
    # what the file lacks keeps the reference initialization: temporal blocks start as the identity
    assert not got[("temporal_blocks", 0, "attn", "proj", "kernel")].any()


def test_jaxsora_checkpoint_restores_into_shards(fsdp8, tmp_path):
    model, expected = _reference(fsdp8, seed=3)
    native.save_weights(str(tmp_path / "ckpt"), model)  # written from one device
    _check_state(fsdp8, weights_only_state(fsdp8, str(tmp_path / "ckpt")), expected)


def test_shape_mismatch_names_the_key(fsdp8, tmp_path):
    model, _ = _reference(fsdp8)
    sd = to_torch_state_dict(model)
    sd["final_layer.linear.weight"] = sd["final_layer.linear.weight"][:-1]
    save_torch_state_dict(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="final_layer.linear.weight"):
        weights_only_state(fsdp8, str(tmp_path / "bad.safetensors"))
