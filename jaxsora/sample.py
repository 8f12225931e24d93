"""`python -m jaxsora.sample CKPT`: text/image-to-video with a jaxsora checkpoint, with Open-Sora
1.2's inference options (as Open-Sora's `scripts/inference.py` takes them).

    python -m jaxsora.sample outputs/demo --prompt "a red circle moving right" --image-size 32 32 --num-frames 8
    python -m jaxsora.sample ckpt/ --vae pretrained_models/OpenSora-VAE-v1.2 \\
        --text-encoder pretrained_models/t5-v1_1-xxl --prompt-path prompts.txt \\
        --num-frames 4s --resolution 720p --aspect-ratio 9:16 --output samples/

CKPT: a training run folder, its checkpoints/, one step folder, or a `convert from-torch` output
(which has no run config: then --vae and --text-encoder are required). The run config supplies the
VAE, the text encoder, the timestep-shift switch and — when no size/length/fps flag is given — the
sample size of its `sample` section; otherwise Open-Sora's defaults (240p 9:16, 51 frames, 24 fps,
30 steps, CFG 7.0, aesthetic score 6.5). Each video is written as sample_NNNN.mp4 (one frame:
.png) with a sample_NNNN.json sidecar (prompts as given and as fed, seed, settings, checkpoint).

Seeds: the noise of each prompt depends only on --seed, the prompt text and how many times that
same prompt came before it (so a prompt gives the same video alone or among others).

Multi-host: every process runs the same command (jax.distributed from --coordinator /
--num-processes / --process-id, JAX_* variables or the detected cluster, as `jaxsora.train`); the
mesh spans every process's devices, all of them sample process 0's checkpoint step, and process 0
writes the files (the same files as one process with as many devices).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from jaxsora.cli import ArgumentParser, hidden_aliases
from jaxsora.cli import HelpFormatter as _Help
from jaxsora.errors import BadInput, MissingFile, run_cli

_UNSET = object()  # --aes/--flow not given (None means "append nothing")


def _score(v: str):
    if v.lower() in ("none", "off", ""):
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {v!r}") from None


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The "checkpoint" group: what to open and how (`jaxsora.sample` and `jaxsora.app` alike)."""
    g = ap.add_argument_group("checkpoint")
    g.add_argument("ckpt", nargs="?", metavar="CKPT_OR_CONFIG",
                   help="run folder, checkpoints/ folder, step folder or converted checkpoint; or a config file "
                        "(.py): an Open-Sora inference config (configs/opensora-v1-2/inference/sample.py) or a "
                        "jaxsora config, whose values apply where no flag is given")
    hidden_aliases(g, g.add_argument("--ckpt-path", dest="ckpt_opt", metavar="CKPT",
                                     help="the checkpoint (as the positional CKPT)"), "--ckpt")
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    g.add_argument("--ema", action=argparse.BooleanOptionalAction, default=True,
                   help="use the EMA weights when the checkpoint has them (default; --no-ema: the params)")
    g.add_argument("--vae", default=None,
                   help="PATH (OpenSora VAE v1.2 weights), identity[:T,H,W] (pixel space) or a JSON config group "
                        "(default: the run config's)")
    g.add_argument("--text-encoder", default=None,
                   help="PATH (a T5 folder), tiny (random byte-level encoder) or a JSON config group "
                        "(default: the run config's)")
    g.add_argument("--dtype", default=None, help="model compute dtype: bf16, fp32 (default: the checkpoint's)")
    g.add_argument("--dp-size", type=int, default=None, help="devices on the data axis (default: all / sp-size)")
    g.add_argument("--sp-size", type=int, default=1, help="devices on the sequence axis (Ulysses), default 1")


def add_score_args(g) -> None:
    """--aes, --flow, --camera-motion: what is appended to each prompt."""
    g.add_argument("--aes", type=_score, default=_UNSET, help="aesthetic score appended (default 6.5; none: off)")
    g.add_argument("--flow", type=_score, default=_UNSET, help="motion score appended (default none)")
    g.add_argument("--camera-motion", default=None, help="camera motion appended (e.g. 'pan left')")


def add_size_args(ap: argparse.ArgumentParser) -> None:
    """The "size and length" group."""
    g = ap.add_argument_group("size and length")
    g.add_argument("--resolution", default=None, help="144p, 240p, 360p, 480p, 720p, 1080p, 2k, 4k, 256, 512, ...")
    g.add_argument("--aspect-ratio", default=None, help="h:w name (9:16 = landscape 240×426 at 240p, 16:9, 1:1, "
                                                         "3:4, 4:3, ...) or an H/W key such as 0.56")
    g.add_argument("--image-size", type=int, nargs=2, metavar=("H", "W"), default=None, help="instead of the two above")
    g.add_argument("--height", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--num-frames", default=None, help="frames, or a duration: 2s=51, 4s=102, 8s=204, 16s=408, 1x...")
    g.add_argument("--fps", type=float, default=None, help="fps told to the model and of the mp4 (default 24)")
    g.add_argument("--save-fps", type=float, default=None, help="fps of the mp4 (default: --fps)")


def add_sampling_args(ap: argparse.ArgumentParser, batch: bool = True) -> None:
    """The "sampling" group (`batch`: with --batch-size)."""
    g = ap.add_argument_group("sampling")
    g.add_argument("--num-sampling-steps", "--steps", dest="num_sampling_steps", type=int, default=30,
                   help="denoising steps (rectified flow)")
    g.add_argument("--cfg-scale", "--cfg", dest="cfg_scale", type=float, default=None,
                   help="classifier-free guidance scale (default: the run config's sample.cfg_scale, else 7.0)")
    g.add_argument("--seed", type=int, default=42, help="noise seed (with each prompt's text and repeat count)")
    if batch:
        g.add_argument("--batch-size", type=int, default=1, help="videos sampled together")


def add_compilation_cache_arg(g) -> None:
    g.add_argument("--compilation-cache", metavar="DIR", default=None,
                   help="jax's persistent compilation cache: each sampling shape compiles once across runs "
                        "(default: the trainer's <outputs>/jax_cache beside the run folder, when it exists; "
                        "'none': no cache; JAX_COMPILATION_CACHE_DIR, when set, wins)")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m jaxsora.sample", description=__doc__, formatter_class=_Help)
    add_checkpoint_args(ap)

    g = ap.add_argument_group("multi-host (every process runs the same command; process 0 writes the files)")
    g.add_argument("--coordinator", default=None, help="coordinator host:port (default: JAX_COORDINATOR_ADDRESS or "
                                                        "the detected cluster's)")
    g.add_argument("--num-processes", type=int, default=None, help="process count (default: JAX_NUM_PROCESSES, ...)")
    g.add_argument("--process-id", type=int, default=None, help="this process's id (default: JAX_PROCESS_ID, ...)")

    g = ap.add_argument_group("prompts")
    g.add_argument("--prompt", action="extend", nargs="+", default=[], help="prompt(s); repeatable")
    hidden_aliases(g, g.add_argument("--prompt-path", dest="prompt_path", help="a text file, one prompt a line"),
                   "--prompt-file")
    g.add_argument("--start-index", type=int, default=0, help="first line of --prompt-path (and first file number)")
    g.add_argument("--end-index", type=int, default=None, help="line after the last one of --prompt-path")
    g.add_argument("--num-sample", type=int, default=1, help="videos per prompt (names get -k)")
    add_score_args(g)

    add_size_args(ap)
    add_sampling_args(ap)

    g = ap.add_argument_group("conditioning (image-to-video, extension)")
    g.add_argument("--reference-path", nargs="+", default=None,
                   help="reference image/video per prompt (one for all, or one per prompt; ';' separates several)")
    g.add_argument("--mask-strategy", nargs="+", default=None,
                   help="per prompt: ';'-separated groups loop_id,ref_id,ref_start,target_start,length,edit_ratio "
                        "(defaults 0,0,0,0,1,0; '0' = first frame from the first reference)")
    g.add_argument("--loop", type=int, default=1, help="clips chained, each on the last frames of the previous one")
    g.add_argument("--condition-frame-length", type=int, default=5, help="latent frames carried over per loop")
    g.add_argument("--condition-frame-edit", type=float, default=0.0,
                   help="edit ratio of the frames carried over per loop (0: kept as they are)")
    g.add_argument("--align", type=int, default=None,
                   help="snap mask-strategy starts to multiples of this many latent frames (default: the VAE's "
                        "chunk, 5 for the OpenSora VAE)")

    g = ap.add_argument_group("output")
    output = g.add_argument("--output", dest="save_dir", metavar="DIR", default="./samples/samples/",
                            help="folder the videos and their .json sidecars are written to")
    hidden_aliases(g, output, "--save-dir", "--out")  # --save-dir: Open-Sora's name
    g.add_argument("--sample-name", default=None, help="file-name prefix (default 'sample')")
    g.add_argument("--prompt-as-path", action="store_true", help="name the files after the prompts")
    g.add_argument("--verbose", type=int, default=1, help="0: quiet, 1: progress bars (default)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (the other messages stay)")
    add_compilation_cache_arg(g)
    g.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return ap


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_path:
        if not os.path.isfile(args.prompt_path):
            raise MissingFile(f"--prompt-path: no such file {args.prompt_path}")
        with open(args.prompt_path) as f:
            lines = [ln.strip() for ln in f]
        prompts += [p for p in lines[args.start_index:args.end_index] if p]
    if not prompts:
        raise BadInput("give at least one --prompt or a --prompt-path file")
    return prompts


def make_settings(args, run_config: dict | None):
    """SampleSettings from the flags; what is not given comes from the run config's `sample`
    section (size, frames, fps, aes/flow, cfg_scale) or Open-Sora's defaults."""
    from jaxsora.infer.options import default_settings

    kw = dict(num_sampling_steps=args.num_sampling_steps, seed=args.seed,
              batch_size=args.batch_size, loop=args.loop, condition_frame_length=args.condition_frame_length,
              condition_frame_edit=args.condition_frame_edit, align=args.align, camera_motion=args.camera_motion,
              save_fps=args.save_fps, reference_path=args.reference_path, mask_strategy=args.mask_strategy)
    if (args.height is None) != (args.width is None):
        raise BadInput("--height and --width go together (or use --image-size H W)")
    if args.image_size is not None or args.height is not None:
        if args.resolution or args.aspect_ratio:
            raise BadInput("give --image-size or --resolution/--aspect-ratio, not both")
        kw["image_size"] = tuple(args.image_size) if args.image_size is not None else (args.height, args.width)
    elif args.resolution or args.aspect_ratio:
        kw.update(image_size=None, resolution=args.resolution or "240p", aspect_ratio=args.aspect_ratio or "9:16")
    if args.num_frames is not None:
        kw["num_frames"] = int(args.num_frames) if str(args.num_frames).isdigit() else args.num_frames
    if args.fps is not None:
        kw["fps"] = args.fps
    if args.cfg_scale is not None:
        kw["cfg_scale"] = args.cfg_scale
    if args.aes is not _UNSET:
        kw["aes"] = args.aes
    if args.flow is not _UNSET:
        kw["flow"] = args.flow
    return default_settings(run_config, **kw)


def use_compilation_cache(given: str | None, step_dir: str) -> None:
    """Point jax's persistent compilation cache at `given` ('none': off) or, by default, at the cache the
    trainer keeps for its runs (`<outputs>/jax_cache`, beside a run folder `<outputs>/<run>` whose
    checkpoints/<step> this is) when that folder exists; before anything compiles. JAX_COMPILATION_CACHE_DIR
    (already in jax's config) wins."""
    import jax

    from jaxsora.runs import COMPILATION_CACHE

    if jax.config.jax_compilation_cache_dir:
        return
    if given is None:
        folder = os.path.dirname(os.path.abspath(step_dir))
        given = os.path.join(os.path.dirname(os.path.dirname(folder)), COMPILATION_CACHE)
        if os.path.basename(folder) != "checkpoints" or not os.path.isdir(given):
            return
    if given.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", os.path.abspath(given))


def _start_distributed(args) -> None:
    """jax.distributed from --coordinator/--num-processes/--process-id, JAX_* variables or the
    detected cluster (`jaxsora.parallel.distributed`); its line on where the settings came from
    goes to stdout, as `jaxsora.train`'s (not at --verbose 0)."""
    import contextlib

    from jaxsora.parallel.distributed import initialize

    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null if args.verbose < 1 else sys.stdout):
        initialize(args.coordinator, args.num_processes, args.process_id)


def _same_job(args, ckpt: str, step_dir: str, prompts: list[str], settings) -> str:
    """Multi-host: the step folder every process samples, process 0's (a save that finishes between
    the processes' starts could give them different newest steps, and a mix of their weights).
    Processes given different prompts or flags (the output folder aside) stop with a one-line error
    in every process, rather than hang or write a mix."""
    import json
    import zlib

    import jax

    if jax.process_count() == 1:
        return step_dir
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxsora.infer.locate import find_step_dir

    name = os.path.basename(step_dir)
    step = int(name) if name.isdigit() else -1
    job = json.dumps([prompts, settings.to_dict(), args.step, args.ema, args.vae, args.text_encoder, args.dtype,
                      args.dp_size, args.sp_size], sort_keys=True, default=str)
    mine = np.asarray([step, zlib.crc32(job.encode()) & 0x7FFFFFFF], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 2)
    differ = [i for i in range(len(every)) if every[i, 1] != every[0, 1]]
    if differ:
        raise BadInput(f"process {differ[0]} of {len(every)} was given other prompts or flags than process 0 "
                       "(every process runs the same command on the same files)")
    first = int(every[0, 0])
    if first < 0 or first == step:
        return step_dir
    print(f"[jaxsora.sample] process {jax.process_index()}: sampling process 0's step {first} (not {step})",
          file=sys.stderr, flush=True)
    return find_step_dir(ckpt, first)


def _given(argv: Sequence[str] | None, parser: Callable[[], argparse.ArgumentParser] | None = None) -> set[str]:
    """The options (argparse dests) the command line gives, defaults aside (`parser`: the command's parser
    factory, default jaxsora.sample's)."""
    ap = (parser or build_parser)()
    for action in ap._actions:
        action.default = argparse.SUPPRESS
    return set(vars(ap.parse_args(argv)))


_SIZE = ("image_size", "height", "width", "resolution", "aspect_ratio")


@dataclasses.dataclass
class ConfigDefaults:
    """What a config file given to the sampler decides where no flag does."""
    run_config: dict | None = None        # a jaxsora config: in place of the checkpoint's stored run config
    use_timestep_transform: bool | None = None  # an Open-Sora inference config's scheduler
    ckpt: str | None = None               # an Open-Sora config's model.from_pretrained
    opensora: object = None               # the InferenceConfig


def apply_config_file(path: str, args, given: set[str]) -> ConfigDefaults:
    """The config file `path` (an Open-Sora inference config or a jaxsora config) into `args` wherever the command
    line gave nothing: Open-Sora's merge order (a flag wins over the file). A size flag replaces the file's size
    settings whole (resolution, aspect ratio, image size)."""
    from jaxsora.opensora_config import is_opensora_config

    if is_opensora_config(path):
        from jaxsora.opensora_config.inference import read_inference

        conf = read_inference(path)
        values = dict(conf.args)
        if given & set(_SIZE):
            for k in _SIZE:
                values.pop(k, None)
        elif "image_size" in values:  # Open-Sora: image_size wins over resolution / aspect_ratio
            values.pop("resolution", None)
            values.pop("aspect_ratio", None)
        if given & {"prompt", "prompt_path"}:
            values.pop("prompt", None)
            values.pop("prompt_path", None)
        for dest, value in values.items():
            if dest not in given:
                setattr(args, dest, value)
        if "vae" not in given and conf.vae:
            args.vae = dict(conf.vae)
        if "text_encoder" not in given and conf.text_encoder:
            args.text_encoder = dict(conf.text_encoder)
        if args.verbose >= 1:
            for note in conf.notes:
                print(f"[jaxsora.sample] {os.path.basename(path)}: {note}", file=sys.stderr, flush=True)
        return ConfigDefaults(use_timestep_transform=conf.use_timestep_transform, ckpt=conf.ckpt, opensora=conf)
    run_config = _jaxsora_config(path)
    for group in ("vae", "text_encoder"):
        if group not in given and run_config.get(group):
            setattr(args, group, dict(run_config[group]))
    sched = run_config.get("scheduler") or {}
    return ConfigDefaults(run_config=run_config, use_timestep_transform=bool(sched.get("use_timestep_transform", True)))


def _jaxsora_config(path: str) -> dict:
    """A jaxsora config file's `get_config()` as a plain dict."""
    import importlib.util

    from jaxsora.config_files import register_configs_package
    from jaxsora.opensora_config.reader import plain

    file = path.split(":")[0]
    register_configs_package(file)
    try:
        spec = importlib.util.spec_from_file_location("_jaxsora_sample_config", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return plain(module.get_config())
    except Exception as e:
        raise BadInput(f"config file {file} does not load: {type(e).__name__}: {e}") from None


def read_config_arg(args, given: set[str]) -> ConfigDefaults:
    """A config file given as CKPT_OR_CONFIG, applied to `args` where `given` (the options the command line
    gives) has nothing (`apply_config_file`); args.ckpt then names no checkpoint."""
    if not (args.ckpt and args.ckpt.split(":")[0].endswith(".py")):
        return ConfigDefaults()
    if not os.path.isfile(args.ckpt.split(":")[0]):
        raise MissingFile(f"no such config file: {args.ckpt}")
    config_file, args.ckpt = args.ckpt, None
    return apply_config_file(config_file, args, given)


def checkpoint_arg(args, defaults: ConfigDefaults, prog: str = "python -m jaxsora.sample") -> str:
    """The checkpoint to open: CKPT, --ckpt-path or an Open-Sora config's model.from_pretrained."""
    ckpt = args.ckpt_opt or args.ckpt
    if args.ckpt and args.ckpt_opt and args.ckpt != args.ckpt_opt:
        raise BadInput(f"two checkpoints given ({args.ckpt} and --ckpt-path {args.ckpt_opt})")
    if not ckpt and defaults.opensora is not None:
        from jaxsora.opensora_config.inference import checkpoint_of

        ckpt = checkpoint_of(defaults.opensora)
    if not ckpt:
        raise BadInput(f"give a checkpoint: {prog} CKPT (a run folder, checkpoints/, a step folder "
                       "or a converted checkpoint), or --ckpt-path CKPT with a config file")
    return ckpt


def load_pipeline(args, step_dir: str, defaults: ConfigDefaults, mesh):
    """The Pipeline of `step_dir` with the checkpoint flags of `args`; a config file's run config and
    scheduler (`defaults`) in place of the checkpoint's."""
    from jaxsora.infer.pipeline import Pipeline

    pipe = Pipeline.load(step_dir, ema=args.ema, vae=args.vae, text_encoder=args.text_encoder, mesh=mesh,
                         dtype=args.dtype)
    if defaults.run_config is not None:
        pipe.run_config = defaults.run_config
    if defaults.use_timestep_transform is not None:  # the config file's scheduler, not the checkpoint's
        pipe.use_timestep_transform = defaults.use_timestep_transform
    return pipe


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = read_config_arg(args, _given(argv))
    prompts = read_prompts(args)
    ckpt = checkpoint_arg(args, defaults)
    if args.num_sample < 1:
        raise BadInput(f"--num-sample must be at least 1, got {args.num_sample}")
    from jaxsora.parallel import compile_options

    compile_options.check_env()  # $JAXSORA_CPU_MATMUL, $JAXSORA_GPU_XLA

    # Every check of the input runs before jax is imported (a mistake is answered at once) and before connecting,
    # so a mistake ends each process alone (no process is left waiting for another one in jax.distributed).
    from jaxsora.infer import options as opt
    from jaxsora.infer.locate import find_step_dir, read_run_config, vae_spec

    step_dir = find_step_dir(ckpt, args.step)
    run_config = defaults.run_config or read_run_config(step_dir)
    vae_spec(args.vae, run_config)  # a converted checkpoint without --vae, a --vae path that is not there
    settings = make_settings(args, run_config)
    # Everything about the settings is checked before any weight is read.
    extra = ((run_config or {}).get("data") or {}).get("resolutions") or None
    settings.validate(extra)
    prompts = [p for p in prompts for _ in range(args.num_sample)]
    refs = opt.per_prompt(settings.reference_path, len(prompts), "--reference-path")
    strategies = opt.per_prompt(settings.mask_strategy, len(prompts), "--mask-strategy")
    for i, p in enumerate(prompts):
        _, info = opt.extract_json(p)
        ms, ref = info.get("mask_strategy", strategies[i]), info.get("reference_path", refs[i])
        opt.check_references(ms, ref, settings.loop, where=f" (prompt {i})")
        for path in filter(None, (ref or "").split(";")):
            if not os.path.isfile(path):
                raise MissingFile(f"--reference-path: no such file {path}")
        opt.split_prompt(opt.extract_json(p)[0])
    if args.sp_size < 1 or (args.dp_size is not None and args.dp_size < 1):
        raise BadInput("--dp-size and --sp-size must be positive")

    import jax

    from jaxsora.infer.pipeline import default_mesh, write_samples

    use_compilation_cache(args.compilation_cache, step_dir)
    _start_distributed(args)
    step_dir = _same_job(args, ckpt, step_dir, prompts, settings)
    mesh = default_mesh(args.dp_size, args.sp_size)
    pipe = load_pipeline(args, step_dir, defaults, mesh)
    if args.verbose >= 1 and jax.process_index() == 0:
        print(f"[jaxsora.sample] {pipe.step_dir} (step {pipe.step}, {pipe.weights} weights), "
              f"{len(prompts)} video(s), mesh {dict(mesh.shape)}", file=sys.stderr, flush=True)
    try:
        videos = pipe.generate(prompts, settings, progress=args.verbose >= 1 and not args.no_progress)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        r = settings.validate(extra)
        raise BadInput(f"out of device memory sampling {r.num_frames}×{r.height}×{r.width} with "
                       f"{pipe.rows(settings.batch_size, len(prompts))} row(s) per batch: lower --batch-size, "
                       "--resolution or --num-frames, or spread each video with --sp-size") from None
    if jax.process_index() != 0:
        return 0
    written = write_samples(videos, prompts, settings, args.save_dir, pipe.meta(), start_index=args.start_index,
                            prefix=args.sample_name or "sample", num_sample=args.num_sample,
                            prompt_as_path=args.prompt_as_path)
    for i, (prompt, path) in enumerate(zip(prompts, written)):
        print(f"[{i}] {prompt!r} → {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("jaxsora.sample", main))
