"""The training loop's own cost: time per step of `jaxsora.train.run.loop.train` with metrics fetched
and logged every step (`train.log_every=1`) against every 1000 steps (logging effectively off).

    python bench/loop.py [--steps 80] [--devices 1] [--model demo] [--size 8x32x32]

Each setting runs the real loop three times (a warm-up that fills the compilation cache, then N/4
and N steps; an in-memory loader hands out uint8
batches) and the time per step is the difference over the difference in steps, so start-up,
compiles and saves cancel out. The loop never waits for a step it just dispatched (at most
`MAX_IN_FLIGHT` are queued) and fetches metrics once per log interval; the two columns should be
about equal.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


class MemoryLoader:
    """Endless uint8 batches of one bucket, with the loader interface the loop uses."""

    def __init__(self, dp, per_device_batch, text_inputs, size=(8, 64, 64)):
        import numpy as np

        self.dp, self.b, self.size, self.text_inputs = dp, per_device_batch, size, text_inputs
        rng = np.random.default_rng(0)
        n = dp * per_device_batch
        t, h, w = size
        texts = [f"sample {i}" for i in range(n)]
        self.batch = dict(video=rng.integers(0, 256, (n, 3, t, h, w), dtype=np.uint8), text=np.array(texts, object),
                          fps=np.full(n, 24.0, np.float32), height=np.full(n, float(h), np.float32),
                          width=np.full(n, float(w), np.float32), num_frames=np.full(n, t, np.int32),
                          row=np.arange(n), **text_inputs(texts, np.arange(n)))
        self.epoch = self.index = self.num_skipped = 0

    def __iter__(self):
        while True:
            self.index += 1
            yield dict(self.batch, epoch=0, index=self.index, bucket=("mem", *self.size))

    def describe_plan(self, epoch=0):
        return [(("mem", *self.size), 1000, self.dp * self.b, 1000)]

    @property
    def num_rows(self):
        return 1000

    def state(self):
        return dict(epoch=0, index=self.index, fingerprint="memory")

    def restore(self, state, reset=False):
        pass


def run(steps: int, log_every: int, out: str, args) -> float:
    from configs import demo
    from jaxsora.train.run.loop import RunOptions, train

    c = demo.get_config()
    c.data.table = os.path.join(HERE, "..", "pyproject.toml")  # any file: the memory loader ignores it
    c.model.name = args.model
    c.train.update(dict(outputs=out, experiment=f"log{log_every}-{steps}", max_steps=steps, ckpt_every=10**6,
                        log_every=log_every))
    t0 = time.perf_counter()
    size = tuple(int(v) for v in args.size.split("x"))
    train(c, RunOptions(), loader_factory=lambda cfg, dp, ti: MemoryLoader(dp, args.batch, ti, size))
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, default=2, help="per device")
    ap.add_argument("--size", default="8x32x32", help="pixel frames×H×W of the batches")
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(HERE, ".."))
    import io
    from contextlib import redirect_stdout

    out = tempfile.mkdtemp(prefix="jaxsora-bench-loop-")
    per_step = {}
    for log_every in (1, 1000):
        with redirect_stdout(io.StringIO()):
            run(2, log_every, out, args)  # warm-up: the compile lands in the persistent cache
            short = run(args.steps // 4, log_every, out, args)
            long = run(args.steps, log_every, out, args)
        per_step[log_every] = (long - short) / (args.steps - args.steps // 4)
    print(f"\nthe training loop, {args.model} model, batch {args.batch} per device × {args.devices} device(s)")
    print(f"{'metrics fetched and logged':<34} {'s per step':>10}")
    print(f"{'every step (log_every=1)':<34} {per_step[1]:>10.4f}")
    print(f"{'every 1000 steps':<34} {per_step[1000]:>10.4f}")
    print(f"ratio: {per_step[1] / per_step[1000]:.3f}")


if __name__ == "__main__":
    main()
