"""State-dict names/shapes, parameter counts, round trips and the PixArt-Σ mapping."""
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import (
    from_torch_state_dict,
    load_model,
    read_state_dict,
    save_torch_state_dict,
    save_weights,
    to_torch_state_dict,
    torch_shapes,
)
from jaxsora.models.presets import get_model_config
from jaxsora.models.stdit3 import STDiT3, param_count
from tests.conftest import FIXTURES, REPO
from tests.zygote import PYTHON

SPEC_TSV = REPO.parent / "shared" / "reference" / "stdit3-xl2-state-dict.tsv"
REF_SD = str(FIXTURES / "stdit3_tiny_ref.safetensors")


def _reference_xl_keys():
    rows = []
    for line in SPEC_TSV.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 2 or not parts[1].strip().startswith("["):
            continue
        rows.append((parts[0].strip(), tuple(int(n) for n in parts[1].strip("[] ").split(",") if n.strip())))
    return rows


@pytest.fixture(scope="module")
def xl_abstract():
    cfg = get_model_config("STDiT3-XL/2")
    return nnx.eval_shape(lambda: STDiT3(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.skipif(not SPEC_TSV.exists(), reason="../shared/reference not beside the checkout")
def test_xl2_keys_and_shapes_equal_reference_list(xl_abstract):
    ref = _reference_xl_keys()
    assert len(ref) == 973
    assert torch_shapes(xl_abstract) == ref  # names, shapes and registration order


def test_xl2_parameter_count(xl_abstract):
    # STDiT3-XL/2: 1,207,643,972 parameters (incl. rope.freqs) + the 1,228,800-number y_embedding buffer.
    assert param_count(xl_abstract) == 1_207_643_972 + 1_228_800
    trainable = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(xl_abstract, nnx.Param)))
    assert trainable == 1_207_643_972 - 36  # rope.freqs is a (non-trainable) buffer here


@pytest.mark.parametrize("ext", [".safetensors", ".pth"])
def test_jax_torch_jax_round_trip_is_bit_exact(tmp_path, ext):
    model = from_torch_state_dict(read_state_dict(REF_SD), get_model_config("tiny"))
    sd = to_torch_state_dict(model)
    save_torch_state_dict(sd, str(tmp_path / f"w{ext}"))
    back = from_torch_state_dict(read_state_dict(str(tmp_path / f"w{ext}")), get_model_config("tiny"), seed=5)
    a = nnx.to_flat_state(nnx.state(model, nnx.Variable))
    b = dict(nnx.to_flat_state(nnx.state(back, nnx.Variable)))
    for path, var in a:
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(b[path][...]), err_msg=str(path))
    # and the reference file itself survives import → export unchanged
    ref = read_state_dict(REF_SD)
    assert list(sd) == list(ref) or sorted(sd) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(sd[k], ref[k], err_msg=k)


def test_bf16_export_through_torch(tmp_path):
    torch = pytest.importorskip("torch")
    model = STDiT3(get_model_config("tiny"), rngs=nnx.Rngs(0))
    sd = to_torch_state_dict(model, dtype=ml_dtypes.bfloat16)
    save_torch_state_dict(sd, str(tmp_path / "w.pth"))
    loaded = torch.load(tmp_path / "w.pth", weights_only=True)
    w = loaded["spatial_blocks.0.attn.qkv.weight"]
    assert w.dtype == torch.bfloat16
    np.testing.assert_array_equal(w.float().numpy(), sd["spatial_blocks.0.attn.qkv.weight"].astype(np.float32))


def test_wrapped_and_prefixed_state_dicts(tmp_path):
    ref = read_state_dict(REF_SD)
    for wrap in ({"ema": ref}, {"model": {f"module.{k}": v for k, v in ref.items()}}, {"state_dict": ref}):
        model, rep = from_torch_state_dict(wrap, get_model_config("tiny"), return_report=True)
        assert len(rep.mapped) == len(ref) and not rep.initialized and not rep.ignored


def test_shape_mismatch_names_the_key():
    ref = dict(read_state_dict(REF_SD))
    ref["spatial_blocks.1.mlp.fc1.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"spatial_blocks\.1\.mlp\.fc1\.weight"):
        from_torch_state_dict(ref, get_model_config("tiny"))


def test_rope_freqs_other_than_the_architectures_are_refused():
    """The temporal attention rotates by `rope_frequencies(head_dim)` (constants of the program), so a state dict
    whose `rope.freqs` holds other numbers would be silently ignored: it is refused, naming the key (rounded to
    bf16, as `to-torch --dtype bf16` writes them, they are the same numbers)."""
    ref = dict(read_state_dict(REF_SD))
    freqs = np.asarray(ref["rope.freqs"])
    ref["rope.freqs"] = freqs.astype(ml_dtypes.bfloat16)  # a bf16 export holds them rounded: accepted
    from_torch_state_dict(ref, get_model_config("tiny"))
    ref["rope.freqs"] = freqs * 2
    with pytest.raises(ValueError, match=r"rope\.freqs"):
        from_torch_state_dict(ref, get_model_config("tiny"))


def test_pixart_sigma_mapping():
    """A PixArt-Σ-style dict (blocks.*, 4-D patch conv, pos_embed, 2-row-short y_embedding) maps as
    the reference's load_checkpoint does; what it lacks keeps the reference init."""
    cfg = get_model_config("tiny")
    ref = read_state_dict(REF_SD)
    pix = {}
    for k, v in ref.items():
        if k.startswith("temporal_blocks.") or k.startswith("fps_embedder.") or k == "rope.freqs" or "_norm." in k:
            continue
        pix[k.replace("spatial_blocks.", "blocks.")] = v
    pix["x_embedder.proj.weight"] = ref["x_embedder.proj.weight"][:, :, 0]
    pix["pos_embed"] = np.zeros((1, 16, 64), np.float32)
    pix["y_embedder.y_embedding"] = ref["y_embedder.y_embedding"][:6]
    model, rep = from_torch_state_dict({"state_dict": pix}, cfg, return_report=True)
    assert rep.ignored == []
    assert all(k.startswith(("temporal_blocks.", "fps_embedder.", "rope.")) or "_norm." in k for k in rep.initialized)
    out = to_torch_state_dict(model)
    np.testing.assert_array_equal(out["spatial_blocks.1.attn.qkv.weight"], ref["spatial_blocks.1.attn.qkv.weight"])
    np.testing.assert_array_equal(out["x_embedder.proj.weight"], ref["x_embedder.proj.weight"])
    y = out["y_embedder.y_embedding"]
    np.testing.assert_array_equal(y[:6], ref["y_embedder.y_embedding"][:6])
    np.testing.assert_array_equal(y[6:], np.repeat(ref["y_embedder.y_embedding"][5:6], 2, 0))
    # fresh temporal blocks are identities, fps contributes 0, q/k norms are ones (the reference's initialization)
    assert not out["temporal_blocks.0.attn.proj.weight"].any() and not out["temporal_blocks.1.mlp.fc2.weight"].any()
    assert not out["fps_embedder.mlp.2.weight"].any()
    np.testing.assert_array_equal(out["spatial_blocks.0.attn.q_norm.weight"], 1.0)


def test_cli_from_torch_to_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ck = tmp_path / "ck"
    r = subprocess.run([PYTHON, "-m", "jaxsora.convert", "from-torch", REF_SD, str(ck), "--model", "tiny"],
                       capture_output=True, text=True, env=env, check=True)
    assert "mapped 89, initialized 0, ignored 0" in r.stdout
    from jaxsora.convert.__main__ import main as cli

    assert cli(["to-torch", str(ck), str(tmp_path / "back.safetensors")]) == 0
    subprocess.run([PYTHON, "-m", "jaxsora.convert", "to-torch", str(ck), str(tmp_path / "back.pth")],
                   capture_output=True, text=True, env=env, check=True)
    for out in ("back.safetensors", "back.pth"):
        back = read_state_dict(str(tmp_path / out))
        ref = read_state_dict(REF_SD)
        assert sorted(back) == sorted(ref)
        for k in ref:
            np.testing.assert_array_equal(back[k], ref[k], err_msg=k)
    with pytest.raises(FileNotFoundError, match="not found"):
        cli(["from-torch", str(tmp_path / "nope.pth"), str(ck)])


def test_native_save_load(tmp_path):
    model = STDiT3(get_model_config("tiny"), rngs=nnx.Rngs(1))
    save_weights(str(tmp_path / "ck"), model)
    back = load_model(str(tmp_path / "ck"))
    assert back.config == model.config
    flat = lambda m: nnx.to_flat_state(nnx.state(m, nnx.Variable))  # noqa: E731
    pairs = zip(flat(model), flat(back))
    for (p, a), (_, b) in pairs:
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
    with pytest.raises(FileNotFoundError, match="no jaxsora checkpoint"):
        load_model(str(tmp_path))
