"""`python -m jaxsora.sample CONFIG.py`: Open-Sora 1.2's own inference config (tests/fixtures/opensora_configs,
ee909a7) read into the sampler's options — its resolution, frames, aspect ratio, fps, guidance, steps, aes/flow,
loop, condition frames and mask strategy — with the command line's flags winning, as Open-Sora's merge_args; a
jaxsora config in the same place; a mistake in the file one line, exit code 2, before jax. (One real sampling run
with the file: tests/infer/test_cli.py, beside the run folder it shares.)"""
import subprocess
import sys

import pytest

from jaxsora.errors import ConfigError
from jaxsora.opensora_config.inference import read_inference
from jaxsora.sample import _given, apply_config_file, build_parser, make_settings
from tests.conftest import FIXTURES, REPO

SAMPLE_PY = FIXTURES / "opensora_configs" / "hpcaitech" / "configs" / "opensora-v1-2" / "inference" / "sample.py"


def _settings(argv, run_config=None):
    args = build_parser().parse_args(argv)
    path, args.ckpt = args.ckpt, None
    defaults = apply_config_file(path, args, _given(argv))
    return args, defaults, make_settings(args, run_config or defaults.run_config)


def test_sample_py_is_open_soras_defaults():
    """Every value of the file reaches the settings (each of them also Open-Sora's default in jaxsora, so the
    second half checks the file wins over a checkpoint's own `sample` section)."""
    conf = read_inference(str(SAMPLE_PY))
    assert conf.args == {"resolution": "240p", "aspect_ratio": "9:16", "num_frames": "51", "fps": 24.0,
                         "save_fps": 24.0, "seed": 42, "batch_size": 1, "dtype": "bfloat16", "num_sampling_steps": 30,
                         "cfg_scale": 7.0, "condition_frame_length": 5, "align": 5, "save_dir": "./samples/samples/",
                         "aes": 6.5, "flow": None}
    assert conf.use_timestep_transform is True and conf.ckpt == "hpcai-tech/OpenSora-STDiT-v3"
    assert conf.vae == {"kind": "opensora", "path": "pretrained_models/OpenSora-VAE-v1.2", "dtype": "bfloat16"}
    assert conf.text_encoder == {"kind": "t5", "path": "pretrained_models/t5-v1_1-xxl", "model_max_length": 300}
    # a checkpoint whose run config says 32×32, 8 frames at 8 fps, cfg 4, no aes: the file's values win
    stored = {"sample": {"height": 32, "width": 32, "num_frames": 8, "fps": 8, "cfg_scale": 4.0, "aes": None}}
    args, _, s = _settings([str(SAMPLE_PY), "--ckpt-path", "x", "--prompt", "p"], stored)
    r = s.validate()
    assert (r.height, r.width, r.num_frames) == (240, 426, 51)
    assert (s.fps, s.save_fps, s.cfg_scale, s.aes, s.flow, s.num_sampling_steps, s.seed) == (24, 24, 7.0, 6.5, None,
                                                                                            30, 42)
    assert (s.condition_frame_length, s.align, s.loop, args.save_dir, args.dtype) == (5, 5, 1, "./samples/samples/",
                                                                                      "bfloat16")


def test_flags_win_over_the_file_and_edited_copies(tmp_path):
    """A flag given wins (steps, cfg, an --image-size replaces the file's resolution and aspect ratio); a user's
    copy with a loop, condition frames, a mask strategy, image_size, a 4s duration and frame_interval (save_fps =
    fps // frame_interval, as Open-Sora) reads as written."""
    _, _, s = _settings([str(SAMPLE_PY), "--prompt", "p", "--num-sampling-steps", "4", "--cfg-scale", "3",
                         "--image-size", "64", "48", "--aes", "none"])
    assert (s.num_sampling_steps, s.cfg_scale, s.image_size, s.aes) == (4, 3.0, (64, 48), None)
    assert s.validate().num_frames == 51
    mine = tmp_path / "mine.py"
    mine.write_text(SAMPLE_PY.read_text().replace("save_fps = 24\n", "") +
                    "num_frames = '4s'\nimage_size = (144, 256)\nframe_interval = 2\nfps = 30\n"
                    "loop = 3\ncondition_frame_length = 3\ncondition_frame_edit = 0.2\n"
                    "mask_strategy = ['0,0,0,0,1']\nreference_path = ['ref.png']\nflow = 5\naes = None\n"
                    "scheduler = dict(type='rflow', num_sampling_steps=12, cfg_scale=4.5)\n"
                    "prompt = ['a cat', 'a dog']\n")
    args, _, s = _settings([str(mine)])
    r = s.validate()
    assert (r.height, r.width, r.num_frames) == (144, 256, 102)
    assert (s.fps, s.save_fps, s.loop, s.condition_frame_length, s.condition_frame_edit) == (30, 15, 3, 3, 0.2)
    assert (s.mask_strategy, s.reference_path, s.flow, s.aes) == (["0,0,0,0,1"], ["ref.png"], 5.0, None)
    assert (s.num_sampling_steps, s.cfg_scale, args.prompt) == (12, 4.5, ["a cat", "a dog"])


def test_a_jaxsora_config_in_the_same_place():
    """configs/demo.py given to the sampler: its VAE, text encoder and sample section (32×32, 8 frames, cfg 2)."""
    args, defaults, s = _settings([str(REPO / "configs" / "demo.py"), "--ckpt-path", "x", "--prompt", "p"])
    assert args.vae == {"kind": "identity", "downsample": (1, 2, 2)} and args.text_encoder["kind"] == "tiny"
    r = s.validate()
    assert (r.height, r.width, r.num_frames, s.cfg_scale) == (32, 32, 8, 2.0)
    assert defaults.use_timestep_transform is False


@pytest.mark.parametrize("text, said", [
    ("num_sampling_step = 10\n", "unknown Open-Sora config key 'num_sampling_step'"),
    ("scheduler = dict(type='rflow', cfg_scael=7.0)\n", "scheduler.cfg_scael"),
    ("llm_refine = True\n", "no GPT-4o prompt refinement"),
    ("aes = 'high'\n", "aes = 'high': expected a number or None"),
    ("multi_resolution = 'PixArtMS'\n", "multi_resolution"),
])
def test_a_mistake_in_an_inference_file(tmp_path, text, said):
    p = tmp_path / "bad.py"
    p.write_text(SAMPLE_PY.read_text() + text)
    with pytest.raises(ConfigError) as e:
        read_inference(str(p))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_answers_before_jax(tmp_path):
    """An unknown key; no local checkpoint (the file's from_pretrained is a Hugging Face id): one line, exit 2, no
    jax imported."""
    bad = tmp_path / "bad.py"
    bad.write_text(SAMPLE_PY.read_text() + "num_sampling_step = 10\n")
    for args, said in (([str(bad), "--ckpt-path", str(tmp_path)], "num_sampling_step"),
                       ([str(SAMPLE_PY)], "is not a local checkpoint")):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxsora.sample", *args, "--prompt", "x",
                            "--verbose", "0"], capture_output=True, text=True, cwd=REPO, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
        imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr[-2000:]
        assert not imported & {"jax", "flax", "optax", "orbax", "torch"}
