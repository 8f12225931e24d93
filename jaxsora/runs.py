"""`python -m jaxsora.runs [OUTPUTS]`: the training runs of an outputs folder, one line each.

For every run folder under OUTPUTS (default `outputs/`; a folder with `checkpoints/` or
`metrics.jsonl`): its experiment number (the leading digits of `NNN-name` folders), the config's
experiment name, whether it is running (its `run.lock` names a live process on this host, or a
process on another host), the newest logged step and loss, the newest validation loss, the newest
complete checkpoint and the wandb run id. Reads only small files (no arrays), so it is instant on
a shared filesystem. `--json` prints the same as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from typing import Optional, Sequence

from jaxsora.errors import MissingFile, run_cli

PROG = "jaxsora.runs"
INTEGRITY_FILE = "integrity.json"  # train.checkpoint's completion marker


def _last_json_line(path: str) -> Optional[dict]:
    """The last complete JSON line of a jsonl file (reads its tail only)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _status(run: str) -> str:
    info = _read_json(os.path.join(run, "run.lock"))
    if not info:
        return "stopped"
    if info.get("host") != socket.gethostname():
        return f"running on {info.get('host')}"
    try:
        os.kill(int(info.get("pid", -1)), 0)
    except ProcessLookupError:
        return "died (stale lock)"
    except (PermissionError, ValueError):
        pass
    return f"running (pid {info.get('pid')})"


def describe(run: str) -> dict:
    """What is known of one run folder, from its small files."""
    name = os.path.basename(os.path.normpath(run))
    m = re.match(r"^(\d+)-", name)
    ckpts = os.path.join(run, "checkpoints")
    steps = []
    if os.path.isdir(ckpts):
        steps = sorted(int(d) for d in os.listdir(ckpts)
                       if d.isdigit() and os.path.isfile(os.path.join(ckpts, d, INTEGRITY_FILE)))
    newest = os.path.join(ckpts, str(steps[-1])) if steps else None
    config = _read_json(os.path.join(newest, "config", "metadata")) if newest else {}
    meta = _read_json(os.path.join(newest, "meta", "metadata")) if newest else {}
    last = _last_json_line(os.path.join(run, "metrics.jsonl")) or {}
    ev = _last_json_line(os.path.join(run, "eval.jsonl")) or {}
    return dict(
        number=int(m.group(1)) if m else None, folder=name, path=os.path.abspath(run),
        experiment=(config.get("train") or {}).get("experiment", name),
        model=(config.get("model") or {}).get("name") if isinstance(config.get("model"), dict) else None,
        status=_status(run), step=last.get("step"), loss=last.get("loss"), epoch=last.get("epoch"),
        eval_step=ev.get("step"), eval_loss=ev.get("eval/loss"), checkpoint=newest,
        checkpoint_step=steps[-1] if steps else None, checkpoints=len(steps), wandb_id=meta.get("wandb_id"))


def list_runs(outputs: str) -> list[dict]:
    if not os.path.isdir(outputs):
        raise MissingFile(f"no such outputs folder: {outputs}")
    runs = []
    for d in sorted(os.listdir(outputs)):
        path = os.path.join(outputs, d)
        if os.path.isdir(path) and (os.path.isdir(os.path.join(path, "checkpoints"))
                                    or os.path.isfile(os.path.join(path, "metrics.jsonl"))):
            runs.append(describe(path))
    runs.sort(key=lambda r: (r["number"] is None, r["number"] or 0, r["folder"]))
    return runs


def format_table(runs: Sequence[dict]) -> str:
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    head = f"{'#':>4}  {'run':<28} {'status':<20} {'step':>7} {'loss':>8} {'eval':>8} {'ckpt':>7}  wandb"
    lines = [head]
    for r in runs:
        lines.append(f"{num(r['number'], 'd'):>4}  {r['folder'][:28]:<28} {r['status'][:20]:<20} "
                     f"{num(r['step'], 'd'):>7} {num(r['loss'], '.4f'):>8} {num(r['eval_loss'], '.4f'):>8} "
                     f"{num(r['checkpoint_step'], 'd'):>7}  {r['wandb_id'] or '-'}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxsora.runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", nargs="?", default="outputs", help="the outputs folder (default: outputs)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    args = ap.parse_args(argv)
    runs = list_runs(args.outputs)
    if args.json:
        for r in runs:
            print(json.dumps(r))
    elif not runs:
        print(f"no runs in {args.outputs}")
    else:
        print(format_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
