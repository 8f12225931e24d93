"""`python -m jaxsora.serve --preset low4s --runs 656 [657 ...]`: the inference server.

It follows training runs from another machine (or beside them): for each new checkpoint of each
run it restores only the weights (EMA by default; never the optimizer state, so a mirror of the
run folder that leaves the optimizer out works), samples the validation prompts with the preset,
writes the videos under `<run>/samples/<preset>/<step>/` and logs them into the training's own
wandb run (the run id stored in the checkpoint, resumed) as `eval_<preset>/<i>` against the step
metric `eval_<preset>_step` = the checkpoint's step — the Lambda speed run's inference server.

A run is a folder (`outputs/656-stdit3-xl2`) or an experiment number (`656`: the folder
`<outputs>/656-*`, or `<outputs>/656`). Presets (the Lambda server's, `scripts/inference-server.py`):

    low4s    360p  9:16  4s (102 frames)   batch 8
    high4s   720p  9:16  4s (102 frames)   batch 2
    low16s   360p  9:16  16s (408 frames)  batch 2
    demo     32×32       8 frames           batch 4   (the CPU demo, `make demo`)

plus, from `--presets-file X.json`, any {name: {SampleSettings field: value}} (e.g. a 32×32 preset
for the CPU demo: {"demo": {"image_size": [32, 32], "num_frames": 8, "fps": 8}}). Every preset uses
Open-Sora's inference defaults otherwise (30 steps, CFG 7, aesthetic score 6.5).

A checkpoint is sampled once it is complete (its `integrity.json` is there; one still being
written or copied is retried at the next poll); one that vanished before it was read (the
training's keep policy) is skipped with a note, and so is a step folder whose integrity record
names another step (a copied or renamed folder holds that step's weights, not its name's). Each
pass prints one line per run: the complete checkpoints seen, sampled, done before, waiting for
completion and skipped. `<save root>/serve_state.json` records what was
done per run, preset and step, so a restarted server redoes nothing. `--interval` sets the poll
period; `--once` does one pass and exits.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

from jaxsora.cli import ArgumentParser, hidden_aliases
from jaxsora.cli import HelpFormatter as _Help
from jaxsora.errors import BadInput, MissingFile, run_cli
from jaxsora.runs import find_run

PROG = "jaxsora.serve"
# Lambda speed run scripts/inference-server.py: resolution × duration × batch size.
PRESETS = {
    "low4s": dict(resolution="360p", aspect_ratio="9:16", num_frames="4s", batch_size=8),
    "high4s": dict(resolution="720p", aspect_ratio="9:16", num_frames="4s", batch_size=2),
    "low16s": dict(resolution="360p", aspect_ratio="9:16", num_frames="16s", batch_size=2),
    # The CPU demo's clips (configs/demo.py: 32×32, 8 frames at 8 fps).
    "demo": dict(image_size=(32, 32), num_frames=8, fps=8, batch_size=4),
}
STATE_FILE = "serve_state.json"
INTEGRITY_FILE = "integrity.json"  # jaxsora.checkpoint's completion marker


# --------------------------------------------------------------------------------------------
# runs and their checkpoints
# --------------------------------------------------------------------------------------------
def resolve_run(spec: str, outputs: str) -> str:
    """A run folder from a path or an experiment number (`656` → `<outputs>/656-*` or `<outputs>/656`)."""
    return find_run(spec, outputs, what="run")


def _checkpoints_root(run: str) -> str:
    sub = os.path.join(run, "checkpoints")
    return sub if os.path.isdir(sub) else run


def _complete(path: str) -> bool:
    """A checkpoint folder that is fully there: its completion marker, or — written before
    completion markers existed — a `meta` item without the "checkpoint_format" key."""
    if os.path.isfile(os.path.join(path, INTEGRITY_FILE)):
        return True
    try:
        with open(os.path.join(path, "meta", "metadata")) as f:
            return "checkpoint_format" not in json.load(f)
    except (OSError, ValueError):  # still being written or copied
        return False


def _steps(run: str, complete: bool) -> list[int]:
    root = _checkpoints_root(run)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and _complete(os.path.join(root, n)) == complete)


def complete_steps(run: str) -> list[int]:
    """Steps of the run whose checkpoint is complete; one still being written is left for later."""
    return _steps(run, True)


def waiting_steps(run: str) -> list[int]:
    """Steps whose folder is there but not complete yet (being written or copied)."""
    return _steps(run, False)


def recorded_step(step_path: str) -> int | None:
    """The step a folder's integrity record names (None: no record, or one without a step)."""
    try:
        with open(os.path.join(step_path, INTEGRITY_FILE)) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return int(step) if isinstance(step, int) else None


def step_dir(run: str, step: int) -> str:
    return os.path.join(_checkpoints_root(run), str(step))


def read_meta(step_path: str) -> dict:
    """The checkpoint's `meta` item (wandb run id, ...) and the run config's wandb group."""
    out = {}
    for item in ("meta", "config"):
        f = os.path.join(step_path, item, "metadata")
        try:
            with open(f) as fh:
                out[item] = json.load(fh)
        except (OSError, ValueError):
            out[item] = {}
    return out


# --------------------------------------------------------------------------------------------
# state and logging
# --------------------------------------------------------------------------------------------
class ServeState:
    """{run folder: {preset: {step: {"videos": [...], "status": "done"|"vanished"}}}}, saved atomically."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict = {}
        if os.path.isfile(path):
            with open(path) as f:
                self.data = json.load(f)

    def done(self, run: str, preset: str, step: int) -> bool:
        return str(step) in self.data.get(run, {}).get(preset, {})

    def record(self, run: str, preset: str, step: int, entry: dict) -> None:
        self.data.setdefault(run, {}).setdefault(preset, {})[str(step)] = entry
        tmp = self.path + ".tmp"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


class WandbSink:
    """Logs a checkpoint's videos into the training's own wandb run (resumed by id)."""

    def __init__(self, mode: str | None = None):
        self.mode = mode

    def log(self, run_dir: str, meta: dict, preset: str, step: int, paths: Sequence[str],
            prompts: Sequence[str]) -> str | None:
        wandb_id = meta.get("meta", {}).get("wandb_id")
        wcfg = meta.get("config", {}).get("wandb", {}) or {}
        if not wandb_id:
            return None
        import wandb

        run = wandb.init(project=wcfg.get("project", "jaxsora"), id=wandb_id, resume="allow", dir=run_dir,
                         mode=self.mode or wcfg.get("mode", "online"), reinit="finish_previous")
        try:
            step_key = f"eval_{preset}_step"
            run.define_metric(step_key)
            run.define_metric(f"eval_{preset}/*", step_metric=step_key)
            media = {f"eval_{preset}/{i}": wandb.Video(p, caption=prompts[i], format="mp4")
                     if p.endswith(".mp4") else wandb.Image(p, caption=prompts[i]) for i, p in enumerate(paths)}
            run.log({**media, step_key: step})
        finally:
            run.finish()
        return wandb_id


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ServeOptions:
    preset: str
    runs: list
    outputs: str = "outputs"
    prompts: list | None = None  # default: the run's data folder prompts.txt, else built-in
    ema: bool = True
    vae: str | None = None
    text_encoder: str | None = None
    interval: float = 60.0
    once: bool = False
    wandb: bool = True
    wandb_mode: str | None = None
    presets_file: str | None = None
    max_polls: int | None = None  # tests: stop after this many passes


# Default validation prompts (the Lambda server reads ./samples/prompts.txt; give --prompt-path).
DEFAULT_PROMPTS = [
    "a red circle moving right",
    "a drone shot of waves crashing against rugged cliffs at sunset",
]


def load_presets(presets_file: str | None) -> dict:
    presets = dict(PRESETS)
    if presets_file:
        if not os.path.isfile(presets_file):
            raise MissingFile(f"--presets-file: no such file {presets_file}")
        try:
            with open(presets_file) as f:
                extra = json.load(f)
        except ValueError as e:
            raise BadInput(f"--presets-file {presets_file}: not JSON ({e})") from None
        if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
            raise BadInput(f"--presets-file {presets_file}: expected {{name: {{setting: value}}}}")
        presets.update(extra)
    return presets


def preset_values(preset: str, presets: dict) -> dict:
    """The preset's settings, checked against SampleSettings' fields."""
    from jaxsora.infer import SampleSettings

    if preset not in presets:
        raise BadInput(f"--preset {preset!r}: not a preset; available: {sorted(presets)}")
    fields = {f.name for f in dataclasses.fields(SampleSettings)}
    values = dict(presets[preset])
    bad = sorted(set(values) - fields)
    if bad:
        raise BadInput(f"preset {preset!r}: unknown setting(s) {bad}; settings: {sorted(fields)}")
    if values.get("image_size") is not None:
        values["image_size"] = tuple(values["image_size"])
    elif "resolution" in values:  # a named size wins over the run config's sample size
        values["image_size"] = None
    SampleSettings(**values)  # a bad value fails here, before any run is read
    return values


def default_sampler(opts: ServeOptions, values: dict) -> Callable:
    """(step folder, prompts, save dir, meta) → media paths, with jaxsora.infer. The preset's
    settings go over the run config's `sample` section (what the run's captions look like: its
    aesthetic/motion scores), then Open-Sora's defaults."""
    from jaxsora.infer import Pipeline, write_samples

    def sample(step_path: str, prompts: list, save_dir: str, meta: dict) -> list:
        pipe = Pipeline.load(step_path, ema=opts.ema, vae=opts.vae, text_encoder=opts.text_encoder)
        settings = pipe.default_settings(**values)
        videos = pipe.generate(prompts, settings, progress=False)
        return write_samples(videos, prompts, settings, save_dir, {**meta, "checkpoint": step_path,
                                                                    "step": pipe.step})

    return sample


def serve(opts: ServeOptions, *, sampler: Callable | None = None, sink=None, log=print) -> dict:
    """Poll the runs; sample and log every new complete checkpoint. Returns the state's data."""
    presets = load_presets(opts.presets_file)
    values = preset_values(opts.preset, presets)
    runs = [resolve_run(str(r), opts.outputs) for r in opts.runs]
    prompts = list(opts.prompts or DEFAULT_PROMPTS)
    sampler = sampler or default_sampler(opts, values)
    sink = sink if sink is not None else (WandbSink(opts.wandb_mode) if opts.wandb else None)
    states = {run: ServeState(os.path.join(run, "samples", STATE_FILE)) for run in runs}
    polls = 0
    while True:
        for run in runs:
            state = states[run]
            seen, sampled, before, skipped = complete_steps(run), [], 0, []
            for step in seen:
                if state.done(run, opts.preset, step):
                    before += 1
                    continue
                path = step_dir(run, step)
                named = recorded_step(path)
                if named is not None and named != step:  # a copied or renamed folder: its weights are another step's
                    skipped.append(f"{step} (its integrity.json is of step {named}: a copied or renamed folder)")
                    continue
                save_dir = os.path.join(run, "samples", opts.preset, str(step))
                t0 = time.monotonic()
                try:
                    meta = read_meta(path)
                    paths = sampler(path, prompts, save_dir, dict(preset=opts.preset, run=run))
                except Exception as e:  # noqa: BLE001 — removed by the training's keep policy while we read it?
                    if os.path.isdir(path):
                        raise
                    log(f"[serve] {os.path.basename(run)} step {step}: checkpoint vanished before it was read ({e})")
                    state.record(run, opts.preset, step, dict(status="vanished"))
                    skipped.append(f"{step} (vanished)")
                    continue
                logged = sink.log(run, meta, opts.preset, step, paths, prompts) if sink is not None else None
                state.record(run, opts.preset, step, dict(status="done", videos=[os.path.relpath(p, run)
                                                                                for p in paths],
                                                          wandb_id=logged, seconds=round(time.monotonic() - t0, 1)))
                log(f"[serve] {os.path.basename(run)} step {step}: {len(paths)} video(s) → {save_dir}"
                    + (f", logged to wandb run {logged}" if logged else ""))
                sampled.append(step)
            log(_pass_line(run, polls + 1, seen, sampled, before, waiting_steps(run), skipped))
        polls += 1
        if opts.once or (opts.max_polls is not None and polls >= opts.max_polls):
            return {run: states[run].data.get(run, {}) for run in runs}
        time.sleep(opts.interval)


def _pass_line(run, number, seen, sampled, before, waiting, skipped) -> str:
    """One line per run per pass: what the server saw and did, also when it did nothing."""
    def steps(xs):
        return ", ".join(str(x) for x in xs)

    parts = [f"{len(seen)} complete checkpoint(s)",
             f"sampled {len(sampled)}" + (f" ({steps(sampled)})" if sampled else ""), f"done before {before}"]
    if waiting:
        parts.append(f"waiting for completion: {steps(waiting)}")
    if skipped:
        parts.append(f"skipped: {'; '.join(skipped)}")
    return f"[serve] {os.path.basename(run)} pass {number}: " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m jaxsora.serve", description=__doc__, formatter_class=_Help)
    ap.add_argument("--preset", required=True, help=f"sampling preset: {', '.join(PRESETS)} or one of --presets-file")
    hidden_aliases(ap, ap.add_argument("--runs", nargs="+", required=True, help="run folders or experiment numbers"),
                   "--expnums")  # the Lambda server's name
    ap.add_argument("--outputs", default="outputs", help="where experiment numbers are looked up (default: outputs)")
    ap.add_argument("--prompt-path", help="validation prompts, one a line (default: two built-in prompts)")
    ap.add_argument("--no-ema", action="store_true",
                    help="sample the trained params instead of the EMA weights (default: the EMA)")
    ap.add_argument("--vae", help="VAE path (default: the run config's)")
    ap.add_argument("--text-encoder", help="text encoder path (default: the run config's)")
    ap.add_argument("--interval", type=float, default=60.0, help="seconds between polls (default 60)")
    ap.add_argument("--once", action="store_true", help="one pass over the runs, then exit")
    ap.add_argument("--no-wandb", action="store_true", help="write the videos only")
    ap.add_argument("--wandb-mode", choices=["online", "offline"], help="default: the run config's wandb.mode")
    ap.add_argument("--presets-file", help="JSON {name: {setting: value}} with more presets (default: none)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks for user errors too")
    args = ap.parse_args(argv)
    if args.interval <= 0:
        raise BadInput(f"--interval must be > 0, got {args.interval}")
    prompts = None
    if args.prompt_path:
        if not os.path.isfile(args.prompt_path):
            raise MissingFile(f"--prompt-path: no such file {args.prompt_path}")
        with open(args.prompt_path) as f:
            prompts = [ln.strip() for ln in f if ln.strip()]
        if not prompts:
            raise BadInput(f"--prompt-path {args.prompt_path} holds no prompt")
    opts = ServeOptions(preset=args.preset, runs=args.runs, outputs=args.outputs, prompts=prompts,
                        ema=not args.no_ema, vae=args.vae, text_encoder=args.text_encoder, interval=args.interval,
                        once=args.once, wandb=not args.no_wandb, wandb_mode=args.wandb_mode,
                        presets_file=args.presets_file)
    serve(opts)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
