"""Compile for chips this machine does not have: the plan's `--target` (`train.target`).

`python -m jaxsora.train ... --dry-run --target h100x8` (and `jaxsora.tools.search_bs --target ...`) compiles
every bucket's step as the target's own compiler does on the target's own devices, from any machine, a CPU
included. jax makes compile-only devices from a topology (`jax.experimental.topologies`, as MaxText's
`train_compile.py` does for TPUs): XLA:GPU with ptxas for sm_90 from the CUDA plugin, or libtpu's compiler for a
TPU slice. Nothing runs and no device is needed; `memory_analysis()` then reads the target's memory.

Target names: `<gpu>x<N>` — `h100x8`, `h200x8`, `a100-80gx8` (N GPUs, 8 to a host; `h100` is one) — and
`tpu-<generation>:<topology>` — `tpu-v5p:2x2x2`, `tpu-v5e:4x4`, `tpu-v6e:2x4`, `tpu-v4:2x2x1` (libtpu's topology
names: chips along each axis). Every choice the plan makes by platform follows the target's platform, not this
machine's: attention `auto` (`jaxsora.models.layers.resolve_attention_impl`), the compiler options
(`jaxsora.parallel.compile_options.of_mesh`) and the device memory (`memory_bytes`).

The compilers are not in jaxsora's default install, because a CUDA plugin on a machine without an NVIDIA driver
makes every jax process print driver warnings on stderr (tried with jax-cuda12-plugin 0.10.2, even with
JAX_PLATFORMS=cpu) and libtpu off a TPU VM looks for a TPU it cannot find. Each lives in a folder of its own that
only a target command loads (`make plan-gpu`, `make plan-tpu`: `compiler_dir`), quietly; a GPU or TPU install where
jax already has the plugin (`.[cuda12]`, `.[tpu]`) needs no folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import re
import sys
import tempfile

from jaxsora.errors import BadInput, MissingDependency

GIB = 1 << 30
# Where each compiler's folder is (default: in the virtual environment, <sys.prefix>/jaxsora-plan-gpu|tpu)
DIR_ENV = {"gpu": "JAXSORA_PLAN_GPU", "tpu": "JAXSORA_PLAN_TPU"}
INSTALL = {"gpu": "make plan-gpu", "tpu": "make plan-tpu"}
# jax's GPU allocator may use this share of the device's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (jax's GPU memory allocation docs): the bytes_limit a real run's plan reads on the device
JAX_GPU_MEM_FRACTION = 0.75
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True, eq=False)
class Chip:
    """One accelerator's facts for the plan: memory, peak dense FLOP/s (bf16, and f32 as XLA runs it at default
    precision: TF32 on GPUs, bf16 passes on TPUs), memory bandwidth; for a GPU the XLA target description."""

    key: str  # the target's spelling: "h100", "tpu-v5p"
    label: str
    platform: str  # "gpu" | "tpu"
    memory_bytes: int  # the device's whole memory (GPU: what CUDA reports as total)
    peak_bf16: float
    peak_f32: float
    hbm_bytes_per_s: float
    gpu: dict | None = None  # GpuTargetConfigProto's gpu_device_info fields (XLA's spec files, jax 0.10.2's fields)
    tpu: str | None = None  # libtpu's topology prefix: "v5p"


def _gpu_info(cc: int, cores: int, fpus: int, smem_core: int, smem_optin: int, l2: int, clock: float,
              bandwidth: float, memory: int) -> dict:
    return dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                shared_memory_per_core=smem_core, threads_per_core_limit=2048, core_count=cores, fpus_per_core=fpus,
                block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=int(bandwidth), l2_cache_size=l2, clock_rate_ghz=clock, device_memory_size=memory,
                shared_memory_per_block_optin=smem_optin, cuda_compute_capability=cc,
                registers_per_core_limit=65536, registers_per_block_limit=65536)


MIB = 1 << 20
# GPUs: NVIDIA's datasheets (dense tensor-core peaks, SXM parts) and XLA's spec files (xla/tools/hlo_opt/gpu_specs:
# H100's 84,978,434,048 bytes); H200's and A100's memory as nvidia-smi reports it (143,771 and 81,920 MiB).
# TPUs: Google Cloud's system architecture pages (HBM per chip, bf16 peak, HBM bandwidth).
CHIPS = {c.key: c for c in (
    Chip("h100", "H100 SXM 80GB", "gpu", 84_978_434_048, 989e12, 495e12, 3.35e12,
         gpu=_gpu_info(90, 132, 128, 233472, 232448, 52428800, 1.98, 3.35e12, 84_978_434_048)),
    Chip("h200", "H200 SXM 141GB", "gpu", 143_771 * MIB, 989e12, 495e12, 4.8e12,
         gpu=_gpu_info(90, 132, 128, 233472, 232448, 52428800, 1.98, 4.8e12, 143_771 * MIB)),
    Chip("a100-80g", "A100 SXM 80GB", "gpu", 81_920 * MIB, 312e12, 156e12, 2.039e12,
         gpu=_gpu_info(80, 108, 64, 167936, 166912, 41943040, 1.41, 2.039e12, 81_920 * MIB)),
    Chip("tpu-v4", "TPU v4", "tpu", 32 * GIB, 275e12, 275e12, 1.2e12, tpu="v4"),
    Chip("tpu-v5e", "TPU v5e", "tpu", 16 * GIB, 197e12, 197e12, 819e9, tpu="v5e"),
    Chip("tpu-v5p", "TPU v5p", "tpu", 95 * GIB, 459e12, 459e12, 2.765e12, tpu="v5p"),
    Chip("tpu-v6e", "TPU v6e", "tpu", 32 * GIB, 918e12, 918e12, 1.64e12, tpu="v6e"),
)}
EXAMPLES = "h100x8, h200x8, a100-80gx8, tpu-v5p:2x2x2, tpu-v5e:4x4, tpu-v6e:2x4"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    chip: Chip
    num_devices: int
    topology: str  # GPU: "<slices>x<hosts>x<GPUs a host>"; TPU: libtpu's topology name ("v5p:2x2x2")

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def memory_bytes(self) -> int:
        """Bytes a step may use on one device, as a run's plan on the device reads them (its `bytes_limit`): a GPU's
        memory × XLA_PYTHON_CLIENT_MEM_FRACTION (jax's default 0.75), a TPU's whole HBM."""
        return int(self.chip.memory_bytes * mem_fraction()) if self.platform == "gpu" else self.chip.memory_bytes

    def describe(self) -> str:
        how = (f"{self.chip.memory_bytes / GIB:.2f} GiB × XLA_PYTHON_CLIENT_MEM_FRACTION {mem_fraction():g}"
               if self.platform == "gpu" else "its HBM")
        return (f"target {self.name}: {self.num_devices} × {self.chip.label} ({self.topology}), "
                f"{self.memory_bytes / GIB:.2f} GiB per device ({how}), compiled by "
                f"{'XLA:GPU (the CUDA plugin)' if self.platform == 'gpu' else 'libtpu'} on this machine")


def mem_fraction() -> float:
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        value = float(raw) if raw.strip() else JAX_GPU_MEM_FRACTION
    except ValueError:
        raise BadInput(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], got {raw!r}") from None
    if not 0 < value <= 1:
        raise BadInput(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be in (0, 1], got {raw!r}")
    return value


def parse(spec: str) -> Target:
    """`h100x8` | `h100` | `tpu-v5p:2x2x2` → Target; anything else: BadInput naming the known targets."""
    text = str(spec or "").strip().lower()
    known = f"known: <{'|'.join(k for k, c in CHIPS.items() if c.platform == 'gpu')}>x<GPUs> or " \
            f"<{'|'.join(k for k, c in CHIPS.items() if c.platform == 'tpu')}>:<topology>, e.g. {EXAMPLES}"
    if text.startswith("tpu"):
        chip_name, _, topo = text.partition(":")
        chip = CHIPS.get(chip_name)
        if chip is None or chip.platform != "tpu":
            raise BadInput(f"--target {spec!r}: unknown TPU {chip_name!r}; {known}")
        if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", topo):
            raise BadInput(f"--target {spec!r}: a TPU target needs its topology, chips along each axis, e.g. "
                           f"{chip_name}:2x2x2 or {chip_name}:2x4")
        n = math.prod(int(d) for d in topo.split("x"))
        return Target(text, chip, n, f"{chip.tpu}:{topo}")
    m = re.fullmatch(r"([a-z0-9-]+?)(?:x(\d+))?", text)
    chip = CHIPS.get(m.group(1)) if m else None
    if chip is None or chip.platform != "gpu":
        raise BadInput(f"--target {spec!r}: unknown target; {known}")
    n = int(m.group(2) or 1)
    if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
        raise BadInput(f"--target {spec!r}: a GPU count of 1-{GPUS_PER_HOST} or a multiple of {GPUS_PER_HOST} "
                       f"({GPUS_PER_HOST} GPUs a host), got {n}")
    hosts, per_host = (n // GPUS_PER_HOST, GPUS_PER_HOST) if n > GPUS_PER_HOST else (1, n)
    return Target(text, chip, n, f"1x{hosts}x{per_host}")


# --------------------------------------------------------------------------------------------
# the target's compiler and devices
# --------------------------------------------------------------------------------------------
_DEVICES: dict = {}  # target name → its compile-only devices
_TARGET_OF_DEVICE: dict = {}  # id(device) → Target


def compiler_dir(platform: str) -> str:
    """The folder holding a platform's compiler (pip's --target layout): $JAXSORA_PLAN_GPU / $JAXSORA_PLAN_TPU,
    else <sys.prefix>/jaxsora-plan-gpu|tpu (`make plan-gpu`, `make plan-tpu` put them there)."""
    return os.environ.get(DIR_ENV[platform]) or os.path.join(sys.prefix, f"jaxsora-plan-{platform}")


@contextlib.contextmanager
def _quiet_stderr():
    """The compilers' own start-up lines (the CUDA plugin's 'Could not find cuda drivers', libtpu's host and worker
    warnings) go to a scratch file, not the user's stderr: a target command says what it does itself. Shown
    with JAXSORA_DEBUG=1."""
    if os.environ.get("JAXSORA_DEBUG", "") not in ("", "0"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _missing(target: Target, why: str) -> MissingDependency:
    p = target.platform
    return MissingDependency(f"--target {target.name} needs the {p.upper()} compiler, which is not installed ({why}): "
                             f"run `{INSTALL[p]}` in the jaxsora checkout, or set ${DIR_ENV[p]} to its folder "
                             "(docs/install.md)")


def _on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _load_gpu_compiler(target: Target) -> None:
    """Register jax's CUDA plugin from the compiler folder (unless jax found one itself), as jax's own discovery
    would have at start-up: the plugin, the custom-call partitioners of jax's plugin callbacks (cuDNN attention's
    custom partitioning) and cuDNN's version module; ptxas and libdevice from the folder's nvidia-cuda-nvcc."""
    from jax._src import xla_bridge as xb

    xb._discover_and_register_pjrt_plugins()
    if "cuda" in xb._topology_factories:
        return
    folder = compiler_dir("gpu")
    if not os.path.isdir(os.path.join(folder, "jax_plugins", "xla_cuda12")):
        raise _missing(target, f"no CUDA plugin in {folder}")
    _on_path(folder)
    plugin = importlib.import_module("jax_plugins.xla_cuda12")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime or driver here to check
    plugin.initialize()
    if "cuda" not in xb._topology_factories:
        raise _missing(target, f"the CUDA plugin in {folder} did not register")
    c_api = xb._backend_factories["cuda"].c_api
    for callback in list(xb._plugin_callbacks):
        callback(c_api=c_api)
    from jax._src import lib

    versions = importlib.import_module("jax_cuda12_plugin._versions")
    if lib.cuda_versions is None:
        lib.cuda_versions = versions
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    except ImportError:  # another jax layout: cuDNN attention then says for itself what it lacks
        cudnn_attention = None
    if cudnn_attention is not None and getattr(cudnn_attention, "cuda_versions", 1) is None:
        cudnn_attention.cuda_versions = versions
    # the GPU kernels jax lowers to by custom call (the PRNG's threefry, linalg): jaxlib's modules found no plugin
    # when jax was imported; imported again they find this one, and jax's own registration runs for them
    from jax._src.lax import linalg

    for name in ("gpu_prng", "gpu_linalg", "gpu_solver", "gpu_sparse"):
        try:
            module = importlib.reload(importlib.import_module(f"jaxlib.{name}"))
        except ImportError:
            continue
        linalg.register_module_custom_calls(module)
    nvcc = os.path.join(folder, "nvidia", "cuda_nvcc")
    if getattr(lib, "cuda_path", None) is None and os.path.isdir(nvcc):
        lib.cuda_path = nvcc  # jax hands it to XLA as xla_gpu_cuda_data_dir: ptxas and libdevice


def _gpu_target_config(target: Target) -> str:
    """The GpuTargetConfigProto text of the target's GPU, with the cuDNN version of the compiler's own cuDNN."""
    info = dict(target.chip.gpu)
    cc = info.pop("cuda_compute_capability")
    lines = [f"  {k}: {v}" for k, v in info.items()]
    lines.append(f"  cuda_compute_capability {{ major: {cc // 10} minor: {cc % 10} }}")
    dnn = ""
    try:
        from jax._src import lib

        v = int(lib.cuda_versions.cudnn_get_version()) if lib.cuda_versions is not None else 0
        if v:
            dnn = f"dnn_version_info {{ major: {v // 10000} minor: {v // 100 % 100} patch: {v % 100} }}\n"
    except Exception:  # noqa: BLE001 - no cuDNN: XLA assumes its own minimum
        dnn = ""
    return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\nplatform_name: \"CUDA\"\n" + dnn
            + f"device_description_str: \"{target.chip.label}\"\n")


def _tpu_library(target: Target) -> None:
    """libtpu for the topology: jax's own (`.[tpu]`), else the compiler folder's (TPU_LIBRARY_PATH)."""
    from jax._src import cloud_tpu_init

    if cloud_tpu_init.get_tpu_library_path():
        return
    path = os.path.join(compiler_dir("tpu"), "libtpu", "libtpu.so")
    if not os.path.isfile(path):
        raise _missing(target, f"no libtpu.so in {compiler_dir('tpu')}")
    os.environ["TPU_LIBRARY_PATH"] = path


def devices(target: Target) -> list:
    """The target's compile-only devices (made once per process)."""
    if target.name in _DEVICES:
        return _DEVICES[target.name]
    import jax
    from jax._src import xla_bridge as xb
    from jax.experimental import topologies

    if not xb.backends_are_initialized() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")  # a plan runs nothing: no local accelerator is set up for it
    jax.devices()  # this machine's backends first, so that a compiler registered after them is the target's only
    with _quiet_stderr():
        if target.platform == "gpu":
            _load_gpu_compiler(target)
            topo = topologies.get_topology_desc(platform="cuda", target_config=_gpu_target_config(target),
                                                topology=target.topology)
        else:
            _tpu_library(target)
            # libtpu off a TPU VM: no metadata server to ask for the slice (its questions time out otherwise)
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
            # compiling takes no TPU: other processes compiling with libtpu at the same time are no conflict
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            try:
                topo = topologies.get_topology_desc(topology_name=target.topology, platform="tpu")
            except (RuntimeError, ValueError, jax.errors.JaxRuntimeError) as e:
                raise BadInput(f"--target {target.name}: libtpu could not make the topology {target.topology!r} "
                               f"({str(e).splitlines()[0][:200]})") from None
    devs = list(topo.devices)
    if len(devs) != target.num_devices:
        raise BadInput(f"--target {target.name}: the topology {target.topology} has {len(devs)} devices, "
                       f"not {target.num_devices}")
    _DEVICES[target.name] = devs
    for d in devs:
        _TARGET_OF_DEVICE[id(d)] = target
    return devs


def target_of(mesh) -> Target | None:
    """The target whose devices the mesh is made of (None: this machine's own devices)."""
    return _TARGET_OF_DEVICE.get(id(mesh.devices.flat[0]))


def platform_of(mesh) -> str:
    """"cpu", "gpu" or "tpu": the platform the mesh's programs are compiled for."""
    p = str(mesh.devices.flat[0].platform).lower()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def compiler_options(target: Target) -> dict:
    """XLA options a compile for the target adds to the platform's own (`compile_options.for_platform`).
    GPU: no Triton GEMMs — jaxlib 0.10.2's deviceless XLA:GPU fails to tile a Triton GEMM at hidden size 1152
    (STDiT3-XL/2's) without a device to autotune on, so every GEMM goes to cuBLAS, as `no-triton-gemm` does."""
    return {"xla_gpu_enable_triton_gemm": False} if target.platform == "gpu" else {}
