"""`python -m jaxsora.sample`: a checkpoint converted from PyTorch (with --vae / --text-encoder),
named resolutions and durations, files and sidecars; the demo-style run folder with its run
config's defaults; every user mistake as one line on stderr with exit code 2."""
import concurrent.futures as cf
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
from PIL import Image

from tests.conftest import FIXTURES, REPO
from tests.zygote import PYTHON

ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
# Open-Sora 1.2's own inference config (ee909a7)
OPEN_SORA_SAMPLE = FIXTURES / "opensora_configs" / "hpcaitech" / "configs" / "opensora-v1-2" / "inference" / "sample.py"


def sample(*args, timeout=300, env=None, python=()):
    return subprocess.run([PYTHON, *python, "-m", "jaxsora.sample", *map(str, args)], env=env or ENV,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _frames(path):
    import av

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


@pytest.mark.slow
def test_converted_checkpoint_sizes_and_lengths(converted, tiny_vae, tmp_path):
    """(a) exact sizes and lengths: --image-size + a frame count (2 prompts, one batch), then a
    named resolution + aspect ratio with one frame (a png)."""
    out = tmp_path / "s"
    common = ["--vae", tiny_vae, "--text-encoder", "tiny", "--num-sampling-steps", 2, "--dp-size", 1,
              "--save-dir", out, "--verbose", 0]
    r = sample(converted, "--prompt", "a red circle", "--prompt", "a blue square", "--image-size", 64, 48,
               "--num-frames", 17, "--batch-size", 2, "--fps", 12, *common)
    assert r.returncode == 0, r.stderr[-3000:]
    for i, prompt in enumerate(["a red circle", "a blue square"]):
        v = _frames(str(out / f"sample_{i:04d}.mp4"))
        assert v.shape == (17, 64, 48, 3)
        rec = json.load(open(out / f"sample_{i:04d}.json"))
        assert rec["prompt"] == prompt and rec["prompt_fed"] == prompt + " aesthetic score: 6.5."
        assert rec["seed"] == 42 and rec["step"] == 0 and rec["checkpoint"] == os.path.join(converted, "0")
        assert rec["frames"] == 17 and rec["fps"] == 12 and rec["vae"]["config"] == "tiny"
        assert rec["text_encoder"]["kind"] == "tiny" and rec["settings"]["batch_size"] == 2
    r = sample("--ckpt-path", converted, "--prompt", "a red circle", "--resolution", "144p", "--aspect-ratio", "9:16",
               "--num-frames", 1, "--sample-name", "img", "--aes", "none", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert np.asarray(Image.open(out / "img_0000.png")).shape == (144, 256, 3)  # 9:16 = landscape
    rec = json.load(open(out / "img_0000.json"))
    assert rec["prompt_fed"] == "a red circle" and rec["requested"] == {"num_frames": 1, "height": 144, "width": 256}


def test_run_folder_defaults_and_prompt_file(run, tmp_path):
    """A training run folder: VAE, text encoder and the 32×32 8-frame size come from its config;
    --prompt-file (alias of --prompt-path) and --out (alias of --save-dir) still work; the trainer's
    compilation cache beside the run folder is the sampler's."""
    (tmp_path / "prompts.txt").write_text("wave 0.50\n\nwave 1.50\n")
    # the trainer's compilation cache beside the run folder keeps the sampler's programs (no cache variable set)
    cache = pathlib.Path(run).parent / "jax_cache"
    cache.mkdir(exist_ok=True)
    env = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    r = sample("--ckpt", os.path.join(run, "checkpoints"), "--prompt-file", tmp_path / "prompts.txt", "--out",
               tmp_path / "o", "--num-sampling-steps", 2, "--dp-size", 1, "--num-sample", 2, "--no-ema", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list(cache.glob("jit__denoise_impl-*")), sorted(p.name for p in cache.iterdir())
    names = sorted(os.listdir(tmp_path / "o"))
    assert names == [f"sample_000{i}-{k}.{e}" for i in (0, 1) for k in (0, 1) for e in ("json", "mp4")]
    assert _frames(str(tmp_path / "o" / "sample_0001-1.mp4")).shape == (8, 32, 32, 3)
    rec = json.load(open(tmp_path / "o" / "sample_0001-1.json"))
    assert rec["weights"] == "params" and rec["prompt"] == "wave 1.50" and rec["noise"]["occurrence"] == 1
    assert "sampling" in r.stderr and "prompts" in r.stderr  # the progress bars


def _cases(converted, run, tmp):
    ok = ["--prompt", "x", "--dp-size", "1"]
    conv = [converted, *ok, "--text-encoder", "tiny"]
    return [
        (["--prompt", "x"], "give a checkpoint"),
        ([f"{tmp}/nowhere", *ok], "not found"),
        ([converted, *ok], "--vae"),
        ([*conv, "--vae", "identity"], "latent channels"),
        ([*conv, "--vae", f"{tmp}/none.safetensors"], "none.safetensors"),
        ([run, *ok, "--resolution", "999p"], "unknown resolution '999p'"),
        ([run, *ok, "--resolution", "512", "--aspect-ratio", "9:16"], "aspect ratio '9:16' not found"),
        ([run, *ok, "--num-frames", "3s"], "num_frames"),
        ([run, *ok, "--mask-strategy", "0,a", "--reference-path", f"{tmp}/img.png"], "mask strategy '0,a'"),
        ([run, *ok, "--mask-strategy", "0"], "give --reference-path"),
        ([run, *ok, "--mask-strategy", "0", "--reference-path", f"{tmp}/none.png"], "none.png"),
        ([run, *ok, "--image-size", "32"], "--image-size"),
        ([run, *ok, "--bogus-flag"], "unrecognized arguments"),
        ([run, "--prompt-path", f"{tmp}/none.txt"], "none.txt"),
        ([run, *ok, "--step", "7"], "no checkpoint of step 7"),
    ]


# What only the built model and VAE can tell (their channel counts): answered after jax is imported.
AFTER_JAX = ("latent channels",)
HEAVY = ("jax", "flax", "optax", "orbax", "torch")


def test_user_errors_are_one_line_exit_2(converted, run, tmp_path):
    """(f) no checkpoint, a converted checkpoint without --vae, bad names and strategies... — each one line and
    exit code 2; all but AFTER_JAX before jax (or flax, orbax) is imported, so that they are answered at once."""
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "img.png")
    cases = _cases(converted, run, tmp_path)
    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda c: sample(*c[0], python=("-X", "importtime")), cases))
    for (args, needle), r in zip(cases, results):
        imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
        assert r.returncode == 2, (args, r.returncode, r.stderr[-3000:])
        assert "Traceback" not in r.stderr and len(lines) == 1, (args, lines[-10:])
        assert lines[0].startswith("jaxsora.sample: ") and needle in lines[0], (args, lines[0])
        if needle not in AFTER_JAX:
            assert not imported & set(HEAVY), (args, sorted(imported & set(HEAVY)))
    # --debug shows the traceback instead
    r = sample(converted, "--prompt", "x", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.parametrize("argv", [["--help"]])
def test_help(argv):
    from jaxsora.sample import build_parser

    text = build_parser().format_help()
    for flag in ("--ckpt-path", "--prompt-path", "--resolution", "--aspect-ratio", "--image-size", "--num-frames",
                 "--num-sampling-steps", "--cfg-scale", "--aes", "--flow", "--reference-path", "--mask-strategy",
                 "--loop", "--condition-frame-length", "--output", "--batch-size", "--seed", "--no-ema"):
        assert flag in text
    # one name per flag: the older spellings work (tests above) but --help does not show them
    for hidden in ("--ckpt ", "--prompt-file", "--save-dir", "--out "):
        assert hidden not in text, hidden


def test_sampling_with_open_soras_file(run, tmp_path):
    """`python -m jaxsora.sample sample.py --ckpt-path RUN ...` samples with the file's guidance, aesthetic score,
    seed and fps; the flags given (size, steps, encoders, output) win; the notes once each on stderr."""
    out = tmp_path / "o"
    r = subprocess.run([PYTHON, "-m", "jaxsora.sample", str(OPEN_SORA_SAMPLE), "--ckpt-path", run, "--vae", "identity",
                        "--text-encoder", "tiny", "--prompt", "wave 0.50", "--image-size", "32", "32", "--num-frames",
                        "8", "--num-sampling-steps", "2", "--dp-size", "1", "--output", str(out), "--no-progress"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("[jaxsora.sample] sample.py: ")]
    assert len(notes) == len(set(notes)) and any("multi_resolution" in n for n in notes)
    rec = json.load(open(out / "sample_0000.json"))
    assert rec["prompt_fed"] == "wave 0.50 aesthetic score: 6.5." and rec["seed"] == 42 and rec["fps"] == 24
    assert rec["settings"]["cfg_scale"] == 7.0 and rec["settings"]["num_sampling_steps"] == 2
    assert rec["frames"] == 8 and rec["settings"]["condition_frame_length"] == 5
