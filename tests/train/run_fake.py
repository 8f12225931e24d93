"""Subprocess entry for loop tests: train the small test config on the fake loader.

usage: run_fake.py OUTPUTS MAX_STEPS [--load DIR] [--devices N] [--mesh data,fsdp,seq] [--ckpt-every K]
Multi-process: set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
Prints one JSON line `RESULT {...}` at the end. With --marks, `MARK <moment> [step]` lines on stdout when
the step's compile starts (`MARK compile`), an eval starts (`MARK eval S`) or a held save pauses
(`MARK saving S`, --hold-save): the moments tests/train/test_lost_host.py kills a process at.
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
ap.add_argument("--no-cut", action="store_true", help="no data.text_lengths: the step compiles once")
ap.add_argument("--eval-table", help="an eval table (eval.every = --eval-every)")
ap.add_argument("--eval-every", type=int, default=0)
ap.add_argument("--marks", action="store_true", help="print MARK lines (compile, eval, saving)")
ap.add_argument("--hold-save", type=int, default=None,
                help="process 0's finalize of this step's checkpoint (before its folder is renamed) pauses 60 s")
ap.add_argument("--linger", type=float, default=0.0, help="after RESULT, wait this long before exiting")
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.xla_flags import cpu_flags  # noqa: E402

os.environ["XLA_FLAGS"] = cpu_flags(args.devices)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxsora.parallel.distributed import initialize  # noqa: E402
from jaxsora.train.run import agent  # noqa: E402
from tests.multiprocess_cache import share_compilation_cache  # noqa: E402

share_compilation_cache()
initialize(before_connect=agent.start)  # as `python -m jaxsora.train`: a multi-process trainer gets its parent
import jax  # noqa: E402

from jaxsora.train.run.loop import NonFiniteError, RunOptions, train  # noqa: E402
from tests.train.common import CUT_LENGTHS, small_config  # noqa: E402
from tests.train.fake_loader import FakeLoader  # noqa: E402

# the captions cut (CUT_LENGTHS): the processes of a multi-process run agree on one length each step
cfg = small_config(args.outputs, max_steps=args.max_steps, ckpt_every=args.ckpt_every,
                   mesh=tuple(int(x) for x in args.mesh.split(",")), text_lengths=() if args.no_cut else CUT_LENGTHS)
if args.watchdog_min is not None:
    cfg.train.watchdog_min_seconds = args.watchdog_min
if args.eval_table:  # one small bucket (images at demo32), one timestep: a short eval with its collectives
    cfg.eval.update(dict(table=args.eval_table, every=args.eval_every, num_timesteps=1, decode_threads=1,
                         at_end=False))
    cfg.eval.bucket_config = {"demo32": {1: (1.0, 1)}}


def mark(*what):
    sys.stdout.write(" ".join(["MARK", *map(str, what)]) + "\n")  # one write: a line of its own
    sys.stdout.flush()


if args.marks:
    import time

    from jaxsora.checkpoint.save import Checkpointer
    from jaxsora.train.eval.loss import Evaluator
    from jaxsora.train.plan import memory

    compile_plan, evaluate, finalized = memory.compile_plan, Evaluator.evaluate, Checkpointer._on_finalized

    def marked_compile(*a, **k):
        mark("compile")
        return compile_plan(*a, **k)

    def marked_evaluate(self, state):
        mark("eval", int(jax.device_get(state.step)))
        return evaluate(self, state)

    def held_finalize(self):
        step = self._pending.step if self._pending is not None else None
        if step is not None and step == args.hold_save:
            mark("saving", step)
            time.sleep(60)
        return finalized(self)

    memory.compile_plan, Evaluator.evaluate, Checkpointer._on_finalized = (marked_compile, marked_evaluate,
                                                                           held_finalize)


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
if args.linger:
    import time

    time.sleep(args.linger)
