"""Console progress line and optional wandb logging (only process 0 logs).

Once per log interval (`train.log_every` steps, fetched from the device in one transfer): loss
(mean over the interval's applied steps), lr, grad norm, weight norm, samples/s, tokens/s, step
time, data-wait time, skipped samples, non-finite steps. wandb is an optional extra
(`pip install 'jaxsora[wandb]'`); `wandb.mode = "offline"` works without a network, and the run id
is stored in each checkpoint so that `--load` logs into the same run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np


def _skipped(counts) -> dict:
    """The loader's skip counts {reason: n} → {"skipped": total, "skipped/<reason>": n, ...}."""
    if not isinstance(counts, dict):
        return dict(skipped=int(counts or 0))
    return dict(skipped=int(sum(counts.values())), **{f"skipped/{k}": int(v) for k, v in sorted(counts.items())})


def _skipped_text(summary: dict) -> str:
    parts = [f"{k.split('/', 1)[1]} {v}" for k, v in summary.items() if k.startswith("skipped/") and v]
    return f"{summary['skipped']}" + (f" ({', '.join(parts)})" if parts else "")


class MetricLogger:
    def __init__(self, config, outdir: str, *, resume_id: Optional[str] = None, enabled: bool = True):
        self.enabled = enabled
        self.outdir = outdir
        self.run = None
        self.run_id = resume_id
        self._t0 = time.time()
        self._jsonl = open(os.path.join(outdir, "metrics.jsonl"), "a") if enabled else None
        wcfg = config.get("wandb", None)
        if enabled and wcfg is not None and wcfg.get("enabled", False):
            try:
                import wandb
            except ImportError as e:
                raise ImportError("wandb.enabled is set but wandb is not installed: "
                                  "pip install 'jaxsora[wandb]'") from e
            self.run = wandb.init(
                project=wcfg.get("project", "jaxsora"), name=wcfg.get("name") or config.train.get("experiment"),
                mode=wcfg.get("mode", "online"), dir=outdir, id=resume_id, resume="allow" if resume_id else None,
                config=json.loads(config.to_json_best_effort()),
            )
            self.run_id = self.run.id

    def log(self, rows: Sequence[dict], wall: float) -> Optional[dict]:
        """rows: one dict per step of the interval (device metrics already fetched, plus the host's
        data_time, samples, tokens, epoch, bucket, skipped, nonfinite_total); wall: the interval's
        seconds. Prints one line, appends one metrics.jsonl line, logs to wandb."""
        if not self.enabled or not rows:
            return None
        last = rows[-1]
        good = [r for r in rows if not r["nonfinite"]] or rows

        def mean(k, of=rows):
            return float(np.mean([float(r[k]) for r in of]))

        wall = max(wall, 1e-9)
        summary = dict(
            step=int(last["step"]), loss=mean("loss", good), grad_norm=mean("grad_norm", good), lr=float(last["lr"]),
            weight_norm=float(last["weight_norm"]), samples_per_s=sum(r["samples"] for r in rows) / wall,
            tokens_per_s=sum(r["tokens"] for r in rows) / wall, step_time=wall / len(rows),
            data_time=mean("data_time"), **_skipped(last.get("skipped")),
            nonfinite_total=int(last.get("nonfinite_total", 0)), epoch=int(last.get("epoch", 0)),
            wall=time.time() - self._t0)
        print(f"step {summary['step']:>6} | loss {summary['loss']:.4f} | lr {summary['lr']:.2e} "
              f"| grad {summary['grad_norm']:.3f} | weight {summary['weight_norm']:.2f} "
              f"| {summary['samples_per_s']:.2f} samples/s {summary['tokens_per_s']:.0f} tok/s "
              f"| step {summary['step_time']:.3f}s data {summary['data_time']:.3f}s "
              f"| skipped {_skipped_text(summary)} rejected {summary['nonfinite_total']} "
              f"| epoch {summary['epoch']} {last.get('bucket', '')}", flush=True)
        self._jsonl.write(json.dumps(summary) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in summary.items() if k != "step"}, step=summary["step"])
        return summary

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self.run is not None:
            self.run.finish()
        sys.stdout.flush()
