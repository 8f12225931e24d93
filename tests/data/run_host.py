"""Subprocess entry for the two-host loader test: one of two `jax.distributed` processes on
127.0.0.1 (2 CPU devices each) reads its share of each global batch with the real loader,
assembles global arrays with `jax.make_array_from_process_local_data` (as the train loop does),
gathers them back and saves what it saw.

usage: run_host.py TABLE OUT.npz --workers N --batches K   (JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID set by the caller)
"""
import argparse
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("table")
ap.add_argument("out")
ap.add_argument("--workers", type=int, default=0)
ap.add_argument("--batches", type=int, default=3)
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.xla_flags import cpu_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_flags(2)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.parallel.distributed import initialize  # noqa: E402
from tests.multiprocess_cache import share_compilation_cache  # noqa: E402


def main():
    share_compilation_cache()
    initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxsora.data.loader import VideoLoader
    from tests.data.test_loader import BUCKETS, RES

    dp = jax.device_count()
    loader = VideoLoader(args.table, BUCKETS, seed=3, data_parallel_size=dp, process_index=jax.process_index(),
                         process_count=jax.process_count(), num_workers=args.workers, extra_resolutions=RES,
                         progress=False)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    out = dict(fingerprint=np.array(str(loader.fingerprint)), process_count=jax.process_count(), dp=dp,
               plan0=np.concatenate([p.rows for p in loader.plan(0)]))
    it = iter(loader)
    for i in range(args.batches):
        host = next(it)
        sharding = NamedSharding(mesh, PartitionSpec("data"))
        for key in ("video", "row"):
            glob = jax.make_array_from_process_local_data(sharding, host[key])
            out[f"{key}{i}"] = multihost_utils.process_allgather(glob, tiled=True)
    out["state"] = np.array([loader.state()["epoch"], loader.state()["index"]])
    np.savez(args.out, **out)
    print("OK", flush=True)


if __name__ == "__main__":  # grain workers are spawned: the guard keeps them from rerunning this
    main()
