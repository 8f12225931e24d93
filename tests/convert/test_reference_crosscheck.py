"""End-to-end against the real Open-Sora 1.2 STDiT3, on a config and shapes that are not in the
fixtures: our weights exported with `to-torch` load strict into the reference and reproduce our
output; the reference's own state dict imported with `from-torch` reproduces its output.

Needs the reference harness environment (/work/shared/refharness README: extract.sh +
setup_env.sh → /tmp/opensora-ref, /tmp/refenv); skipped where it is absent (CI).
"""
import json
import os
import pathlib
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsora.convert import from_torch_state_dict, read_state_dict, save_torch_state_dict, to_torch_state_dict
from jaxsora.models.stdit3 import STDiT3, STDiT3Config
from tests.conftest import rel_err

REFPY = pathlib.Path(os.environ.get("JAXSORA_REFENV", "/tmp/refenv")) / "bin" / "python"
REFDIR = pathlib.Path(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
pytestmark = pytest.mark.skipif(
    not (REFPY.exists() and (REFDIR / "opensora").is_dir()),
    reason="reference harness env not set up (see ../shared/refharness/README.md)",
)

CFG = dict(depth=3, hidden_size=96, num_heads=6, patch_size=[1, 2, 2], in_channels=3, pred_sigma=False,
           caption_channels=24, model_max_length=10, qk_norm=True, class_dropout_prob=0.1)


def _randomize(model, seed):
    """Perturb every weight (our init zeroes temporal outputs and the fps MLP's last layer)."""
    rng = np.random.default_rng(seed)
    for _path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = np.asarray(var[...])
        var[...] = jax.numpy.asarray(v + 0.05 * rng.standard_normal(v.shape).astype(np.float32))


def test_export_and_import_against_reference(tmp_path):
    ours = STDiT3(STDiT3Config(**CFG), rngs=nnx.Rngs(3))
    _randomize(ours, 0)
    rng = np.random.default_rng(1)
    b, t, h, w, L = 2, 5, 6, 10, CFG["model_max_length"]
    io = dict(
        x=rng.standard_normal((b, 3, t, h, w)).astype(np.float32),
        timestep=np.array([17.0, 930.0], np.float32),
        y=rng.standard_normal((b, 1, L, CFG["caption_channels"])).astype(np.float32),
        mask=(np.arange(L)[None] < np.array([[3], [10]])).astype(np.int64),
        x_mask=np.array([[True, False, True, True, False], [False, True, True, True, True]]),
        fps=np.array([30.0, 8.0], np.float32),
        height=np.array([480.0, 480.0], np.float32),
        width=np.array([854.0, 854.0], np.float32),
    )
    np.savez(tmp_path / "io.npz", **io)
    weights = tmp_path / "ours.pth"
    save_torch_state_dict(to_torch_state_dict(ours), str(weights))
    ref_sd = tmp_path / "ref.safetensors"
    subprocess.run([str(REFPY), str(pathlib.Path(__file__).parent / "ref_forward.py"), json.dumps(CFG),
                    str(weights), str(tmp_path / "io.npz"), str(tmp_path / "out.npz"), "--export", str(ref_sd)],
                   check=True, capture_output=True, env={**os.environ, "OPENSORA_REF_DIR": str(REFDIR)})
    ref = np.load(tmp_path / "out.npz")
    ours_out = ours(io["x"], io["timestep"], io["y"], io["mask"], io["x_mask"], io["fps"], io["height"], io["width"])
    assert rel_err(ours_out, ref["out"]) <= 1e-5

    imported, report = from_torch_state_dict(read_state_dict(str(ref_sd)), STDiT3Config(**CFG), return_report=True)
    assert not report.initialized and not report.ignored
    out2 = imported(io["x"], io["timestep"], io["y"], io["mask"], io["x_mask"], io["fps"], io["height"], io["width"])
    assert rel_err(out2, ref["out_exported"]) <= 1e-5
