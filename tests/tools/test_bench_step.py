"""bench/step.py: its profile reading (a GPU trace's kernels named by their HLO instructions) and its A/B switch.

Kernel names are those of an H200 trace (jax 0.11.2, the XL/2 step run as a CUDA graph, no `hlo_op` stat):
XLA's own kernels carry the instruction's name with '.' written '_'; cuBLAS and cuDNN kernels carry none."""
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_step", ROOT / "bench" / "step.py")
bench_step = importlib.util.module_from_spec(spec)
sys.modules["bench_step"] = bench_step  # its dataclasses look their module up
spec.loader.exec_module(bench_step)

HLO = """HloModule jit__traced

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: bf16[64,16]) -> bf16[64,16] {
  %p0 = bf16[64,16]{1,0} parameter(0)
  ROOT %add.2 = bf16[64,16]{1,0} add(%p0, %p0)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %gemm_fusion_dot.1972 = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, {dot_meta}
  ROOT %loop_add_fusion.59 = bf16[64,16]{1,0} fusion(%gemm_fusion_dot.1972), kind=kLoop, calls=%fused_add, {add_meta}
}
""".replace("{dot_meta}", 'metadata={op_name="jit(_traced)/transpose(jvp())/dot_general"}').replace(
    "{add_meta}", 'metadata={op_name="jit(_traced)/jvp()/add"}')


def test_gpu_kernels_are_named_by_their_instructions():
    hlo = bench_step._hlo_instructions(HLO)
    assert hlo["gemm_fusion_dot.1972"][:2] == ("jit(_traced)/transpose(jvp())/dot_general", "matmul")
    assert hlo["loop_add_fusion.59"][:2] == ("jit(_traced)/jvp()/add", "other")
    name = bench_step.gpu_kernel_instruction
    assert name("loop_add_fusion_59", {}, hlo) == "loop_add_fusion.59"
    assert name("gemm_fusion_dot_1972", {}, hlo) == "gemm_fusion_dot.1972"
    assert name("some_kernel", {"hlo_op": "loop_add_fusion.59"}, hlo) == "loop_add_fusion.59"  # the stat first
    assert name("loop_add_fusion_60", {}, hlo) is None


def test_library_kernels_by_their_names():
    kind = bench_step.library_kernel_kind
    assert kind("nvjet_sm90_tst_192x160_64x4_1x2_h_bz_coopB_NNT") == "matmul"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1") == "attention"
    assert kind("void cudnn::fusion::compute_dot_do_o<true>(void const*, void const*)") == "attention"
    assert kind("jax::cuda::(anonymous namespace)::ThreeFry2x32Kernel(unsigned int const*)") == "other"


def test_dense_backward_switch_changes_the_traced_program_and_restores_it():
    """`--dense-backward autodiff` (an A/B of the weight-gradient form on GPU) must reach every Linear layer while
    it is on, and leave layers.dense_matmul's own backward in place after."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxsora.models import layers, lora

    def program():  # a new function each time: jax caches a trace by the function traced
        m = layers.dense(4, 8, ("embed", "mlp"), rngs=nnx.Rngs(0), dtype=jnp.float32)
        return str(jax.make_jaxpr(lambda x: m(x).sum())(jnp.ones((2, 4))))

    assert "custom_vjp" in program()
    with bench_step.dense_backward("autodiff"):
        assert "custom_vjp" not in program()
        assert lora.dense_matmul is layers.dense_matmul
    assert "custom_vjp" in program()
    assert lora.dense_matmul is layers.dense_matmul


# A stand-in for the Open-Sora step's process, speaking ReferenceSession's protocol: READY once built, a line "n"
# → one untimed step then n timed ones ("TIMES [...]"), "end" → its row ("REF {...}"). It records what it was asked.
FAKE_REFERENCE = r'''
import json, sys
a = json.loads(sys.argv[1])
if a["batch"] == 3:  # the failing case
    sys.exit("RuntimeError: the reference could not build the model")
print("READY", flush=True)
asked = []
for line in sys.stdin:
    if line.strip() == "end":
        break
    asked.append(int(line))
    print("TIMES " + json.dumps([0.5 + 0.1 * len(asked)] * int(line)), flush=True)
print("REF " + json.dumps(dict(step_s=0.0, threads=2, asked=asked)), flush=True)
'''


def _session(monkeypatch, batch):
    import argparse

    monkeypatch.setattr(bench_step, "REF_SCRIPT", FAKE_REFERENCE)
    shape = bench_step.Shape("t", "tiny", (4, 16, 16), batch)
    return bench_step.ReferenceSession(shape, argparse.Namespace(reference=sys.executable, profile=False))


def test_reference_session_runs_its_steps_when_asked_and_reports_their_median(monkeypatch):
    ref = _session(monkeypatch, 2)
    assert ref.steps(3) == [0.6] * 3
    assert ref.steps(1) == [0.7]
    row = ref.finish()
    assert row["step_s"] == 0.6  # the median of the times it answered, not what its process says
    assert row["impl"] == "Open-Sora PyTorch (fp32, 2 thr)" and ref.proc.returncode == 0


def test_reference_session_that_fails_raises_with_its_stderr(monkeypatch):
    import pytest

    with pytest.raises(RuntimeError, match="could not build the model"):
        _session(monkeypatch, 3)


def test_reference_session_closed_midway_ends_its_process_and_files(monkeypatch):
    """What bench/step.py does when jaxsora's side fails between two blocks: no Open-Sora process is left
    waiting on its stdin, no script file left behind; closing twice is harmless."""
    ref = _session(monkeypatch, 2)
    ref.steps(2)
    ref.close()
    assert ref.proc.returncode is not None and not os.path.exists(ref.script)
    ref.close()
