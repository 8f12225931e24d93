"""The inference server (`python -m jaxsora.serve`): a tiny run with offline wandb writes two
checkpoints; the server samples both, logs the videos into the training's own wandb run at the
checkpoints' steps, and after a restart does nothing new; unfinished and vanished checkpoints."""
import json
import os
import shutil

import numpy as np
import pytest

from jaxsora.serve import ServeOptions, complete_steps, resolve_run, serve
from jaxsora.train.run.loop import RunOptions, train
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader
from tests.zygote import PYTHON

wandb = pytest.importorskip("wandb")

# The fake loader's clips are 4 frames of 16×16; two sampling steps keep it fast.
TINY = {"tiny": {"image_size": [16, 16], "num_frames": 4, "fps": 8, "num_sampling_steps": 2, "batch_size": 2}}
PROMPTS = ["wave 0.50", "wave 1.50"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("outputs")
    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = small_config(out, max_steps=3, ckpt_every=3, mesh=(1, 1, 1), experiment="656-tiny")
    cfg.wandb.update(dict(enabled=True, mode="offline", project="jaxsora-test"))
    res = train(cfg, RunOptions(run_dir=str(out / "656-tiny")),
                loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, per_device_batch=2, text_inputs=t))
    presets = out / "presets.json"
    presets.write_text(json.dumps(TINY))
    return out, res, str(presets)


def _opts(out, presets, **kw):
    return ServeOptions(preset="tiny", runs=["656"], outputs=str(out), prompts=PROMPTS, presets_file=presets,
                        once=True, wandb_mode="offline", **kw)


def _video(path):
    import av

    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def test_server_samples_each_checkpoint_into_the_training_wandb_run(run):
    from tests.train.wandb_records import history

    out, res, presets = run
    folder = resolve_run("656", str(out))
    assert folder.endswith("656-tiny") and complete_steps(folder) == [0, 3]
    lines = []
    done = serve(_opts(out, presets), log=lines.append)[folder]
    assert sorted(int(s) for s in done["tiny"]) == [0, 3], lines
    for step in (0, 3):
        entry = done["tiny"][str(step)]
        assert entry["status"] == "done" and len(entry["videos"]) == 2
        for rel in entry["videos"]:
            assert _video(os.path.join(folder, rel)).shape == (4, 16, 16, 3)
            assert os.path.isfile(os.path.join(folder, os.path.splitext(rel)[0] + ".json"))
    meta = json.load(open(os.path.join(folder, "checkpoints", "3", "meta", "metadata")))
    rows = [r for r in history(folder, meta["wandb_id"]) if "eval_tiny_step" in r]
    assert sorted(r["eval_tiny_step"] for r in rows) == [0, 3]
    assert all(r["eval_tiny/0/_type"] == "video-file" and r["eval_tiny/1/caption"] == PROMPTS[1] for r in rows)
    # the training logged into the same run id
    assert any("loss" in r for r in history(folder, meta["wandb_id"]))

    assert lines[-1] == "[serve] 656-tiny pass 1: 2 complete checkpoint(s), sampled 2 (0, 3), done before 0", lines
    again = []
    assert serve(_opts(out, presets), log=again.append)[folder] == done  # a restart redoes nothing, and says so
    assert again == ["[serve] 656-tiny pass 1: 2 complete checkpoint(s), sampled 0, done before 2"], again


def test_unfinished_and_vanished_checkpoints(run, tmp_path):
    out, _, presets = run
    mirror = tmp_path / "mirror" / "657-copy"
    shutil.copytree(resolve_run("656", str(out)), mirror, ignore=shutil.ignore_patterns("samples", "wandb"))
    marker = mirror / "checkpoints" / "3" / "integrity.json"
    held = marker.read_bytes()
    marker.unlink()  # step 3 is still being copied
    calls = []

    def sampler(path, prompts, save_dir, meta):
        calls.append(int(os.path.basename(path)))
        if path.endswith("/0"):
            shutil.rmtree(path)  # the training's keep policy removed it while we read it
            raise FileNotFoundError(path)
        os.makedirs(save_dir, exist_ok=True)
        return []

    opts = ServeOptions(preset="tiny", runs=[str(mirror)], presets_file=presets, once=True, wandb=False)
    lines = []
    first = serve(opts, sampler=sampler, log=lines.append)[str(mirror)]
    assert calls == [0] and first["tiny"]["0"]["status"] == "vanished" and "vanished" in lines[0]
    assert lines[-1] == ("[serve] 657-copy pass 1: 1 complete checkpoint(s), sampled 0, done before 0, waiting for "
                         "completion: 3, skipped: 0 (vanished)"), lines
    marker.write_bytes(held)  # the copy finished
    second = serve(opts, sampler=sampler, log=lines.append)[str(mirror)]
    assert calls == [0, 3] and second["tiny"]["3"]["status"] == "done"


def test_a_step_folder_holding_another_step_is_refused(run, tmp_path):
    """`cp -r checkpoints/3 checkpoints/9`: the folder's integrity record says step 3; the server does not
    sample it as step 9 (nor record it, so a corrected folder is served later) and says why."""
    out, _, presets = run
    mirror = tmp_path / "mirror" / "659-copied"
    shutil.copytree(resolve_run("656", str(out)), mirror, ignore=shutil.ignore_patterns("samples", "wandb"))
    shutil.copytree(mirror / "checkpoints" / "3", mirror / "checkpoints" / "9")
    calls, lines = [], []

    def sampler(path, prompts, save_dir, meta):
        calls.append(int(os.path.basename(path)))
        return []

    opts = ServeOptions(preset="tiny", runs=[str(mirror)], presets_file=presets, once=True, wandb=False)
    done = serve(opts, sampler=sampler, log=lines.append)[str(mirror)]
    assert calls == [0, 3] and "9" not in done["tiny"]
    assert lines[-1].endswith("skipped: 9 (its integrity.json is of step 3: a copied or renamed folder)"), lines


def test_cli_errors_are_one_line(run, tmp_path):
    import subprocess

    from tests.train.common import REPO

    out, _, presets = run
    env = {**os.environ, "PYTHONPATH": REPO}
    for args, needle in ((["--preset", "nope", "--runs", "656", "--outputs", str(out)], "not a preset"),
                         (["--preset", "low4s", "--runs", "999", "--outputs", str(out)], "999"),
                         (["--preset", "tiny", "--runs", "656", "--outputs", str(out), "--presets-file",
                           str(tmp_path / "none.json")], "none.json")):
        r = subprocess.run([PYTHON, "-m", "jaxsora.serve", *args], env=env, capture_output=True, text=True,
                           timeout=300)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_a_mirror_without_the_optimizer_state_is_served(run, tmp_path):
    """A mirror made with `rsync -a --exclude opt_state` (the weights only): the server samples it
    as it samples the run."""
    out, _, presets = run
    mirror = tmp_path / "mirror" / "658-weights"
    shutil.copytree(resolve_run("656", str(out)), mirror,
                    ignore=shutil.ignore_patterns("samples", "wandb", "opt_state"))
    assert not (mirror / "checkpoints" / "3" / "opt_state").exists() and (mirror / "checkpoints" / "3" / "ema").is_dir()
    opts = ServeOptions(preset="tiny", runs=[str(mirror)], prompts=PROMPTS, presets_file=presets, once=True,
                        wandb=False)
    done = serve(opts, log=lambda _: None)[str(mirror)]
    assert sorted(int(s) for s in done["tiny"]) == [0, 3]
    for step in (0, 3):
        entry = done["tiny"][str(step)]
        assert entry["status"] == "done" and len(entry["videos"]) == 2
        assert _video(os.path.join(str(mirror), entry["videos"][0])).shape == (4, 16, 16, 3)
