"""Console progress line and optional wandb logging (only process 0 logs).

Every `train.log_every` steps: loss (mean since the last line), lr, grad norm, weight norm,
samples/s, tokens/s, step time, data-wait time, skipped samples, non-finite steps. wandb is an
optional extra (`pip install 'jaxsora[wandb]'`); `wandb.mode = "offline"` works without a network,
and the run id is stored in each checkpoint so that `--load` logs into the same run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import numpy as np


class MetricLogger:
    def __init__(self, config, outdir: str, *, resume_id: Optional[str] = None, enabled: bool = True):
        self.enabled = enabled
        self.every = int(config.train.get("log_every", 10))
        self.outdir = outdir
        self.buffer: list[dict] = []
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

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {k: (float(v) if isinstance(v, (int, float, np.floating, np.integer, np.ndarray)) else v)
               for k, v in metrics.items()}
        row["step"] = step
        self.buffer.append(row)
        if step % self.every and step != 1:
            return
        rows, self.buffer = self.buffer, []
        mean = lambda k: float(np.mean([r[k] for r in rows if isinstance(r.get(k), float)]))  # noqa: E731
        line = (f"step {step:>6} | loss {mean('loss'):.4f} | lr {row['lr']:.2e} | grad {mean('grad_norm'):.3f} "
                f"| weight {row['weight_norm']:.2f} | {mean('samples_per_s'):.2f} samples/s "
                f"{mean('tokens_per_s'):.0f} tok/s | step {mean('step_time'):.3f}s data {mean('data_time'):.3f}s "
                f"| skipped {int(row.get('skipped', 0))} nonfinite {int(row.get('nonfinite_total', 0))} "
                f"| epoch {int(row.get('epoch', 0))} {row.get('bucket', '')}")
        print(line, flush=True)
        summary = {k: mean(k) for k in ("loss", "grad_norm", "samples_per_s", "tokens_per_s", "step_time", "data_time")}
        summary.update(step=step, lr=row["lr"], weight_norm=row["weight_norm"], skipped=row.get("skipped", 0),
                       nonfinite_total=row.get("nonfinite_total", 0), epoch=row.get("epoch", 0),
                       wall=time.time() - self._t0)
        self._jsonl.write(json.dumps(summary) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in summary.items() if k != "step"}, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self.run is not None:
            self.run.finish()
        sys.stdout.flush()
