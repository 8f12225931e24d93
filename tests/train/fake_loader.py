"""An in-memory stand-in with the VideoLoader interface, for loop tests that need no video files:
batches are a deterministic function of (seed, epoch, index), so resume exactness is checkable."""
import hashlib
import json

import numpy as np

try:
    from jaxsora.data.plan import DataStateMismatch
except ImportError:  # the data package's exception, once it exists
    class DataStateMismatch(ValueError):
        pass


class FakeLoader:
    def __init__(self, *, seed=0, data_parallel_size=1, per_device_batch=1, frames=4, size=(16, 16),
                 steps_per_epoch=5, table_id="fake-v1", process_index=0, process_count=1, nan_from_step=None,
                 text_inputs=None, hang_at_batch=None, nan_process=None):
        self.seed, self.dp, self.bs = seed, data_parallel_size, per_device_batch
        self.text_inputs = text_inputs
        self.pi, self.pc, self.nan_from = process_index, process_count, nan_from_step
        self.nan_process = nan_process  # with nan_from_step: only this process's rows go bad
        self.hang_at = hang_at_batch  # the loader freezes (the reference's PyAV hang) at this batch
        self.served = 0
        self.frames, self.size, self.n = frames, size, steps_per_epoch
        self.epoch = self.index = 0
        self.num_skipped = 0
        self.fp = hashlib.sha1(json.dumps([table_id, seed, data_parallel_size]).encode()).hexdigest()[:16]

    def _batch(self, epoch, index):
        rng = np.random.default_rng([self.seed, epoch, index])
        b = self.bs * self.dp
        t, (h, w) = self.frames, self.size
        grid = np.linspace(-1, 1, w, dtype=np.float32)
        phase = rng.uniform(0, 2, (b, 1, 1, 1, 1)).astype(np.float32)
        video = np.sin(3 * grid[None, None, None, None, :] + phase + 0.3 * np.arange(t)[None, None, :, None, None])
        # uint8, as the real loader gives (the step maps it to [-1, 1])
        video = np.round((np.broadcast_to(video, (b, 3, t, h, w)) + 1) * 127.5).astype(np.uint8)
        # The global batch's last caption is longer: processes hold captions of different lengths
        # (the text cut, data.text_lengths, must agree on one length across them).
        texts = [f"wave {p:.2f}" + (" up" if i == b - 1 else "") for i, p in enumerate(phase.ravel())]
        fps = np.full(b, 24.0, np.float32)
        if self.nan_from is not None and self.served >= self.nan_from:
            share = b // self.pc
            bad = slice(None) if self.nan_process is None else slice(self.nan_process * share,
                                                                     (self.nan_process + 1) * share)
            fps[bad] = np.nan  # a non-finite input → non-finite loss
        full = dict(video=video, text=np.array(texts, object), fps=fps, height=np.full(b, float(h), np.float32),
                    width=np.full(b, float(w), np.float32), num_frames=np.full(b, t, np.int32),
                    row=np.arange(b) + index * b)
        share = b // self.pc  # this host's contiguous slice of the global batch
        out = {k: v[self.pi * share:(self.pi + 1) * share] for k, v in full.items()}
        if self.text_inputs is not None:  # as the real loader: in the loader, not the training thread
            out.update(self.text_inputs(list(out["text"]), out["row"]))
        return dict(out, epoch=epoch, index=index + 1, bucket=("fake", t, h, w))

    def __iter__(self):
        while True:
            while self.index < self.n:
                if self.hang_at is not None and self.served >= self.hang_at:
                    import time

                    while True:
                        time.sleep(3600)
                batch = self._batch(self.epoch, self.index)
                self.index += 1
                self.served += 1
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    def steps_per_epoch(self, epoch=0):
        return self.n

    @property
    def num_rows(self):
        return self.n * self.bs * self.dp

    def describe_plan(self, epoch=0):
        return [(("fake", self.frames, *self.size), self.n, self.bs * self.dp, self.n * self.bs * self.dp)]

    def state(self):
        return dict(epoch=self.epoch, index=self.index, fingerprint=self.fp)

    def restore(self, state, reset=False):
        if reset:
            self.epoch = self.index = 0
            return
        if state["fingerprint"] != self.fp:
            raise DataStateMismatch(f"the data changed since the checkpoint ({state['fingerprint']} → {self.fp})")
        self.epoch, self.index = state["epoch"], state["index"]
