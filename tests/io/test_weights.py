"""jaxsora.io: the weights reader (safetensors through the library, .pth through torch, HF folders)
and fill_module."""
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxsora.errors import MissingFile, UserError, WeightsError
from jaxsora.io.fill import StateDictMismatch, fill_module
from jaxsora.io.weights import LazyTensor, ShardedStateDict, open_state_dict, read_state_dict
from tests.conftest import REPO

RNG = np.random.default_rng(0)


def _tensors():
    return {
        "w.bf16": RNG.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
        "w.f32": RNG.standard_normal((3, 2, 5)).astype(np.float32),
        "w.f16": RNG.standard_normal(7).astype(np.float16),
        "i64": np.arange(5, dtype=np.int64),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }


def test_safetensors_bf16_and_slices_equal_the_written_values(tmp_path):
    ref = _tensors()
    save_file(ref, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    sd = open_state_dict(str(tmp_path / "w.safetensors"))
    assert sorted(sd) == sorted(ref) and all(isinstance(v, LazyTensor) for v in sd.values())
    for k, want in ref.items():
        t = sd[k]
        assert t.shape == want.shape and t.dtype == want.dtype, k
        got = t[...]
        assert got.dtype == want.dtype, k
        np.testing.assert_array_equal(got.view(np.uint16) if k == "w.bf16" else got,
                                      want.view(np.uint16) if k == "w.bf16" else want, err_msg=k)
    bf = ref["w.bf16"]
    np.testing.assert_array_equal(sd["w.bf16"][1:3, 2:5].astype(np.float32), bf[1:3, 2:5].astype(np.float32))
    np.testing.assert_array_equal(sd["w.bf16"][::2].astype(np.float32), bf[::2].astype(np.float32))  # numpy fallback
    np.testing.assert_array_equal(sd["w.f32"][(slice(0, 2),)], ref["w.f32"][:2])
    full = read_state_dict(str(tmp_path / "w.safetensors"))  # bf16/fp16 upcast to float32, ints kept
    assert full["w.bf16"].dtype == np.float32 and full["w.f16"].dtype == np.float32 and full["i64"].dtype == np.int64
    np.testing.assert_array_equal(full["w.bf16"], bf.astype(np.float32))


def test_safetensors_read_needs_no_torch(tmp_path):
    save_file(_tensors(), str(tmp_path / "w.safetensors"))
    code = ("import sys; from jaxsora.io.weights import open_state_dict; "
            f"sd = open_state_dict({str(tmp_path / 'w.safetensors')!r}); sd['w.bf16'][...]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "short header"])
def test_corrupt_safetensors_is_one_line_weights_error(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    save_file(_tensors(), str(good))
    data = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes({"truncated": data[:-7], "garbage": data[:8] + b"x" * (len(data) - 8), "empty": b"",
                     "short header": data[:5]}[damage])
    with pytest.raises(WeightsError) as e:
        open_state_dict(str(bad))
    assert isinstance(e.value, UserError) and "\n" not in str(e.value) and str(bad) in str(e.value)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(MissingFile, match="not found"):
        open_state_dict(str(tmp_path / "nope.safetensors"))
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(WeightsError, match="unknown weights format"):
        open_state_dict(str(tmp_path / "w.txt"))
    with pytest.raises(MissingFile, match="model.safetensors"):
        open_state_dict(str(tmp_path))  # a folder without weights


def test_pth_read_unwraps_and_keeps_bf16(tmp_path):
    torch = pytest.importorskip("torch")
    a = torch.randn(3, 4).to(torch.bfloat16)
    b = torch.randn(5)
    torch.save({"state_dict": {"module.a": a, "module.b": b}, "step": 3}, tmp_path / "w.pth")
    sd = open_state_dict(str(tmp_path / "w.pth"))
    assert sorted(sd) == ["a", "b"]
    assert sd["a"].dtype == ml_dtypes.bfloat16 and sd["a"].shape == (3, 4)
    np.testing.assert_array_equal(sd["a"][...].astype(np.float32), a.float().numpy())
    np.testing.assert_array_equal(sd["a"][1:, :2].astype(np.float32), a.float().numpy()[1:, :2])
    np.testing.assert_array_equal(sd["b"][...], b.numpy())
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError) as e:
        open_state_dict(str(tmp_path / "bad.pth"))
    assert "\n" not in str(e.value)


def test_sharded_index_folder(tmp_path):
    ref = {f"layer.{i}.weight": RNG.standard_normal((2, 3)).astype(ml_dtypes.bfloat16) for i in range(4)}
    shards = {"model-00001-of-00002.safetensors": ["layer.0.weight", "layer.1.weight"],
              "model-00002-of-00002.safetensors": ["layer.2.weight", "layer.3.weight"]}
    for name, keys in shards.items():
        save_file({k: ref[k] for k in keys}, str(tmp_path / name))
    weight_map = {k: name for name, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "model.safetensors").write_bytes(b"ignored: the index comes first")
    sd = open_state_dict(str(tmp_path))
    assert isinstance(sd, ShardedStateDict) and sorted(sd) == sorted(ref) and "layer.9.weight" not in sd
    assert not sd._open  # nothing opened before a key is asked for
    np.testing.assert_array_equal(sd["layer.3.weight"][...].view(np.uint16), ref["layer.3.weight"].view(np.uint16))
    assert list(sd._open) == ["model-00002-of-00002.safetensors"]
    full = read_state_dict(str(tmp_path))
    for k, v in ref.items():
        np.testing.assert_array_equal(full[k], v.astype(np.float32))
    os.remove(tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(MissingFile, match="model-00001-of-00002.safetensors"):
        open_state_dict(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError, match="index.json"):
        open_state_dict(str(tmp_path))


def test_diffusers_folder_and_order(tmp_path):
    ref = {"x": np.ones(3, np.float32)}
    save_file(ref, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    np.testing.assert_array_equal(read_state_dict(str(tmp_path))["x"], ref["x"])
    save_file({"y": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    assert list(open_state_dict(str(tmp_path))) == ["y"]  # model.safetensors first


def _abstract():
    return nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)))


def test_fill_module_checks_keys_and_shapes(tmp_path):
    k, b = RNG.standard_normal((2, 3)).astype(np.float32), np.arange(2, dtype=np.float32)
    save_file({"kernel": k.astype(ml_dtypes.bfloat16), "bias": b}, str(tmp_path / "w.safetensors"))
    sd = open_state_dict(str(tmp_path / "w.safetensors"))
    model, rep = fill_module(_abstract(), sd, source="w", file_shape=lambda p, s: s[::-1],
                             to_model=lambda p, a: a.T if p[-1] == "kernel" else a)
    assert rep.mapped == ["bias", "kernel"] and not rep.missing and not rep.unexpected
    assert model.kernel[...].dtype == np.float32  # the variable's dtype
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), k.astype(ml_dtypes.bfloat16).astype(np.float32).T)
    with pytest.raises(WeightsError, match=r"w: tensor 'kernel' has shape \(2, 3\), the model expects \(3, 2\)"):
        fill_module(_abstract(), sd, source="w")
    with pytest.raises(StateDictMismatch, match=r"1 \['bias'\] missing keys; 1 \['extra'\] unexpected keys") as e:
        fill_module(_abstract(), {"kernel": np.zeros((3, 2)), "extra": np.zeros(1)})
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError) and isinstance(e.value, UserError)
    real = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    before = np.asarray(real.bias[...])
    _, rep = fill_module(real, {"kernel": np.ones((3, 2)), "extra": np.zeros(1)}, missing="keep", unexpected="ignore")
    assert rep.missing == ["bias"] and rep.unexpected == ["extra"]
    np.testing.assert_array_equal(np.asarray(real.kernel[...]), 1.0)
    np.testing.assert_array_equal(np.asarray(real.bias[...]), before)
