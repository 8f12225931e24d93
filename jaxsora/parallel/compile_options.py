"""XLA compiler options for jaxsora's programs, by platform: the train and eval steps, the sampler and the T5
encoder are jitted with `for_platform(...)` (or `of_mesh(mesh)`).

GPU, opt-in by name: `JAXSORA_GPU_XLA=lhs,no-triton-gemm,...` (`GPU_VARIANTS`; comma-separated, applied in order)
sets XLA:GPU options that `bench/gpu_vs_opensora.sh` times one at a time beside XLA's defaults in one device call.
None is on by default: each becomes a default only with a measurement on an H100/H200 beside it. The option names
were checked against jaxlib 0.10.2's XLA, which accepts each through `compiler_options` (a misspelt name there
is "No such compile option"; `xla_gpu_enable_command_buffer` takes a full list, not "+X" modifiers), and against
XLA's defaults at the time (debug_options_flags.cc): latency-hiding scheduler off, Triton GEMMs on, cuDNN layer
norm off, command buffers for FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION.

Variants (each timed against XLA's defaults on an H200, STDiT3-XL/2 240p × 51, batch 4: pending a GPU session):
- `lhs`: xla_gpu_enable_latency_hiding_scheduler=True.
- `no-triton-gemm`: xla_gpu_enable_triton_gemm=False, every GEMM to cuBLAS (the H200 profile of the step had 66 of
  its 300 ms of GEMMs in Triton kernels, README "Benchmarks").
- `cudnn-layer-norm`: xla_gpu_enable_cudnn_layer_norm=True.
- `no-command-buffer`: xla_gpu_enable_command_buffer="" (no CUDA graphs).
- `command-buffer-loops`: the default command buffers plus WHILE and CONDITIONAL (a `scan_blocks` loop in one graph).
- `cublaslt`: xla_gpu_enable_cublaslt=True.

CPU, one option, opt-in: `JAXSORA_CPU_MATMUL=onednn` has XLA:CPU (x86-64) run every matmul through oneDNN, one
oneDNN call per dot (`xla_cpu_use_onednn` with the INDIVIDUAL_DOT fusion type), instead of YNNPACK, XLA:CPU's
default ("xla"). On the 2-core AVX-512 host of `bench/step.py` (jaxlib 0.10.2, 2026-11-28) oneDNN ran the
attention's batched matmuls 1.5-1.9x as fast as YNNPACK (cross-attention's Q·Kᵀ at `realistic`,
[4, 6, 720, 64]·[4, 6, 150, 64]ᵀ: 2.35 ms against 4.23) and the Linear layers' as fast or up to 1.2x as fast;
whole programs, in-process A/B: the 30-step sampler 0.83-0.89x the time at `realistic`, 0.90x at `wide`; the
train step 0.94-0.99x, within the host's noise against Open-Sora (docs/benchmarks.md). Outputs agree to ~2e-6
(relative).

Why not the default: XLA:CPU cannot serialize a program holding oneDNN calls ("ToProto is not implemented for
thunk kind: onednn-fusion"), so such programs never reach jax's persistent compilation cache — every process
compiles them anew (a cold `make test` with it on took 21 min; a sampling command recompiles its loop). Worth
it for a long CPU run, not for the demo or short commands. And only single dots: with the DOT fusion type XLA hands
oneDNN graphs of several ops (two dots and the add of their sum, as a gradient accumulates), which oneDNN's
graph compiler fails on — "partition compile failed", then SIGILL.
"""
from __future__ import annotations

import functools
import os
import platform as _platform
import sys
import warnings

from jaxsora.errors import BadInput

ENV = "JAXSORA_CPU_MATMUL"  # "xla" (default) or "onednn"
CHOICES = ("xla", "onednn")
GPU_ENV = "JAXSORA_GPU_XLA"  # comma-separated names of GPU_VARIANTS ("" or unset: XLA's defaults)
# XLA:GPU's default command buffer kinds (debug_options_flags.cc), for the variant that adds to them
_DEFAULT_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
GPU_VARIANTS = {
    "lhs": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "no-triton-gemm": {"xla_gpu_enable_triton_gemm": False},
    "cudnn-layer-norm": {"xla_gpu_enable_cudnn_layer_norm": True},
    "no-command-buffer": {"xla_gpu_enable_command_buffer": ""},
    "command-buffer-loops": {"xla_gpu_enable_command_buffer": _DEFAULT_COMMAND_BUFFERS + ",WHILE,CONDITIONAL"},
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
}
ONEDNN_DOTS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
# jax's warning, per program, that it could not write a oneDNN program's persistent cache entry: said once instead
_CACHE_WARNING = r"(?s)Error writing persistent compilation cache entry.*onednn"


def cpu_matmul() -> str:
    """The CPU matmul library asked for: $JAXSORA_CPU_MATMUL, "xla" when unset (no jax imported: the commands
    check it before any work)."""
    choice = os.environ.get(ENV, "xla").strip().lower() or "xla"
    if choice not in CHOICES:
        raise BadInput(f"{ENV} must be 'xla' or 'onednn', got {os.environ[ENV]!r}")
    return choice


def gpu_variants() -> tuple[str, ...]:
    """The GPU variants asked for: $JAXSORA_GPU_XLA's names, () when unset (checked before any jax work)."""
    names = tuple(n.strip().lower() for n in os.environ.get(GPU_ENV, "").split(",") if n.strip())
    bad = [n for n in names if n not in GPU_VARIANTS]
    if bad:
        raise BadInput(f"{GPU_ENV}: unknown variant {bad[0]!r}; known: {', '.join(GPU_VARIANTS)}")
    return names


def gpu_options(names=None) -> dict | None:
    """The XLA:GPU options of these variants (default: $JAXSORA_GPU_XLA's), merged in order; None for none."""
    names = gpu_variants() if names is None else names
    out: dict = {}
    for n in names:
        out.update(GPU_VARIANTS[n])
    return out or None


def check_env() -> None:
    """Both variables read, so that a misspelt value is one line before any work (the commands' front)."""
    cpu_matmul()
    gpu_variants()


def for_platform(platform: str) -> dict | None:
    """The compiler options for a program on `platform` ("cpu", "gpu", "tpu"), or None (XLA's defaults)."""
    if platform in ("gpu", "cuda", "rocm"):
        return gpu_options()
    if platform != "cpu" or cpu_matmul() == "xla":
        return None
    warnings.filterwarnings("ignore", message=_CACHE_WARNING)  # before the probe, which is such a program too
    if not onednn_works():
        raise BadInput(f"{ENV}=onednn: this machine's XLA:CPU has no working oneDNN matmuls (an x86-64 CPU and a "
                       f"jaxlib built with oneDNN are needed); unset {ENV}")
    _say_uncached()
    return dict(ONEDNN_DOTS)


def of_mesh(mesh) -> dict | None:
    """`for_platform` of the mesh's devices; for a target's compile-only devices (`jaxsora.parallel.targets`), with
    the options a compile for the target adds."""
    from jaxsora.parallel import targets

    options = for_platform(targets.platform_of(mesh))
    target = targets.target_of(mesh)
    if target is not None:
        options = {**targets.compiler_options(target), **(options or {})} or None
    return options


def of_default_backend() -> dict | None:
    """`for_platform` of jax's default backend (for programs that run on the default device)."""
    import jax

    return for_platform(jax.default_backend())


@functools.cache
def onednn_works() -> bool:
    """x86-64, and a probe matmul compiled with `ONEDNN_DOTS` runs through oneDNN and gives the right numbers."""
    if _platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import jax
    import numpy as np

    cpu = jax.local_devices(backend="cpu")[0]
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(rng.standard_normal(s).astype(np.float32), cpu) for s in ((2, 24, 40), (2, 40, 16)))
    try:
        probe = jax.jit(lambda x, y: x @ y).lower(a, b).compile(compiler_options=dict(ONEDNN_DOTS))
        got = np.asarray(probe(a, b))
    except Exception:  # noqa: BLE001 - an XLA without the options, or without oneDNN
        return False
    want = np.einsum("bij,bjk->bik", np.asarray(a, np.float64), np.asarray(b, np.float64))
    return "onednn" in probe.as_text() and bool(np.allclose(got, want, rtol=1e-4, atol=1e-4))


@functools.cache
def _say_uncached() -> None:
    print(f"{ENV}=onednn: programs with oneDNN matmuls are compiled in every process (XLA:CPU cannot write them "
          f"to the persistent compilation cache)", file=sys.stderr)
