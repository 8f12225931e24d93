"""Subprocess entry for the multi-process checkpoint test: one of 2 processes (1 CPU device each,
a 2-device fsdp mesh) saves steps 1..3 of a small sharded state, or restores the newest intact one.

usage: run_ckpt_procs.py DIR save|restore   (with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID set). Prints one JSON line `RESULT {...}`.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.xla_flags import cpu_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_flags(1)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.parallel.distributed import initialize  # noqa: E402
from tests.multiprocess_cache import share_compilation_cache  # noqa: E402

share_compilation_cache()
initialize()
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxsora.checkpoint import Checkpointer, restore  # noqa: E402

directory, mode = sys.argv[1], sys.argv[2]
mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
SHARDED, REPLICATED = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())


def host_state(k):
    return {"step": np.array(k, np.int32),
            "params": {"w": np.arange(256 * 128, dtype=np.float32).reshape(256, 128) * 0.5 + k}}


def global_state(k):
    """Each process supplies only its own shards (the rows of its device)."""
    shardings = {"step": REPLICATED, "params": {"w": SHARDED}}
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
                        host_state(k), shardings)


def result(doc: dict) -> None:
    """The `RESULT {json}` line the test reads, in one write (its stderr shares the pipe: see run_fake.py)."""
    sys.stdout.write("RESULT " + json.dumps(doc) + "\n")
    sys.stdout.flush()


if mode == "save":
    c = Checkpointer(directory, keep=0)
    for k in (1, 2, 3):
        c.save(k, global_state(k), config={}, data={"k": k}, meta={})
    c.close()
    result({"saved": True})
else:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), global_state(0))
    res = restore(directory, target)
    local = res["state"]["params"]["w"].addressable_shards[0]
    ok = bool(np.array_equal(np.asarray(local.data), host_state(res["step"])["params"]["w"][local.index]))
    result({"step": res["step"], "skipped": [s for s, _ in res["skipped"]], "values_ok": ok})
