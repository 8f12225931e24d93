"""The plan cache of a `train.target`: what compiling a step for the target's chips gave (`CompileInfo`: memory,
FLOPs, bytes), by the program, so that the next plan of the same program reads it back instead of compiling again.

jax's persistent compilation cache writes a target's executables but cannot read them back (jaxlib 0.10.2: "PjRtCompiler
must be constructed with a Client to call DeserializeLoadedExecutable"), and a plan needs only these numbers. The
key is the lowered program's text (StableHLO: the model, the batch shape, the shardings, the remat) with the target,
its compiler options and the versions of jax and of the target's compiler; the entries are small JSON files in
`<jax's compilation cache folder>/jaxsora-target-plans/` (the run's `<outputs>/jax_cache`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

FOLDER = "jaxsora-target-plans"


def _folder() -> str | None:
    import jax

    root = jax.config.jax_compilation_cache_dir
    return os.path.join(root, FOLDER) if root else None


def key(lowered, target, options) -> str:
    import jax

    h = hashlib.sha256()
    # jax's custom partitioning (cuDNN attention's) names its Python callbacks by object id in the program: the
    # same program lowered in another process differs there only
    h.update(re.sub(r'(@CustomSPMDPartitioning\([^)]*\) \{api_version = \d+ : i32, backend_config = )"\d+"',
                    r'\1"*"', lowered.as_text()).encode())
    h.update(json.dumps([target.name, target.topology, sorted((options or {}).items()), jax.__version__,
                         _compiler_version(target.platform)], default=str).encode())
    return h.hexdigest()


def _compiler_version(platform: str) -> str:
    from importlib import metadata

    for name in (("jax-cuda12-plugin", "nvidia-cudnn-cu12") if platform == "gpu" else ("libtpu",)):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def read(k: str) -> dict | None:
    """The fields of the CompileInfo kept for this key (None: not kept, or unreadable)."""
    folder = _folder()
    path = os.path.join(folder, f"{k}.json") if folder else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError, TypeError):  # a torn entry: compile again
        return None


def write(k: str, info) -> None:
    folder = _folder()
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{k}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(info), f)
    os.replace(tmp, os.path.join(folder, f"{k}.json"))


def optimized_hlo(lowered, target, options) -> str:
    """The optimized HLO text of `lowered` compiled for the target (what the structural tests read), kept gzipped
    beside the plan cache's entries: a second call for the same program reads it back."""
    import gzip

    folder = _folder()
    path = os.path.join(folder, f"{key(lowered, target, options)}.hlo.gz") if folder else None
    if path and os.path.isfile(path):
        with gzip.open(path, "rt") as f:
            return f.read()
    text = lowered.compile().as_text()
    if path:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with gzip.open(tmp, "wt") as f:
            f.write(text)
        os.replace(tmp, path)
    return text
