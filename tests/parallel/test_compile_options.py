"""With JAXSORA_CPU_MATMUL=onednn, XLA:CPU programs run their matmuls through oneDNN
(`jaxsora.parallel.compile_options`). The path changes only speed and rounding, so an equality test would pass if
it never ran: the compiled train step and sampler are read for oneDNN calls, and for Linear-layer matmuls left
anywhere else. Unset (the default), no options. JAXSORA_GPU_XLA names XLA:GPU variants: no GPU here, so their
options are checked by name and value against this jaxlib's XLA (its debug options are one set for every backend:
a CPU compile refuses a misspelt name or an invalid value)."""
import platform
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxsora.diffusion import rflow
from jaxsora.errors import BadInput
from jaxsora.parallel import compile_options
from jaxsora.train.run.setup import setup_run
from tests.train.common import small_config

X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_x86 = pytest.mark.skipif(not X86, reason="oneDNN matmuls are for x86-64 CPUs")


def _dots_by_library(hlo: str) -> dict:
    """{library fusion kind ("__onednn_fusion", "__ynn_fusion") or "xla": [dot instruction lines]} of a compiled
    HLO text: each dot is counted under the kind of the fusion whose computation holds it."""
    bodies, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = bodies.setdefault(head.group(1), [])
        elif cur is not None and line.startswith("  "):
            cur.append(line)
    kind_of = {}
    for body in bodies.values():
        for line in body:
            called, kind = re.search(r"calls=%?([\w.\-]+)", line), re.search(r'"kind":"(__\w+)"', line)
            if called:
                kind_of[called.group(1)] = kind.group(1) if kind else "xla"
    out: dict = {}
    for name, body in bodies.items():
        for line in body:
            if re.search(r" dot\(", line):
                out.setdefault(kind_of.get(name, "xla"), []).append(line)
    return out


def _assert_linear_matmuls_in_onednn(hlo: str):
    dots = _dots_by_library(hlo)
    assert dots.get("__onednn_fusion"), sorted(dots)
    # XLA may leave to YNNPACK a batched attention dot it fuses with the softmax's reductions; a Linear layer's
    # matmul (no batch dimensions) is never anywhere but oneDNN
    elsewhere = [line for kind, lines in dots.items() if kind != "__onednn_fusion" for line in lines
                 if "lhs_batch_dims" not in line]
    assert not elsewhere, elsewhere[:3]


def test_only_cpu_programs_opting_in_get_options(monkeypatch):
    monkeypatch.delenv(compile_options.ENV, raising=False)
    assert compile_options.for_platform("cpu") is None  # the default: XLA:CPU's own choice
    monkeypatch.setenv(compile_options.ENV, "onednn")
    assert compile_options.for_platform("gpu") is None
    assert compile_options.for_platform("tpu") is None
    monkeypatch.setenv(compile_options.ENV, "mkl")
    with pytest.raises(BadInput, match="JAXSORA_CPU_MATMUL must be 'xla' or 'onednn', got 'mkl'"):
        compile_options.for_platform("cpu")


@needs_x86
def test_train_step_matmuls_run_through_onednn(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_options.ENV, "onednn")
    setup = setup_run(small_config(tmp_path))
    assert compile_options.of_mesh(setup.mesh) == compile_options.ONEDNN_DOTS
    hlo = setup.step.lower(setup.batch_spec((4, 16, 16), 8), setup.encoders.weights).compile().as_text()
    _assert_linear_matmuls_in_onednn(hlo)


@needs_x86
def test_sampler_matmuls_run_through_onednn(monkeypatch):
    from jaxsora.models.presets import get_model_config
    from jaxsora.models.stdit3 import STDiT3

    monkeypatch.setenv(compile_options.ENV, "onednn")
    graphdef, state = nnx.split(STDiT3(get_model_config("tiny"), rngs=nnx.Rngs(0)))  # caption 8 tokens × 32
    z = jnp.zeros((1, 4, 2, 8, 8))
    cond = dict(y=jnp.zeros((1, 1, 8, 32)), mask=jnp.ones((1, 8), jnp.int32), fps=jnp.full((1,), 24.0),
                height=jnp.full((1,), 64.0), width=jnp.full((1,), 64.0))
    carry, cond2 = rflow.sample_init(z, cond, jnp.zeros((8, 32)))
    ts = jnp.full((2, 1), 500.0)
    hlo = rflow.programs().module_steps.lower(graphdef, state, carry, cond2, None, ts, None, None, jnp.float32(7),
                                              0, 2).compile().as_text()
    _assert_linear_matmuls_in_onednn(hlo)


def test_gpu_variants_by_name(monkeypatch):
    monkeypatch.delenv(compile_options.GPU_ENV, raising=False)
    assert compile_options.for_platform("gpu") is None  # the default: XLA:GPU's own
    monkeypatch.setenv(compile_options.GPU_ENV, "lhs, no-triton-gemm")
    assert compile_options.for_platform("gpu") == {"xla_gpu_enable_latency_hiding_scheduler": True,
                                                   "xla_gpu_enable_triton_gemm": False}
    assert compile_options.for_platform("cpu") is None  # CPU programs keep their own
    monkeypatch.setenv(compile_options.GPU_ENV, "lhs,no-command-buffers")
    with pytest.raises(BadInput, match="JAXSORA_GPU_XLA: unknown variant 'no-command-buffers'; known: lhs, "):
        compile_options.for_platform("gpu")


@pytest.mark.parametrize("name", sorted(compile_options.GPU_VARIANTS))
def test_gpu_variant_options_exist_in_xla(name):
    """Each variant's options, names and values, compile (on CPU) with this jaxlib; a misspelt one does not."""
    import jax

    fn = jax.jit(lambda x: (x @ x).sum()).lower(jnp.ones((8, 8)))
    fn.compile(compiler_options=compile_options.GPU_VARIANTS[name])
    with pytest.raises(Exception, match="No such compile option"):
        fn.compile(compiler_options={k + "_x": v for k, v in compile_options.GPU_VARIANTS[name].items()})


@pytest.mark.parametrize("env, said", [
    ({compile_options.ENV: "mkl"}, "JAXSORA_CPU_MATMUL must be 'xla' or 'onednn', got 'mkl'"),
    ({compile_options.GPU_ENV: "lhs,fast"}, "JAXSORA_GPU_XLA: unknown variant 'fast'; known: "
                                            + ", ".join(compile_options.GPU_VARIANTS))])
@pytest.mark.parametrize("command", [["jaxsora.train", "--config", "configs/demo.py"],
                                     ["jaxsora.sample", "outputs/nowhere", "--prompt", "a red square"]])
def test_misspelt_choice_stops_a_command_before_jax(command, env, said):
    """`JAXSORA_CPU_MATMUL=mkl python -m jaxsora.train|sample ...` (or a GPU variant misspelt): one line, exit code
    2, jax not imported."""
    import os
    import subprocess
    import sys

    from tests.test_config_import import HEAVY, REPO

    r = subprocess.run([sys.executable, "-X", "importtime", "-m", *command], capture_output=True, text=True,
                       cwd=REPO, timeout=120, env={**os.environ, **env})
    lines = r.stderr.splitlines()
    errors = [ln for ln in lines if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")}
    assert r.returncode == 2 and errors == [f"{command[0]}: {said}"], r.stderr[-3000:]
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
