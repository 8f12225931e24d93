"""bench/gpu_vs_opensora.sh, the one device call that times jaxsora's train step against Open-Sora's own on a GPU:
its summary's pairing of the two sides (pure), and the script end to end on the CPU at the tiny shape, both
sides real — jaxsora's step with remat "auto" and with full remat, and Open-Sora's step as scripts/train.py
sets it up (gradient checkpointing, AdamW on the trained weights, EMA, clipping; on the CPU in fp32, eval mode),
each process in its turn. The end-to-end test needs the reference harness environment
(../shared/refharness/README.md: /tmp/refenv, /tmp/opensora-ref) and is skipped where it is absent."""
import os
import pathlib
import subprocess

import pytest

from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

ROOT = pathlib.Path(__file__).resolve().parents[2]
REFPY = pathlib.Path(os.environ.get("JAXSORA_REFENV", "/tmp/refenv")) / "bin" / "python"
REFDIR = pathlib.Path(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
HARNESS = pathlib.Path(os.environ.get("REFHARNESS", ROOT.parent / "shared" / "refharness"))


def _summary():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "bench" / "gpu_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _item(variant, impl, batch, step_s, latent=(15, 30, 53)):
    return dict(variant=variant, shape=dict(latent=list(latent)), row=dict(impl=impl, batch=batch, step_s=step_s))


def test_summary_pairs_each_jaxsora_row_with_open_sora_at_its_batch():
    q = _summary().ratios([
        _item("jax-b4", "jaxsora (JAX)", 4, 0.5), _item("os-b4", "Open-Sora PyTorch (bf16)", 4, 1.0),
        _item("jax-b20", "jaxsora (JAX)", 20, 3.0), _item("jax-b4-480p", "jaxsora (JAX)", 4, 2.0, (15, 60, 106)),
        _item("jax-max", "jaxsora (JAX)", 32, 4.0), _item("os-max", "Open-Sora PyTorch (bf16)", 16, 4.0)])
    assert q["jax-b4"] == (0.5, "step, vs os-b4")
    assert "jax-b20" not in q and "jax-b4-480p" not in q  # no Open-Sora row at that batch, or that shape
    assert q["jax-max"] == (0.5, "per sample, vs os-max")  # 4 s for 32 samples against 4 s for 16


@pytest.mark.slow(seconds=150)
@pytest.mark.skipif(not (REFPY.exists() and (REFDIR / "opensora").is_dir() and HARNESS.is_dir()),
                    reason="reference harness env not set up (see ../shared/refharness/README.md)")
def test_the_script_runs_both_sides_end_to_end_on_cpu(tmp_path):
    ref = f"--reference {REFPY} --reference-mode train"
    variants = "\n".join(["jax-b2||--batch 2 --remat auto", f"os-b2||--batch 2 {ref} --reference-only",
                          "jax-b2-full||--batch 2 --remat full"])
    env = {**os.environ, "OUT": str(tmp_path), "SHAPE": "--model tiny --latent 4x16x16", "STEPS": "4",
           "PY": PYTHON, "REFPY": str(REFPY), "VARIANTS": variants, "WHEELS": "none", "REFHARNESS": str(HARNESS),
           "OPENSORA_REF_DIR": str(REFDIR), "PYTHONPATH": str(ROOT), "XLA_FLAGS": cpu_flags(1)}  # one device
    r = subprocess.run(["bash", "bench/gpu_vs_opensora.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in
             ("jax-b2", "os-b2", "jax-b2-full")}
    assert set(lines) == {"jax-b2", "os-b2", "jax-b2-full"}, out[-3000:]
    # jaxsora with remat auto on a device without a memory limit: no remat; each jaxsora row against Open-Sora's
    assert lines["jax-b2"].split()[4] == "none" and "(step, vs os-b2)" in lines["jax-b2"]
    assert lines["jax-b2-full"].split()[4] == "full" and "(step, vs os-b2)" in lines["jax-b2-full"]
    assert lines["os-b2"].split()[1:5] == ["Open-Sora", "4×16×16", "2", "grad"]
    assert "grad ckpt" in out and "no apex fused LayerNorm" in out  # what the reference ran, beside the figure
    assert (tmp_path / "summary.txt").read_text().strip() in out
    for v in ("jax-b2", "os-b2", "jax-b2-full"):
        assert (tmp_path / f"{v}.json").exists() and (tmp_path / f"{v}.txt").exists()
