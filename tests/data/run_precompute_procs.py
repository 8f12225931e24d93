"""Subprocess entry for the multi-process feature-cache test: one of the `jax.distributed` processes
(1 CPU device each) running `python -m data_tools.precompute ARGS...` — the command's own `main`,
which joins the processes itself — with the sampling stand-in VAE of tests/data/test_features_procs.py.

usage: run_precompute_procs.py [--stop-after N] PRECOMPUTE_ARGS...   (JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID set by the caller). --stop-after N: each process stops after
encoding N shards (the stand-in for an interruption). Exits as the command does (2: a one-line error).
"""
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.xla_flags import cpu_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_flags(1)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv):
    import data_tools.latents
    from data_tools.precompute import main as precompute
    from jaxsora.errors import run_cli
    from tests.data.test_features_procs import install_sampled_vae
    from tests.multiprocess_cache import share_compilation_cache

    share_compilation_cache()

    if argv[:1] == ["--stop-after"]:
        data_tools.latents.precompute_features = functools.partial(data_tools.latents.precompute_features,
                                                                   stop_after_shards=int(argv[1]))
        argv = argv[2:]
    install_sampled_vae(setattr)
    return run_cli("data_tools.precompute", lambda: (precompute(argv), 0)[1], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
