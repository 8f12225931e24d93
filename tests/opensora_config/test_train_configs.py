"""Open-Sora 1.2's own train configs (tests/fixtures/opensora_configs, their commits in its README) read into the
jaxsora config: each equals its hand-written configs/ counterpart field by field; every key of every file is
accounted for (mapped, reported once as meaningless here, or refused); an unknown key, a wrong type and a _base_
chain each answered; the translated file round-trips; the command line runs them (no jax needed for any of it but
the one --dry-run)."""
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

from jaxsora.errors import ConfigError
from jaxsora.opensora_config import TRAIN_KEYS, read_config, translate_train
from jaxsora.opensora_config.reader import plain
from jaxsora.opensora_config.translate import render
from tests.conftest import FIXTURES, REPO
from tests.zygote import PYTHON

OS = FIXTURES / "opensora_configs"
OFFICIAL = OS / "hpcaitech" / "configs" / "opensora-v1-2"
LAMBDA = OS / "lambdalabs" / "configs" / "opensora-v1-2" / "lambda"
# Open-Sora file → our hand-written config module.
COUNTERPARTS = {**{OFFICIAL / "train" / f"stage{i}.py": f"configs.stage{i}" for i in (1, 2, 3)},
                **{LAMBDA / f"stage{i}.py": f"configs.lambda.stage{i}" for i in range(1, 7)}}
ALL_TRAIN = [*COUNTERPARTS, *(OFFICIAL / "train" / f"{n}.py" for n in ("stage1_feat", "demo_360p", "demo_480p",
                                                                       "adapt"))]
# What an Open-Sora file cannot say: Open-Sora names a run's folder NNN-<model type> (jaxsora: the file's
# name), and the LambdaLabs fork's wandb project is written in its train.py, not its config.
NOT_IN_THE_FILE = {"train.experiment", "wandb.project"}


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and prefix == "" and k not in ("mask_ratios",):
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _id(p):
    return str(p.relative_to(OS))


@pytest.mark.parametrize("path", list(COUNTERPARTS), ids=_id)
def test_each_stage_file_equals_its_hand_written_config(path):
    """Field by field, types included (a float lr stays a float): the run the file describes is the run our
    configs/ file describes. This is what found configs/*stage*.py leaving train.epochs at 0 (a Lambda stage 1
    running to max_steps instead of its 5 epochs)."""
    ours = plain(importlib.import_module(COUNTERPARTS[path]).get_config())
    theirs = plain(translate_train(str(path)).config())
    a, b = _flat(theirs), _flat(ours)
    assert set(a) == set(b)
    differ = {k: (a[k], b[k]) for k in a if k not in NOT_IN_THE_FILE and (a[k] != b[k] or type(a[k]) is not type(b[k]))}
    assert differ == {}
    assert theirs["mask_ratios"] == dict(read_config(str(path)).get("mask_ratios"))


def test_the_values_that_differ_between_stages_are_the_files():
    """Spot values straight from the files (so the equality above is not two copies of one mistake)."""
    s1 = translate_train(str(LAMBDA / "stage1.py")).config()
    assert (s1.train.epochs, s1.optim.lr, s1.optim.warmup_steps, s1.optim.weight_decay) == (5, 1.6e-4, 400, 0.01)
    s4 = translate_train(str(LAMBDA / "stage4.py")).config()
    assert (s4.train.epochs, s4.optim.lr_schedule, s4.optim.min_lr, s4.optim.max_lr, s4.optim.cooldown_steps) == \
        (10, "1cycle", 1.6e-5, 6.4e-4, 400)
    assert dict(s4.mask_ratios) == {"random": 0.0}
    o2 = translate_train(str(OFFICIAL / "train" / "stage2.py")).config()
    assert (o2.optim.lr_schedule, o2.optim.warmup_steps, o2.train.epochs) == ("constant", 0, 1000)
    assert o2.data.bucket_config["480p"][204] == (0.1, 1)


def _keys(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and k in ("dataset", "model", "vae", "text_encoder", "scheduler") and prefix == "":
            yield from _keys(v, f"{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("path", ALL_TRAIN, ids=_id)
def test_every_key_of_every_file_is_accounted_for(path):
    """Each key the file sets is in the map (none unknown), and the ones meaningless here are reported, each once."""
    raw = read_config(str(path))
    tr = translate_train(str(path))
    from jaxsora.opensora_config import train as tmap

    tables = {"dataset": tmap.DATASET_KEYS, "model": tmap.MODEL_KEYS, "vae": tmap.VAE_KEYS,
              "text_encoder": tmap.TEXT_KEYS, "scheduler": tmap.SCHEDULER_KEYS}
    for key in _keys(raw):
        group, _, name = key.rpartition(".")
        row = (tables[group] if group else TRAIN_KEYS)[name]
        if row.to is None and row.note:
            assert sum(n.startswith(f"{key} ") for n in tr.notes) == 1, key
    assert len(tr.notes) == len(set(tr.notes))
    if path.name in ("stage1.py", "stage4.py"):
        assert any(n.startswith("plugin 'zero2': parameters, gradients and optimizer state are sharded over the "
                                "mesh's fsdp axis") for n in tr.notes)


def test_feature_training_and_adapt_read_as_open_sora_runs_them():
    """stage1_feat: no warmup_steps → constant lr, lr 2e-4, --data-path to the feature cache; adapt: no
    grad_checkpoint, no freeze_y_embedder (Open-Sora's default False)."""
    feat = translate_train(str(OFFICIAL / "train" / "stage1_feat.py"))
    c = feat.config()
    assert (c.optim.lr, c.optim.lr_schedule, c.train.ckpt_every, c.data.num_workers) == (2e-4, "constant", 500, 4)
    assert feat.data_path_key == "data.features"
    adapt = translate_train(str(OFFICIAL / "train" / "adapt.py")).config()
    assert (adapt.model.remat, adapt.model.freeze_y_embedder) == ("none", False)
    assert plain(adapt.data.bucket_config)["480p"] == {1: (0.2, 4), 17: (0.3, 1), 68: (0.0, None)}


def _edit(tmp_path, name, text, base=OFFICIAL / "train" / "stage1.py"):
    """A user's copy of an Open-Sora file: `text` appended to the file's own lines."""
    p = tmp_path / name
    p.write_text(base.read_text() + "\n" + text)
    return str(p)


@pytest.mark.parametrize("text, said", [
    ("ema_decey = 0.99\n", "unknown Open-Sora config key 'ema_decey' (did you mean ema_decay?)"),
    ("model = dict(type='STDiT3-XL/2', qk_nrom=True)\n", "unknown Open-Sora config key 'model.qk_nrom'"),
    ("lr = '1e-4'\n", "lr = '1e-4': expected a number"),
    ("epochs = 2.5\n", "epochs = 2.5: expected an integer"),
    ("wandb = 'yes'\n", "wandb = 'yes': expected True or False"),
    ("bucket_config = {'999p': {1: (1.0, 4)}}\n", "unknown resolution '999p'"),
    ("plugin = 'gemini'\n", "plugin = 'gemini'"),
    ("dtype = 'fp16'\n", "no fp16 loss scaling"),
    ("scheduler = dict(type='iddpm')\n", "rectified flow"),
    ("vae = dict(type='OpenSoraVAE_V1_2', micro_frame_size=16)\n", "17-frame chunks"),
    ("lr_schedule = '1cycle'\nmin_lr = 1e-5\n", "needs max_lr, cooldown_steps, anneal_strategy"),
    ("jaxsora = dict(train=dict(max_stepz=3))\n", "unknown jaxsora config key train.max_stepz"),
])
def test_a_mistake_in_a_file_is_one_config_error(tmp_path, text, said):
    with pytest.raises(ConfigError) as e:
        translate_train(_edit(tmp_path, "mine.py", text))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_base_chains_merge_as_mmengine(tmp_path):
    """_base_ (a list, relative paths, two levels), dict merge, _delete_, _base_.x and {{_base_.x}} references,
    the predefined {{ fileBasenameNoExtension }}; a loop and two bases setting one key are errors."""
    root = tmp_path / "cfg"
    (root / "common").mkdir(parents=True)
    (root / "common" / "optim.py").write_text("weight_decay = 0.02\n")
    (root / "mid.py").write_text(f"_base_ = ['{OFFICIAL / 'train' / 'stage3.py'}', 'common/optim.py']\n"
                                 "ema_decay = 0.95\nlr = 3e-4\nwarmup_steps = 10\n")
    (root / "mine.py").write_text(
        "_base_ = './mid.py'\n"
        "model = dict(freeze_y_embedder=False)\n"             # merged into the base's model dict
        "text_encoder = dict(_delete_=True, type='t5', from_pretrained='/t5', model_max_length=200)\n"
        "bucket_config = {'240p': {**_base_.bucket_config['240p'], 51: (0.5, 7)}, '144p': dict(_delete_=True)}\n"
        "mask_ratios = {{_base_.mask_ratios}}\n"
        "outputs = 'out/{{ fileBasenameNoExtension }}'\n")
    c = translate_train(str(root / "mine.py")).config()
    assert (c.optim.lr, c.optim.warmup_steps, c.optim.ema_decay, c.optim.weight_decay) == (3e-4, 10, 0.95, 0.02)
    assert (c.model.name, c.model.freeze_y_embedder, c.model.remat) == ("STDiT3-XL/2", False, "auto")
    assert (c.text_encoder.path, c.text_encoder.model_max_length) == ("/t5", 200)
    # a dict merges into the base's (mmengine: the other resolutions stay; _delete_ replaces a whole entry)
    buckets = plain(c.data.bucket_config)
    assert buckets["240p"] == {1: (1.0, 297), 51: (0.5, 7), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.4), 2)}
    assert buckets["144p"] == {} and buckets["1080p"] == {1: (0.1, 5)}
    assert c.mask_ratios.image_head == 0.22 and c.train.outputs == "out/mine"
    (root / "a.py").write_text("_base_ = 'b.py'\n")
    (root / "b.py").write_text("_base_ = 'a.py'\n")
    with pytest.raises(ConfigError, match="_base_ chain loops"):
        read_config(str(root / "a.py"))
    (root / "two.py").write_text(f"_base_ = ['common/optim.py', '{OFFICIAL / 'train' / 'stage3.py'}', "
                                 "'mid.py']\n")
    with pytest.raises(ConfigError, match="more than one _base_"):
        read_config(str(root / "two.py"))


@pytest.mark.parametrize("path", [OFFICIAL / "train" / "stage1_feat.py", LAMBDA / "stage6.py"], ids=_id)
def test_translate_round_trips(path, tmp_path):
    """The written file (saved outside any configs/ folder) resolves to exactly the config the Open-Sora file
    does, and is itself a plain jaxsora config (no Open-Sora reading involved)."""
    from jaxsora.config_files import register_configs_package

    tr = translate_train(str(path))
    out = tmp_path / "translated.py"
    out.write_text(render(tr))
    register_configs_package(str(out))
    spec = importlib.util.spec_from_file_location("translated_cfg", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = _flat(plain(mod.get_config())), _flat(plain(tr.config()))
    assert a == b and all(type(a[k]) is type(b[k]) for k in a)
    text = out.read_text()
    assert "c.optim.lr = " in text and "# lr = " in text


def test_the_command_line_runs_an_open_sora_file(tmp_path):
    """`python -m jaxsora.train FILE.py --data-path X --dry-run` (the file as the first argument, as Open-Sora's
    train.py takes it) with an override: the notes once each on stderr, the resolved config printed with the
    override and the file's values; an unknown key: one line, exit code 2, before jax; `--config FILE` the same;
    `python -m jaxsora.config translate` writes the file, and refuses to overwrite it."""
    table = tmp_path / "t.csv"
    table.write_text("path,text,num_frames,height,width\na.mp4,hi,8,32,32\n")
    path = str(LAMBDA / "stage4.py")
    r = subprocess.run([PYTHON, "-m", "jaxsora.train", path, "--data-path", str(table), "--dry-run",
                        "--outputs", str(tmp_path / "out"), "--config.optim.lr=3e-4", "--config.model.depth=1",
                        "--seed", "5", "--warmup-steps=7"],  # Open-Sora's own flags, set into the file's config
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("[jaxsora.train] stage4.py: ")]
    assert len(notes) == len(set(notes)) == len(translate_train(path).notes)
    assert any("plugin 'zero2'" in n for n in notes)
    for line in ("train.seed = 5", "data.seed = 5", "optim.warmup_steps = 7",
                 "optim.lr = 0.0003", "optim.lr_schedule = '1cycle'", "optim.max_lr = 0.00064", "train.epochs = 10",
                 "optim.weight_decay = 0.01", "train.outputs = 'outputs_speedrun'", "mask_ratios.random = 0.0"):
        assert line in r.stdout.splitlines(), line
    assert "steps per epoch" in r.stdout

    bad = tmp_path / "bad.py"
    bad.write_text(LAMBDA.joinpath("stage1.py").read_text() + "\nema_decey = 0.9\n")
    for args in ([str(bad)], ["--config", str(bad)]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxsora.train", *args, "--data-path",
                            str(table)], capture_output=True, text=True, cwd=REPO, timeout=120)
        errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
        imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        assert r.returncode == 2 and len(errors) == 1 and "ema_decey" in errors[0], r.stderr[-2000:]
        assert not imported & {"jax", "flax", "optax", "orbax", "torch"}

    out = tmp_path / "mine.py"
    cmd = [PYTHON, "-m", "jaxsora.config", "translate", path, "--output", str(out)]
    assert subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120).returncode == 0
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and out.read_text().startswith('"""jaxsora config translated')
    for given, said in (("configs/stage1.py", "a jaxsora config already"), (str(bad), "ema_decey")):
        r = subprocess.run([PYTHON, "-m", "jaxsora.config", "translate", given], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_open_soras_training_flags_go_into_the_file_as_its_merge_args_puts_them(tmp_path):
    """--lr, --warmup-steps, --seed, --wandb, --batch-size, --dtype, --flash-attn, --record-time (both spellings) read
    as the same keys written into the file; a bad value is one ConfigError; with a jaxsora config each is one line
    naming the override to use instead, before jax."""
    from jaxsora.opensora_config.train import split_opensora_flags

    argv = ["prog", "--lr", "2e-4", "--warmup-steps=300", "--seed", "7", "--wandb", "false", "--batch-size", "3",
            "--dtype", "fp32", "--flash-attn", "no", "--record-time", "--data_path", "x.csv"]
    rest, given = split_opensora_flags(argv)
    assert rest == ["prog", "--data_path", "x.csv"]
    assert given == {"lr": 2e-4, "warmup_steps": 300, "seed": 7, "wandb": False, "batch_size": 3, "dtype": "fp32",
                     "model.enable_flash_attn": False, "record_time": True}
    edited = _edit(tmp_path, "mine.py", "lr = 2e-4\nwarmup_steps = 300\nseed = 7\nwandb = False\n"
                                        "dtype = 'fp32'\n", base=LAMBDA / "stage2.py")
    want, got = translate_train(edited).config(), translate_train(str(LAMBDA / "stage2.py"), given).config()
    for key in ("optim.lr", "optim.lr_schedule", "optim.warmup_steps", "train.seed", "wandb.enabled",
                "model.compute_dtype"):
        group, name = key.split(".")
        assert got[group][name] == want[group][name], key
    for bad in (["--lr", "fast"], ["--wandb", "maybe"], ["--seed"], ["--record-time=1"]):
        with pytest.raises(ConfigError, match=bad[0].split("=")[0]):
            split_opensora_flags(["prog", *bad])
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxsora.train", "--config", "configs/demo.py",
                        "--lr", "2e-4"], capture_output=True, text=True, cwd=REPO, timeout=120)
    errors = [ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert r.returncode == 2 and len(errors) == 1 and "--config.optim.lr=2e-4" in errors[0], r.stderr[-2000:]
    assert not imported & {"jax", "flax", "optax", "orbax", "torch"}


def test_fixture_readme_names_every_file():
    readme = (OS / "README.md").read_text()
    for p in sorted(OS.rglob("*.py")):
        assert str(pathlib.PurePosixPath(p.relative_to(OS))) in readme, p
    assert "ee909a7d6611bcc9c5cf1ac055a7e9cc74157e09" in readme and "ee663be7ab16e967d9bd96270008e61c799870d1" in readme


def test_nothing_heavy_is_imported_reading_the_files():
    code = ("import sys\nfrom jaxsora.opensora_config import translate_train\n"
            f"for p in {[str(p) for p in ALL_TRAIN]!r}: translate_train(p).config()\n"
            "print(' '.join(m for m in ('jax', 'flax', 'optax', 'orbax', 'torch') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and r.stdout.strip() == "", r.stderr[-2000:]


def test_data_tools_stats_reads_an_open_sora_file(tmp_path):
    """`python -m data_tools.stats --config OPEN_SORA_FILE.py` plans with the file's buckets and seed, overrides on
    top, as the trainer reads it; a mistake in the file is the same one-line error."""
    from data_tools.stats import load_config

    path = str(LAMBDA / "stage2.py")
    c = load_config(path, ["--config.data.seed=3"])
    assert c.data.seed == 3 and plain(c.data.bucket_config) == plain(translate_train(path).config().data.bucket_config)
    bad = tmp_path / "bad.py"
    bad.write_text(pathlib.Path(path).read_text() + "\nema_decey = 0.9\n")
    with pytest.raises(ConfigError, match="ema_decey"):
        load_config(str(bad), [])


def test_run_flags_and_data_path_from_the_file(tmp_path, capsys):
    """`load`, `model.from_pretrained` and `start_from_scratch` in the file become --load / --ckpt-path /
    --start-from-scratch unless the command line gives them (Open-Sora's merge_args: the flag wins); with
    BatchFeatureDataset --data-path goes to data.features; the notes are printed once each."""
    from jaxsora.cli import _opensora_argv

    mine = _edit(tmp_path, "mine.py", "load = 'outputs/001-stage1'\nstart_from_scratch = True\n"
                                      "model = dict(type='STDiT3-XL/2', from_pretrained='weights.pth')\n")
    tr = translate_train(mine)
    assert tr.flags == {"load": "outputs/001-stage1", "start_from_scratch": True, "ckpt_path": "weights.pth"}
    known = {"load", "ckpt_path", "start_from_scratch", "data_path"}
    argv = _opensora_argv("p", mine, tr, ["p", "--config", mine, "--ckpt_path=other.pth"], known)
    assert sorted(argv[1:]) == ["--ckpt_path=other.pth", "--load=outputs/001-stage1", "--start_from_scratch"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(tr.notes) and all(ln.startswith("[p] mine.py: ") for ln in err)
    feat = translate_train(str(OFFICIAL / "train" / "stage1_feat.py"))
    argv = _opensora_argv("p", "f.py", feat, ["p", "f.py", "--data_path", "/feats", "--config.optim.lr=1e-3"], known)
    assert argv[1:] == ["f.py", "--config.data.features=/feats", "--config.optim.lr=1e-3"]
