"""Console progress line and optional wandb logging (only process 0 logs).

Once per log interval (`train.log_every` steps, fetched from the device in one transfer), one line
on the console, one line in `<run>/metrics.jsonl` and one wandb log at the interval's last step:
- loss (mean over the interval's applied steps), lr, grad_norm, weight_norm, epoch;
- samples_per_s, tokens_per_s (image tokens), step_time (interval wall / steps), data_time (mean
  wait for the loader per step) and data_share (the loader waits' share of the interval's wall);
- tflops_per_device (model FLOPs per second per device, `train.plan.mfu`) and mfu (that over the device's
  peak; only when the peak is known: a GPU in `train.plan.mfu.PEAK_FLOPS` or `train.peak_flops`);
- time/<res>_<T>x<H>x<W>: the mean step time of the interval's steps of that bucket shape (each
  step's time from its completion, see `train.run.loop`);
- skipped (+ skipped/<reason>), nonfinite_total.

Each evaluation (`train.eval.loss`) writes one line to the console, one to `<run>/eval.jsonl`
({"step", "eval/loss", "eval/loss/<res>_<frames>", "eval/samples/<res>_<frames>",
"eval/loss_by_t/<res>_<frames>" (a list, jsonl only), "eval/skipped", "eval/seconds", "eval/weights"})
and logs its numbers to wandb at that step.

wandb is an optional extra (`pip install 'jaxsora[wandb]'`); `wandb.mode = "offline"` works without a
network, and the run id is stored in each checkpoint so that `--load` logs into the same run. The
wandb run is named after the run folder (`656-stdit3-xl2`); a `wandb.name` of your own gets the
folder's experiment number in front (`656-<name>`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np


def _skipped(counts) -> dict:
    """The loader's skip counts {reason: n} → {"skipped": total, "skipped/<reason>": n, ...}."""
    if not isinstance(counts, dict):
        return dict(skipped=int(counts or 0))
    return dict(skipped=int(sum(counts.values())), **{f"skipped/{k}": int(v) for k, v in sorted(counts.items())})


def _skipped_text(summary: dict) -> str:
    parts = [f"{k.split('/', 1)[1]} {v}" for k, v in summary.items() if k.startswith("skipped/") and v]
    return f"{summary['skipped']}" + (f" ({', '.join(parts)})" if parts else "")


def format_duration(seconds: float) -> str:
    """3725 → "1h02m"; 95 → "1m35s"; 7 → "7s"."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def run_name(outdir: str, name: str | None = None) -> str:
    """The wandb run name: the run folder's name (`656-stdit3-xl2`), or `name` with the folder's
    experiment number in front (`656-<name>`, unless it starts with it already)."""
    from jaxsora.runs import run_number

    folder = os.path.basename(os.path.normpath(outdir))
    if not name:
        return folder
    number = run_number(folder)
    if number is None or run_number(name) == number:
        return name
    return f"{folder.split('-', 1)[0]}-{name}"


class MetricLogger:
    def __init__(self, config, outdir: str, *, resume_id: str | None = None, enabled: bool = True,
                 peak_flops: float | None = None, num_devices: int = 1, total_steps: int | None = None,
                 epochs: int | None = None):
        self.enabled = enabled
        self.total_steps, self.epochs = total_steps, epochs  # for "step k/N", "epoch e/E" and the ETA
        self.outdir = outdir
        self.run = None
        self.run_id = resume_id
        self.peak_flops, self.num_devices = peak_flops, max(1, int(num_devices))
        self._t0 = time.time()
        self._jsonl = open(os.path.join(outdir, "metrics.jsonl"), "a") if enabled else None  # noqa: SIM115 (the run's log)
        self._eval_jsonl = None
        wcfg = config.get("wandb", None)
        if enabled and wcfg is not None and wcfg.get("enabled", False):
            try:
                import wandb
            except ImportError as e:
                raise ImportError("wandb.enabled is set but wandb is not installed: "
                                  "pip install 'jaxsora[wandb]'") from e
            self.run = wandb.init(
                project=wcfg.get("project", "jaxsora"), name=run_name(outdir, wcfg.get("name")),
                mode=wcfg.get("mode", "online"), dir=outdir, id=resume_id, resume="allow" if resume_id else None,
                config=json.loads(config.to_json_best_effort()),
            )
            self.run_id = self.run.id

    def log(self, rows: Sequence[dict], wall: float) -> dict | None:
        """rows: one dict per step of the interval (device metrics already fetched, plus the host's
        data_time, samples, tokens, epoch, bucket, skipped, nonfinite_total, and where known flops
        (model FLOPs of the step), bucket_name and step_time); wall: the interval's seconds. Prints
        one line, appends one metrics.jsonl line, logs to wandb; returns the logged summary."""
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
        summary["data_share"] = min(1.0, sum(float(r["data_time"]) for r in rows) / wall)
        if all(r.get("flops") is not None for r in rows):
            per_device = sum(float(r["flops"]) for r in rows) / wall / self.num_devices
            summary["tflops_per_device"] = per_device / 1e12
            if self.peak_flops:
                summary["mfu"] = per_device / self.peak_flops
        times: dict = {}
        for r in rows:
            if r.get("step_time") is not None and r.get("bucket_name"):
                times.setdefault(r["bucket_name"], []).append(float(r["step_time"]))
        summary.update({f"time/{k}": float(np.mean(v)) for k, v in sorted(times.items())})
        mfu = f" mfu {100 * summary['mfu']:.1f}%" if "mfu" in summary else ""
        total = f"/{self.total_steps}" if self.total_steps else ""
        if self.total_steps and summary["step"] < self.total_steps:
            summary["eta_s"] = (self.total_steps - summary["step"]) * summary["step_time"]
        eta = f" | ETA {format_duration(summary['eta_s'])}" if "eta_s" in summary else ""
        epoch = f"{summary['epoch']}" + (f"/{self.epochs}" if self.epochs else "")
        print(f"step {summary['step']:>6}{total} | loss {summary['loss']:.4f} | lr {summary['lr']:.2e} "
              f"| grad {summary['grad_norm']:.3f} | weight {summary['weight_norm']:.2f} "
              f"| {summary['samples_per_s']:.2f} samples/s {summary['tokens_per_s']:.0f} tok/s{mfu} "
              f"| step {summary['step_time']:.3f}s data {summary['data_time']:.3f}s "
              f"({100 * summary['data_share']:.0f}%) "
              f"| skipped {_skipped_text(summary)} rejected {summary['nonfinite_total']} "
              f"| epoch {epoch} {last.get('bucket', '')}{eta}", flush=True)
        self._jsonl.write(json.dumps(summary) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in summary.items() if k != "step"}, step=summary["step"])
        return summary

    def log_eval(self, result: dict) -> None:
        """One evaluation (`train.eval.loss.Evaluator.evaluate`): a console line, an eval.jsonl line and
        wandb at its step (numbers only)."""
        if not self.enabled:
            return
        step = int(result["step"])
        parts = []
        for k, v in result.items():
            if k.startswith("eval/loss/"):
                name = k.split("/", 2)[2]
                parts.append(f"{name} {v:.4f} ({result.get(f'eval/samples/{name}', 0)})")
        skipped = f" | left out {result['eval/skipped']}" if result.get("eval/skipped") else ""
        print(f"eval {step:>6} | loss {result['eval/loss']:.4f} ({result.get('eval/weights', 'params')}) | "
              + " ".join(parts) + f"{skipped} | {result.get('eval/seconds', 0.0):.1f}s", flush=True)
        if self._eval_jsonl is None:
            self._eval_jsonl = open(os.path.join(self.outdir, "eval.jsonl"), "a")  # noqa: SIM115 (the run's log)
        self._eval_jsonl.write(json.dumps(result) + "\n")
        self._eval_jsonl.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in result.items() if k != "step" and isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._eval_jsonl:
            self._eval_jsonl.close()
        if self.run is not None:
            self.run.finish()
        sys.stdout.flush()
