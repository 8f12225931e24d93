"""`python -m jaxsora.app CKPT [--port 7860] [--host 127.0.0.1]`: a checkpoint in the browser, as Open-Sora
1.2's Gradio app (`gradio/app.py`), over the same sampling pipeline as `python -m jaxsora.sample`.

    python -m jaxsora.app outputs/demo --prompt-path outputs/demo/data/prompts.txt     # the demo's model
    python -m jaxsora.app ckpt/ --vae pretrained_models/OpenSora-VAE-v1.2 --text-encoder pretrained_models/t5-v1_1-xxl
    python -m jaxsora.app configs/opensora-v1-2/inference/sample.py --ckpt-path ckpt/

CKPT is what `jaxsora.sample` takes: a training run folder, its checkpoints/, one step folder, a `convert
from-torch` output (with --vae and --text-encoder), or a config file (an Open-Sora inference config or a jaxsora
config) with --ckpt-path. The page offers the choices the checkpoint serves: the resolutions, aspect ratios and
lengths its run trained on (the demo: 32×32, an image or 8 frames), the aesthetic and motion scores unless its
run samples without them; a checkpoint without a run config offers Open-Sora's app's choices. Its first values
are the sampler's defaults: the run config's sample section, a config file's values and the size, length and
sampling flags below. --prompt / --prompt-path are offered as examples.

Requests queue and sample one at a time; a compiled sampler is kept per shape (a second request of a shape
compiles nothing); each shows a progress bar of its steps. Each video is written to --output as
`sample_NNNN.mp4` with its `sample_NNNN.json` (what `jaxsora.sample` writes), an uploaded reference copied
beside it. A bad input (an empty prompt, an unreadable image, more frames than the checkpoint takes) is a
message on the page; the server keeps serving.

The server listens on 127.0.0.1 (--host 0.0.0.0: every interface, your choice); --share (a public Gradio link)
stays off unless given. Gradio's analytics are off: the page loads nothing from outside the server.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from jaxsora.cli import ArgumentParser, hidden_aliases
from jaxsora.cli import HelpFormatter as _Help
from jaxsora.errors import BadInput, MissingDependency, MissingFile, run_cli
from jaxsora.sample import (
    _given,
    add_checkpoint_args,
    add_compilation_cache_arg,
    add_sampling_args,
    add_score_args,
    add_size_args,
    checkpoint_arg,
    load_pipeline,
    make_settings,
    read_config_arg,
    use_compilation_cache,
)

PROG = "jaxsora.app"
DEFAULT_PORT = 7860  # Gradio's


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m jaxsora.app", description=__doc__, formatter_class=_Help)
    add_checkpoint_args(ap)
    g = ap.add_argument_group("the page's examples and first values")
    g.add_argument("--prompt", action="extend", nargs="+", default=[], help="prompt(s) offered as examples")
    hidden_aliases(g, g.add_argument("--prompt-path", dest="prompt_path",
                                     help="a text file of prompts offered as examples, one a line"), "--prompt-file")
    add_score_args(g)
    add_size_args(ap)
    add_sampling_args(ap, batch=False)
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (0.0.0.0: every interface, reachable from other machines)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    g.add_argument("--share", action="store_true", help="also open a public link through Gradio's share servers")
    output = g.add_argument("--output", dest="save_dir", metavar="DIR", default="./samples/app/",
                            help="folder the videos and their .json sidecars are written to")
    hidden_aliases(g, output, "--save-dir")
    add_compilation_cache_arg(g)
    g.add_argument("--dry-run", action="store_true",
                   help="load the checkpoint, print what the page offers and exit (serve nothing)")
    g.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    # what the page sets per request (or never): the sampler's defaults
    ap.set_defaults(batch_size=1, loop=1, condition_frame_length=5, condition_frame_edit=0.0, align=None,
                    reference_path=None, mask_strategy=None, start_index=0, end_index=None, verbose=1)
    return ap


def read_examples(args) -> list[str]:
    """--prompt and the lines of --prompt-path (from --start-index to --end-index, as jaxsora.sample reads them)."""
    examples = [p.strip() for p in args.prompt if p.strip()]
    if args.prompt_path:
        if not os.path.isfile(args.prompt_path):
            raise MissingFile(f"--prompt-path: no such file {args.prompt_path}")
        with open(args.prompt_path) as f:
            lines = [ln.strip() for ln in f]
        examples += [p for p in lines[args.start_index:args.end_index] if p]
    return list(dict.fromkeys(examples))


def checkpoint_name(step_dir: str) -> str:
    """outputs/demo/checkpoints/2000 → "demo, step 2000"; a converter output's folder → its name."""
    parent, step = os.path.split(os.path.abspath(step_dir))
    if os.path.basename(parent) == "checkpoints":
        return f"{os.path.basename(os.path.dirname(parent))}, step {step}"
    return os.path.basename(parent) if step.isdigit() else step


def quiet_gradio() -> None:
    """No analytics, no version check, no telemetry of Gradio or the Hugging Face hub (before Gradio is
    imported): the app makes no connection but its own server's."""
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults = read_config_arg(args, _given(argv, build_parser))
    ckpt = checkpoint_arg(args, defaults, prog="python -m jaxsora.app")
    examples = read_examples(args)
    if not 0 < args.port < 65536:
        raise BadInput(f"--port must lie in 1..65535, got {args.port}")
    if args.sp_size < 1 or (args.dp_size is not None and args.dp_size < 1):
        raise BadInput("--dp-size and --sp-size must be positive")
    import importlib.util

    if not args.dry_run and importlib.util.find_spec("gradio") is None:
        raise MissingDependency("the app needs Gradio: pip install -e '.[app]'")
    from jaxsora.parallel import compile_options

    compile_options.check_env()
    # the checkpoint, its run config and the page's first values are checked before any weight is read
    from jaxsora.app.offer import offer_for
    from jaxsora.app.service import Studio, describe_offer
    from jaxsora.infer.locate import find_step_dir, read_run_config, vae_spec

    step_dir = find_step_dir(ckpt, args.step)
    run_config = defaults.run_config or read_run_config(step_dir)
    vae_spec(args.vae, run_config)
    settings = make_settings(args, run_config)
    offer = offer_for(run_config)
    settings.validate(offer.extra_resolutions)

    from jaxsora.infer.pipeline import default_mesh

    use_compilation_cache(args.compilation_cache, step_dir)
    pipe = load_pipeline(args, step_dir, defaults, default_mesh(args.dp_size, args.sp_size))
    out = sys.stdout if args.dry_run else sys.stderr  # --dry-run: what the page offers is the command's output
    print(f"[{PROG}] {pipe.step_dir} (step {pipe.step}, {pipe.weights} weights), mesh {dict(pipe.mesh.shape)}; "
          f"videos → {os.path.abspath(args.save_dir)}", file=out, flush=True)
    for line in describe_offer(offer):
        print(f"[{PROG}] {line}", file=out, flush=True)
    from jaxsora.app.offer import parse_length
    from jaxsora.app.page import initial_choices

    res, ar, length = initial_choices(offer, settings)
    wanted = settings.validate(offer.extra_resolutions)
    if (wanted.height, wanted.width) != offer.size(res, ar) or wanted.num_frames != parse_length(length):
        print(f"[{PROG}] {wanted.num_frames}×{wanted.height}×{wanted.width} is not among this checkpoint's choices: "
              f"the page starts at {res} {ar}, {length}", file=out, flush=True)
    if args.dry_run:
        return 0
    studio = Studio(pipe, offer, settings, args.save_dir)

    quiet_gradio()
    from jaxsora.app.page import build_page, page_css

    page = build_page(studio, examples, title=f"jaxsora · {checkpoint_name(pipe.step_dir)}")
    page.launch(server_name=args.host, server_port=args.port, share=args.share,
                allowed_paths=[os.path.abspath(args.save_dir)], footer_links=["api", "settings"], css=page_css(offer))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main))
