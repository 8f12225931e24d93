"""`python -m jaxsora.runs [OUTPUTS]`: the training runs of an outputs folder, one line each.

For every run folder under OUTPUTS (or `--outputs OUTPUTS`, as `serve` and `cluster preflight` name
it; default `outputs/`; a folder with `checkpoints/` or
`metrics.jsonl`): its experiment number (the leading digits of `NNN-name` folders), the config file it was
first started with (`<run>/invocations.jsonl` records every start's command line), the config's
experiment name, whether it is running (its `run.lock` names a live process on this host, or a
process on another host), the newest logged step and loss, the newest validation loss, the newest
complete checkpoint and the wandb run id. Reads only small files (no arrays), so it is instant on
a shared filesystem. `--json` prints the same as JSON lines.

Experiment numbers (the helpers train, serve and this listing share): a new training run gets the
folder `<outputs>/<NNN>-<experiment>/`, NNN one more than the largest number of the outputs
folder's `NNN-*` entries (zero-padded to 3 digits, more when needed), and a number names a run on
the command line (`--load 656`, `serve --runs 656`: the one `<outputs>/656-*` folder). A number is
claimed before its folder is made, with an atomic `mkdir <outputs>/.run_numbers/<NNN>` — so that two
runs starting together get two numbers even with different experiment names, also on a shared
filesystem — and is never handed out again, even when its run folder is deleted.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from collections.abc import Sequence

from jaxsora.cli import ArgumentParser
from jaxsora.cli import HelpFormatter as _Help
from jaxsora.errors import BadInput, MissingFile, run_cli

PROG = "jaxsora.runs"


INTEGRITY_FILE = "integrity.json"  # jaxsora.checkpoint's completion marker
INVOCATIONS = "invocations.jsonl"  # <run>/invocations.jsonl: one line per start or resume of the run
CLAIMS_DIR = ".run_numbers"  # <outputs>/.run_numbers/<NNN>: the numbers handed out
COMPILATION_CACHE = "jax_cache"  # <outputs>/jax_cache: jax's persistent compilation cache (trainer, sampler)
_NUMBERED = re.compile(r"^(\d+)-")


# --------------------------------------------------------------------------------------------
# experiment numbers
# --------------------------------------------------------------------------------------------
def run_number(name: str) -> int | None:
    """The experiment number of a run folder's name (`656-stdit3-xl2` → 656), or None."""
    m = _NUMBERED.match(os.path.basename(os.path.normpath(str(name))))
    return int(m.group(1)) if m else None


def run_folder_name(number: int, experiment: str) -> str:
    """`656`, `stdit3-xl2` → `656-stdit3-xl2` (3 digits at least)."""
    return f"{int(number):03d}-{experiment}"


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def numbered_runs(outputs: str) -> list[tuple[int, str]]:
    """(number, folder name) of the outputs folder's `NNN-*` folders, by number then name."""
    found = [(run_number(d), d) for d in _listdir(outputs)]
    return sorted((n, d) for n, d in found if n is not None and os.path.isdir(os.path.join(outputs, d)))


def next_run_number(outputs: str) -> int:
    """1 + the largest number among the outputs folder's `NNN-*` entries and the claimed numbers."""
    used = [run_number(d) for d in _listdir(outputs)]
    used += [int(d) for d in _listdir(os.path.join(outputs, CLAIMS_DIR)) if d.isdigit()]
    return max([n for n in used if n is not None], default=0) + 1


def new_run_dir(outputs: str, experiment: str) -> str:
    """Create and return `<outputs>/<NNN>-<experiment>` with the next free number; safe against
    other processes doing the same at the same time (the number is claimed with an atomic mkdir)."""
    experiment = str(experiment)
    if not experiment or os.sep in experiment or (os.altsep and os.altsep in experiment) or experiment in (".", ".."):
        raise BadInput(f"train.experiment {experiment!r} cannot name a run folder (no '/', not empty); "
                       "set another, or give the folder with --run-dir")
    claims = os.path.join(outputs, CLAIMS_DIR)
    os.makedirs(claims, exist_ok=True)
    for _ in range(10000):
        number = next_run_number(outputs)
        try:
            os.mkdir(os.path.join(claims, f"{number:03d}"))
        except FileExistsError:  # another run claimed it since we looked
            continue
        path = os.path.join(outputs, run_folder_name(number, experiment))
        try:
            os.mkdir(path)
        except FileExistsError:  # a folder of that name made by other means: its number is taken now
            continue
        return os.path.abspath(path)
    raise RuntimeError(f"could not claim a run number in {outputs}")


def _names(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    if len(names) > limit:
        names = names[:2] + [f"… ({len(names) - limit + 1} more)"] + names[-(limit - 3):]
    return ", ".join(names)


def find_run(spec, outputs: str, what: str = "run") -> str:
    """A run folder from a path or an experiment number: `656` → the one `<outputs>/656-*` folder
    (any zero-padding: `1` finds `001-x`), or the folder `<outputs>/656`. A number that matches no
    folder, or several, is a user error listing the candidates."""
    spec = str(spec)
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if not spec.isdigit():
        raise MissingFile(f"{what} {spec}: no such folder (and not an experiment number)")
    number = int(spec)
    runs = numbered_runs(outputs)
    found = [os.path.join(outputs, d) for n, d in runs if n == number]
    if os.path.isdir(os.path.join(outputs, spec)):
        found.append(os.path.join(outputs, spec))
    if len(found) == 1:
        return os.path.abspath(found[0])
    if found:
        raise BadInput(f"{what} {spec}: {len(found)} folders in {outputs} have that number: "
                       f"{_names(os.path.basename(f) for f in found)}; give the folder instead")
    if not os.path.isdir(outputs):
        raise MissingFile(f"{what} {spec}: no such folder, and no outputs folder {outputs} to find run {spec} in")
    there = f"its numbered runs: {_names(d for _, d in runs)}" if runs else "it holds no numbered run"
    raise MissingFile(f"{what} {spec}: no run numbered {spec} in {outputs} ({there})")


def _last_json_line(path: str) -> dict | None:
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


# How the trainer's last heartbeat (process 0's) says a run ended → the status shown.
ENDINGS = {"done": "done", "stopped": "stopped: --load it", "failed": "failed", "non-finite": "non-finite stop"}


def _status(run: str) -> str:
    info = _read_json(os.path.join(run, "run.lock"))
    if not info:
        phase = _read_json(os.path.join(run, "heartbeat", "0.json")).get("phase")
        return ENDINGS.get(phase, "stopped")
    if info.get("host") != socket.gethostname():
        return f"running on {info.get('host')}"
    try:
        os.kill(int(info.get("pid", -1)), 0)
    except ProcessLookupError:
        return "died (stale lock)"
    except (PermissionError, ValueError):
        pass
    return f"running (pid {info.get('pid')})"


def record_invocation(run: str, **extra) -> None:
    """Append this start of the run (time, host, pid, cwd, the command line, **extra) to
    `<run>/invocations.jsonl`: how each stage was started stays with its folder (`describe`'s
    config). Called by process 0 once the run folder is its own; a failure to write is one line."""
    line = dict(time=time.time(), host=socket.gethostname(), pid=os.getpid(), cwd=os.getcwd(), argv=list(sys.argv),
                **extra)
    try:
        with open(os.path.join(run, INVOCATIONS), "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as e:
        print(f"[jaxsora] cannot record this start in {run}/{INVOCATIONS}: {e}", file=sys.stderr, flush=True)


def config_of_argv(argv: Sequence[str]) -> str | None:
    """The `--config FILE` (or `--config=FILE`) of a command line, without any `:override` suffix."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _first_config(run: str) -> str | None:
    """The config file the run was first started with, as given (`configs/lambda/stage2.py`)."""
    try:
        with open(os.path.join(run, INVOCATIONS)) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return config_of_argv(first.get("argv") or []) if isinstance(first, dict) else None


def describe(run: str) -> dict:
    """What is known of one run folder, from its small files."""
    name = os.path.basename(os.path.normpath(run))
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
        number=run_number(name), folder=name, path=os.path.abspath(run), config=_first_config(run),
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

    def config(path):  # the file and its folder: configs/lambda/stage2.py → lambda/stage2.py
        return "/".join(path.replace(os.sep, "/").split("/")[-2:]) if path else "-"

    head = (f"{'#':>4}  {'run':<28} {'config':<20} {'status':<20} {'step':>7} {'loss':>8} {'eval':>8} {'ckpt':>7}  "
            f"wandb")
    lines = [head]
    for r in runs:
        lines.append(f"{num(r['number'], 'd'):>4}  {r['folder'][:28]:<28} {config(r.get('config'))[-20:]:<20} "
                     f"{r['status'][:20]:<20} "
                     f"{num(r['step'], 'd'):>7} {num(r['loss'], '.4f'):>8} {num(r['eval_loss'], '.4f'):>8} "
                     f"{num(r['checkpoint_step'], 'd'):>7}  {r['wandb_id'] or '-'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m jaxsora.runs", description=__doc__, formatter_class=_Help)
    ap.add_argument("outputs", nargs="?", default=None, metavar="OUTPUTS",
                    help="the outputs folder (default: outputs)")
    ap.add_argument("--outputs", dest="outputs_opt", metavar="OUTPUTS", default=None,
                    help="the same as OUTPUTS (default: outputs)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    args = ap.parse_args(argv)
    if args.outputs and args.outputs_opt and os.path.normpath(args.outputs) != os.path.normpath(args.outputs_opt):
        raise BadInput(f"two outputs folders given ({args.outputs} and --outputs {args.outputs_opt})")
    args.outputs = args.outputs or args.outputs_opt or "outputs"
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
