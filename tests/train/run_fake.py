"""Subprocess entry for loop tests: train the small test config on the fake loader.

usage: run_fake.py OUTPUTS MAX_STEPS [--load DIR] [--devices N] [--mesh data,fsdp,seq] [--ckpt-every K]
Multi-process: set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
Prints one JSON line `RESULT {...}` at the end.
"""
import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("outputs")
ap.add_argument("max_steps", type=int)
ap.add_argument("--load")
ap.add_argument("--devices", type=int, default=1)
ap.add_argument("--mesh", default="-1,1,1")
ap.add_argument("--ckpt-every", type=int, default=3)
ap.add_argument("--batch", type=int, default=2, help="global batch")
ap.add_argument("--hang-at", type=int, default=None, help="the loader freezes at this batch")
ap.add_argument("--nan-from", type=int, default=None, help="batches from this one on are non-finite")
ap.add_argument("--nan-process", type=int, default=None, help="... only in this process's rows")
ap.add_argument("--watchdog-min", type=float, default=None, help="train.watchdog_min_seconds")
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.xla_flags import cpu_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_flags(args.devices)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.parallel.distributed import initialize  # noqa: E402
from tests.multiprocess_cache import share_compilation_cache  # noqa: E402

share_compilation_cache()
initialize()
import jax  # noqa: E402

from jaxsora.train.run.loop import NonFiniteError, RunOptions, train  # noqa: E402
from tests.train.common import CUT_LENGTHS, small_config  # noqa: E402
from tests.train.fake_loader import FakeLoader  # noqa: E402

# the captions cut (CUT_LENGTHS): the processes of a multi-process run agree on one length each step
cfg = small_config(args.outputs, max_steps=args.max_steps, ckpt_every=args.ckpt_every,
                   mesh=tuple(int(x) for x in args.mesh.split(",")), text_lengths=CUT_LENGTHS)
if args.watchdog_min is not None:
    cfg.train.watchdog_min_seconds = args.watchdog_min


def factory(c, dp, text_inputs):
    return FakeLoader(data_parallel_size=dp, per_device_batch=args.batch // dp, process_index=jax.process_index(),
                      process_count=jax.process_count(), text_inputs=text_inputs, hang_at_batch=args.hang_at,
                      nan_from_step=args.nan_from, nan_process=args.nan_process)


try:
    res = train(cfg, RunOptions(load=args.load, run_dir=os.path.join(args.outputs, "run")), loader_factory=factory)
except NonFiniteError as e:
    res = dict(nonfinite_stop=str(e))
# One write of the whole line: the tests read stderr in the same pipe, where Gloo's threads log (with
# PYTHONUNBUFFERED, print writes its newline apart, and a line of theirs could land between).
plain = {k: v for k, v in res.items() if isinstance(v, (int, float, str, bool, type(None)))}
sys.stdout.write("RESULT " + json.dumps(plain) + "\n")
sys.stdout.flush()
