"""`--target`: the plan for chips this machine does not have (jaxsora.parallel.targets). Every bad name is one line
and exit code 2 before any work; a target run that is not a dry run is refused; and the demo's dry run for 8 H100s,
compiled here by XLA:GPU, picks cuDNN attention for the GPU, plans into an H100's memory and prints its FLOPs and
roofline (the README's dry-run command with --target, as a user types it)."""
import os
import subprocess
import sys

import pytest

from jaxsora.errors import BadInput
from jaxsora.parallel import targets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_GPU_COMPILER = os.path.isdir(os.path.join(targets.compiler_dir("gpu"), "jax_plugins"))


def test_target_names():
    t = targets.parse("h100x8")
    assert (t.platform, t.num_devices, t.topology, t.chip.label) == ("gpu", 8, "1x1x8", "H100 SXM 80GB")
    assert targets.parse("H200X16").topology == "1x2x8"
    assert targets.parse("a100-80g").num_devices == 1
    v5p = targets.parse("tpu-v5p:2x2x2")
    assert (v5p.platform, v5p.num_devices, v5p.topology, v5p.memory_bytes) == ("tpu", 8, "v5p:2x2x2", 95 << 30)
    assert targets.parse("tpu-v5e:4x4").num_devices == 16


def test_gpu_memory_follows_jaxs_allocator_share(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    h100 = targets.parse("h100x8")
    assert h100.memory_bytes == int(84_978_434_048 * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert h100.memory_bytes == int(84_978_434_048 * 0.95)


@pytest.mark.parametrize("bad", ["h100x", "h100x0", "h100x12", "b200x8", "tpu-v5p", "tpu-v5p:2x", "tpu-v9:2x2",
                                 "cpu", ""])
def test_bad_target_names(bad):
    with pytest.raises(BadInput, match="--target"):
        targets.parse(bad)


def _run(*args, env=None):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [
    ["-m", "jaxsora.train", "--config", "configs/stage1.py", "--data-path", "pyproject.toml", "--dry-run",
     "--target", "h100y8"],
    ["-m", "jaxsora.train", "--config", "configs/stage1.py", "--data-path", "pyproject.toml", "--target", "h100x8"],
    ["-m", "jaxsora.tools.search_bs", "--config", "configs/stage1.py", "--target", "tpu-v5p:2"],
])
def test_a_bad_target_is_one_line_and_exit_2(command):
    done = _run(*command)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--target" in lines[0], done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="the GPU compiler is not installed: make plan-gpu")
def test_the_demo_dry_run_for_8_h100s(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import plan_targets

    table = tmp_path / "plan.csv"
    plan_targets.write_table(os.path.join(REPO, "configs/demo.py"), str(table))
    done = _run("-m", "jaxsora.train", "--config", "configs/demo.py", "--data-path", str(table), "--dry-run",
                "--target", "h100x8", "--config.model.depth=1", "--config.model.compute_dtype=bfloat16",
                f"--outputs={tmp_path / 'outputs'}", "--config.train.compile_threads=1")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "target h100x8: 8 × H100 SXM 80GB" in out and "59.36 GiB per device" in out, out[-3000:]
    assert "attention cudnn (auto, for gpu)" in out, out[-3000:]
    rows = plan_targets.parse_plan(out)
    assert rows and all(fits == "yes" for _, _, _, fits in rows.values()), out[-3000:]
    assert "roofline on H100 SXM 80GB" in out and "ESTIMATE" in out
    assert not [line for line in done.stderr.splitlines() if "cuda" in line.lower()], done.stderr[-2000:]
