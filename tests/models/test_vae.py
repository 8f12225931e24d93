"""The Open-Sora 1.2 video VAE in JAX against the PyTorch originals.

* spatial `AutoencoderKL` vs diffusers' own (installed in the venv), tiny config, random weights
  written with `save_pretrained` and read back by `load_spatial_vae`;
* temporal VAE and the full pipeline vs goldens of the real Open-Sora code
  (tests/fixtures/vae_tiny_io.npz, made by tests/fixtures/gen/vae_tiny.py; the weights are not
  stored but rebuilt here from the generator's deterministic `det_state_dict`);
* latent sizes / decode shapes for 1..102 frames, the state-dict key list of the real model,
  loader errors, IdentityVAE round trips.
"""
from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsora.models import vae as V
from jaxsora.models.vae_layers import TemporalVAE, gaussian_sample, gaussian_split
from tests.conftest import FIXTURES, rel_err

TOL = 1e-4
SHARED_TSV = "/work/shared/reference/opensora-vae-v1.2-temporal-keys.tsv"


def _gen():
    spec = importlib.util.spec_from_file_location("vae_tiny_gen", FIXTURES / "gen" / "vae_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()


@pytest.fixture(scope="module")
def io():
    return dict(np.load(FIXTURES / "vae_tiny_io.npz"))


def _det_model(abstract):
    """Fill an abstract model with the generator's deterministic weights (buffers kept)."""
    shapes = V.state_dict_shapes(abstract)
    sd = GEN.det_state_dict(shapes.items())
    for k in ("scale", "shift"):  # the pipeline buffers: the config's (= the reference factory's) values
        if k in shapes:
            sd[k] = np.asarray(getattr(abstract.config, k), np.float32).reshape(shapes[k])
    return V.load_state_dict(abstract, sd, "det weights")


@pytest.fixture(scope="module")
def tiny_pipeline():
    abstract = V.abstract_model(lambda: V.OpenSoraVAE.from_config("tiny"))
    return _det_model(abstract)


def _read_tsv(path):
    out = {}
    for line in open(path):
        if line.strip() and not line.startswith("#"):
            k, shp = line.rstrip("\n").split("\t")
            out[k] = tuple(int(v) for v in shp.strip("[]").split(",") if v.strip())
    return out


# ----------------------------------------------------------------------------------------------
# spatial VAE vs diffusers
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diffusers_folder(tmp_path_factory):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    cfg = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 32, 32, 32),
               layers_per_block=2, act_fn="silu", latent_channels=4, norm_num_groups=8, sample_size=32)
    torch.manual_seed(0)
    model = diffusers.AutoencoderKL(**cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # GroupNorm weights/biases and conv biases away from their 1/0 init
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("sdvae") / "vae"
    model.save_pretrained(folder)
    return folder, model


def test_spatial_vae_matches_diffusers(diffusers_folder):
    import torch

    folder, ref = diffusers_folder
    model = V.load_spatial_vae(folder)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (2, 3, 36, 28)).astype(np.float32)  # odd sizes: 36 -> 18 -> 9 -> 4 rows
    z = rng.standard_normal((2, 4, 3, 5)).astype(np.float32)
    with torch.no_grad():
        ref_mean = ref.encode(torch.from_numpy(x)).latent_dist.mean.numpy()
        ref_dec = ref.decode(torch.from_numpy(z)).sample.numpy()
    mean = nnx.jit(lambda m, x: m.encode_mean(x))(model, jnp.asarray(x))
    dec = nnx.jit(lambda m, z: m.decode(z))(model, jnp.asarray(z))
    assert mean.shape == ref_mean.shape == (2, 4, 4, 3)
    assert dec.shape == ref_dec.shape == (2, 3, 24, 40)
    assert rel_err(mean, ref_mean) < TOL
    assert rel_err(dec, ref_dec) < TOL


def test_spatial_loader_errors(diffusers_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = diffusers_folder
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "missing"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    key = "decoder.mid_block.attentions.0.to_q.weight"
    save_file({k: v for k, v in sd.items() if k != key}, str(bad / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(KeyError, match="to_q.weight"):
        V.load_spatial_vae(bad)
    save_file({**sd, key: sd[key][:, :3]}, str(bad / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ValueError, match="decoder.mid_block.attentions.0.to_q.weight"):
        V.load_spatial_vae(bad)
    save_file({**sd, "encoder.extra.weight": np.zeros(3, np.float32)}, str(bad / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(KeyError, match="encoder.extra.weight"):
        V.load_spatial_vae(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "down_block_types": ["AttnDownEncoderBlock2D"] * 4}))
    with pytest.raises(ValueError, match="DownEncoderBlock2D"):
        V.load_spatial_vae(bad)


# ----------------------------------------------------------------------------------------------
# temporal VAE vs the real VAE_Temporal
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag,frames", [("", 17), ("1", 1)])
def test_temporal_vae_matches_reference(io, tag, frames):
    abstract = V.abstract_model(lambda: TemporalVAE(V.TINY_TEMPORAL, rngs=nnx.Rngs(0)))
    model = _det_model(abstract)
    x = jnp.asarray(io[f"temporal_x{tag}"])
    mean, logvar = nnx.jit(lambda m, x: m.moments(x))(model, jnp.moveaxis(x, 1, -1))
    rec = nnx.jit(lambda m, z: m.decode(z, frames))(model, jnp.moveaxis(jnp.asarray(io[f"temporal_mean{tag}"]), 1, -1))
    assert mean.shape[1] == V.TINY_TEMPORAL.latent_frames(frames) == io[f"temporal_mean{tag}"].shape[2]
    assert rel_err(jnp.moveaxis(mean, -1, 1), io[f"temporal_mean{tag}"]) < TOL
    assert rel_err(jnp.moveaxis(logvar, -1, 1), io[f"temporal_logvar{tag}"]) < TOL
    assert rel_err(jnp.moveaxis(rec, -1, 1), io[f"temporal_rec{tag}"]) < TOL
    if frames == 1:  # bf16 compute (fp32 params), as Open-Sora runs the VAE: close, not exact
        bf16 = V.load_state_dict(
            V.abstract_model(lambda: TemporalVAE(V.TINY_TEMPORAL, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)),
            V.to_state_dict(model))
        mean16, _ = nnx.jit(lambda m, x: m.moments(x))(bf16, jnp.moveaxis(x, 1, -1))
        assert bf16.encoder.conv_in.conv.weight[...].dtype == jnp.float32 and mean16.dtype == jnp.float32
        assert rel_err(jnp.moveaxis(mean16, -1, 1), io[f"temporal_mean{tag}"]) < 3e-2


def test_temporal_keys_match_reference():
    """VAE_Temporal_SD names and shapes == the reference TSV; the whole OpenSoraVAE_V1_2 layout
    (SDXL spatial + temporal + buffers, 517 entries) == the real model's (fixture from real code)."""
    full = V.state_dict_shapes(V.abstract_model(lambda: V.OpenSoraVAE.from_config("OpenSoraVAE_V1_2")))
    ref_full = _read_tsv(FIXTURES / "opensora_vae_v1_2_keys.tsv")
    assert full == ref_full
    temporal = {k: s for k, s in full.items() if k.startswith("temporal_vae.")}
    assert len(temporal) == 267
    assert sum(int(np.prod(s)) for s in temporal.values()) == 309_687_144  # the reference's temporal VAE
    if os.path.isfile(SHARED_TSV):
        assert temporal == _read_tsv(SHARED_TSV)


# ----------------------------------------------------------------------------------------------
# the pipeline vs the real VideoAutoencoderPipeline
# ----------------------------------------------------------------------------------------------
def test_pipeline_matches_reference(io, tiny_pipeline):
    """B=2, 37 frames: two 17-frame chunks folded into the batch + a 3-frame remainder chunk,
    10 spatial micro-batches of 4 frames (the last one padded)."""
    frames = 37
    x, z_ref, rec_ref = (io[f"pipeline_{k}{frames}"] for k in ("x", "z", "rec"))
    z = nnx.jit(lambda m, x: m.encode_mean(x))(tiny_pipeline, jnp.asarray(x))
    rec = nnx.jit(lambda m, z: m.decode(z, frames))(tiny_pipeline, jnp.asarray(z_ref))
    assert z.shape == z_ref.shape and rec.shape == rec_ref.shape == x.shape
    assert rel_err(z, z_ref) < TOL
    assert rel_err(rec, rec_ref) < TOL
    np.testing.assert_allclose(io["pipeline_shift"], V.OPENSORA_V1_2_SHIFT, rtol=1e-6)
    np.testing.assert_allclose(io["pipeline_scale"], V.OPENSORA_V1_2_SCALE, rtol=1e-6)


def test_latent_sizes_and_decode_shapes(io, tiny_pipeline):
    for t, ref in zip(io["latent_size_T"], io["latent_size"]):
        assert tiny_pipeline.get_latent_size((int(t), 240, 426)) == tuple(int(v) for v in ref)
    assert [V.latent_frames(t) for t in (1, 17, 34, 51, 102)] == [1, 5, 10, 15, 30]
    g, s = nnx.split(tiny_pipeline)
    for t in (1, 17, 34, 51, 102):
        video = jax.ShapeDtypeStruct((1, 3, t, 16, 24), jnp.float32)
        z = jax.eval_shape(lambda s, v: nnx.merge(g, s).encode(v, jax.random.key(0)), s, video)
        assert z.shape == (1, 4) + tiny_pipeline.get_latent_size((t, 16, 24))
        out = jax.eval_shape(lambda s, z: nnx.merge(g, s).decode(z, t), s, z)
        assert out.shape == (1, 3, t, 16, 24) and out.dtype == jnp.float32
    # the real architecture (SDXL spatial + VAE_Temporal_SD), bf16 compute, 2s of 240p: 426 -> 53 -> 424 px
    full = V.abstract_model(lambda: V.OpenSoraVAE.from_config("OpenSoraVAE_V1_2", dtype="bfloat16"))
    g, s = nnx.split(full)
    z = jax.eval_shape(lambda s, v: nnx.merge(g, s).encode_mean(v), s,
                       jax.ShapeDtypeStruct((1, 3, 51, 240, 426), jnp.float32))
    out = jax.eval_shape(lambda s, z: nnx.merge(g, s).decode(z, 51), s, z)
    assert z.shape == (1, 4, 15, 30, 53) and out.shape == (1, 3, 51, 240, 424) and out.dtype == jnp.float32
    with pytest.raises(ValueError, match="latent frames"):
        tiny_pipeline.decode(jnp.zeros((1, 4, 5, 2, 3)), 20)


def test_sampling_and_logvar_clamp():
    mean = jnp.array([0.5, -1.0, 2.0])
    logvar = jnp.array([-50.0, 0.0, 30.0])
    moments = jnp.concatenate([mean, logvar])[None]
    m, lv = gaussian_split(moments)
    np.testing.assert_array_equal(lv[0], [-30.0, 0.0, 20.0])
    draws = jax.vmap(lambda k: gaussian_sample(m, lv, k))(jax.random.split(jax.random.key(0), 4000))[:, 0]
    np.testing.assert_allclose(draws[:, 0], 0.5, atol=1e-5)  # std exp(-15) ~ 3e-7
    assert abs(float(draws[:, 1].mean()) + 1.0) < 0.1 and abs(float(draws[:, 1].std()) - 1.0) < 0.05
    assert abs(float(draws[:, 2].std()) / float(np.exp(10.0)) - 1.0) < 0.05


def test_from_config_presets_and_loading(tmp_path, tiny_pipeline):
    """load_opensora_vae reads the reference layout from .safetensors / folder / .pth, exactly."""
    import torch
    from safetensors.numpy import save_file

    sd = V.to_state_dict(tiny_pipeline)
    sd["scale"] = sd["scale"] * 2  # loaded buffers win over the config values
    save_file(sd, str(tmp_path / "model.safetensors"))
    torch.save({"state_dict": {"module." + k: torch.from_numpy(v.copy()) for k, v in sd.items()}}, tmp_path / "vae.pth")
    for path in (tmp_path, tmp_path / "vae.pth"):  # a folder holding model.safetensors; torch
        loaded = V.load_opensora_vae(path, config="tiny")
        got = V.to_state_dict(loaded)
        assert got.keys() == sd.keys()
        assert all(np.array_equal(got[k], sd[k]) for k in sd), path
        assert loaded.config.scale == tuple(float(v) for v in sd["scale"].reshape(-1))
    bf16 = V.load_opensora_vae(tmp_path, dtype="bfloat16", config="tiny")
    assert bf16.dtype == jnp.bfloat16 and bf16.temporal_vae.decoder.conv_out.conv.weight[...].dtype == jnp.float32
    del sd["temporal_vae.decoder.conv_out.conv.bias"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="temporal_vae.decoder.conv_out.conv.bias"):
        V.load_opensora_vae(tmp_path / "model.safetensors", config="tiny")
    m = V.OpenSoraVAE.from_config("tiny")
    assert m.out_channels == 4 and m.get_latent_size((51, 240, 426)) == (15, 30, 53)
    assert V.get_vae_config("OpenSoraVAE_V1_2").spatial.block_out_channels == (128, 256, 512, 512)


# ----------------------------------------------------------------------------------------------
# IdentityVAE
# ----------------------------------------------------------------------------------------------
def test_identity_vae_round_trip():
    video = np.random.default_rng(0).uniform(-1, 1, (2, 3, 5, 8, 12)).astype(np.float32)
    ident = V.IdentityVAE()
    np.testing.assert_array_equal(ident.decode(ident.encode(video, None), 5), video)
    pooled = V.IdentityVAE(downsample=(1, 4, 4), scale=2.0)
    z = pooled.encode_mean(video)
    assert z.shape == (2, 3) + pooled.get_latent_size((5, 8, 12)) == (2, 3, 5, 2, 3)
    np.testing.assert_allclose(z[0, 0, 0, 0, 0], 2.0 * video[0, 0, 0, :4, :4].mean(), rtol=1e-6)
    rec = pooled.decode(z, 5)
    assert rec.shape == video.shape and pooled.out_channels == 3
    # nearest upsampling of the block means: re-encoding gives the same latent
    np.testing.assert_allclose(pooled.encode_mean(rec), z, rtol=1e-6)
