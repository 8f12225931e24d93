"""A user's edited copy of Open-Sora 1.2's stage-1 config (other buckets, lr, warm-up, masks, EMA, epochs; the
demo-sized model, pixel-space VAE and tiny text encoder, as configs/demo.py) trains on CPU for a few steps through
`python -m jaxsora.train FILE.py`, and the run is the one the file names: the stored config, the lr of each step
(the file's linear warm-up), the length of its one epoch."""
import json
import os
import subprocess

import pytest

from tests.conftest import FIXTURES, REPO
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

STAGE1 = FIXTURES / "opensora_configs" / "hpcaitech" / "configs" / "opensora-v1-2" / "train" / "stage1.py"

# Appended to a _base_ of the real stage1.py: what a user edits — here to configs/demo.py's run (its buckets at
# a 32×32 resolution, lr and 100-step warm-up, masks, timestep shift, demo model, pixel-space VAE, tiny text
# encoder), one block pair deep and on one device like the README walk's demo runs, so that the compiled step
# is the walk's (the suite's persistent compilation cache holds it).
EDITS = """
bucket_config = dict(_delete_=True, demo32={1: (1.0, 8), 8: (1.0, 4)})
model = dict(_delete_=True, type="demo", from_pretrained=None, input_sq_size=32, freeze_y_embedder=False)
vae = dict(_delete_=True, type="identity", downsample=(1, 2, 2))
text_encoder = dict(_delete_=True, type="tiny", d_model=64, num_layers=2, num_heads=2, d_ff=128, model_max_length=48,
                    seed=0)
scheduler = dict(use_timestep_transform=False, loc=1.0)
dtype = "fp32"
grad_checkpoint = False
num_workers = 0
lr = 2e-3
warmup_steps = 100
mask_ratios = dict(_delete_=True, image_head=0.25, image_tail=0.1, quarter_head=0.1, random=0.1)
epochs = 1
log_every = 1
ckpt_every = 100
seed = 7
jaxsora = dict(data=dict(resolutions={"demo32": [("1.00", (32, 32))]}), mesh=dict(data=-1, fsdp=1),
               model=dict(depth=1), train=dict(max_steps=50))
"""


@pytest.mark.slow(seconds=60)
def test_an_edited_open_sora_file_trains_with_its_values(tmp_path):
    data = tmp_path / "data"
    r = subprocess.run([PYTHON, "-m", "data_tools.synthetic", "--output", str(data), "--preset", "demo",
                        "--num-videos", "16", "--num-images", "8", "--no-progress"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    mine = tmp_path / "my_stage1.py"
    mine.write_text(f"_base_ = {str(STAGE1)!r}\n{EDITS}")
    run = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": cpu_flags(1)}  # one device, as the walk
    r = subprocess.run([PYTHON, "-m", "jaxsora.train", str(mine), "--data-path", str(data / "meta.csv"),
                        "--run-dir", str(run)], capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "[jaxsora.train] my_stage1.py: plugin 'zero2'" in r.stderr

    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    cfg = json.loads((run / "checkpoints" / str(steps[-1]) / "config" / "metadata").read_text())
    cfg = cfg.get("config", cfg)
    assert steps[-1] == 5  # epochs = 1 ends the run, not max_steps: 16 clips in 4 batches, 8 images in 1
    o = cfg["optim"]
    assert (o["lr"], o["warmup_steps"], o["lr_schedule"], o["ema_decay"], o["weight_decay"], o["eps"],
            o["grad_clip"]) == (2e-3, 100, "linear_warmup", 0.99, 0.0, 1e-15, 1.0)  # the last 4: stage1.py's
    assert cfg["mask_ratios"] == {"image_head": 0.25, "image_tail": 0.1, "quarter_head": 0.1, "random": 0.1}
    assert (cfg["train"]["epochs"], cfg["train"]["seed"], cfg["data"]["seed"], cfg["train"]["experiment"]) == \
        (1, 7, 7, "my_stage1")
    assert cfg["data"]["bucket_config"] == {"demo32": {"1": [1.0, 8], "8": [1.0, 4]}}
    assert (cfg["model"]["name"], cfg["model"]["compute_dtype"], cfg["model"]["remat"]) == ("demo", "float32", "none")
    assert (cfg["vae"]["kind"], cfg["text_encoder"]["kind"], cfg["scheduler"]["sample_method"],
            cfg["scheduler"]["loc"], cfg["scheduler"]["use_timestep_transform"], cfg["model"]["depth"]) == \
        ("identity", "tiny", "logit-normal", 1.0, False, 1)

    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {int(m["step"]): m["lr"] for m in lines if "lr" in m}
    # LinearWarmupLR: optimizer step k (0-based; logged as step k+1) of W=100 warm-up steps at lr·(k+1)/(W+1)
    expected = {k: 2e-3 * k / 101 for k in range(1, 6)}
    assert {k: pytest.approx(v, rel=1e-5) for k, v in expected.items()} == {k: lrs[k] for k in expected}, lrs
    assert any(k.startswith("time/demo32_8x32x32") for m in lines for k in m), lines  # the file's buckets ran
    assert any(k.startswith("time/demo32_1x32x32") for m in lines for k in m), lines
