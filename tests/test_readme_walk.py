"""The README walk: every command of the bash blocks of the README and of every docs page (and the docs' Python
example), run as a user types it, in the order the README leads to the pages, each command's output the next
one's input — on the demo config, a few steps long, in two chains of a folder each that start from the same data
commands (`walk`). A documented command that stops working fails CI; so does a command the walk does not know
(each one is walked or skipped with its reason in `WALK` below) and a `WALK` entry the docs lost. The flags of
the commands it skips (GPU runs, clusters, downloads) are checked against their parsers by tests/test_docs.py.

What the walk changes in a command is written beside it, and is of three kinds only: the stage configs
become `configs/demo.py`, one block pair deep, with a step or two (`TRAIN_FAST`, `TRAIN_ONE`: a CPU cannot
run XL/2 at 240p), the docs' example names (`656`, `OpenVid1M.csv`, `outputs/012-stage7`, downloaded
weights) become what the walk's earlier commands made, and sizes that a 32×32 synthetic set cannot meet
(`--frames-min 51`) shrink; and `data_tools.check` waits 2 s, not minutes, for the dataset chapter's clip whose
storage hangs. The inputs a user brings — a table of their own files (`raw.csv`), prompts, a reference image,
OpenVid-1M's and MiraData's tables as downloaded, with clips gone bad the ways downloads do — are made from
the synthetic set the docs' own `data_tools.synthetic` command writes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable

import pandas as pd
import pytest

from tests.test_docs import bash_commands, doc_pages, python_blocks
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

REPO = pathlib.Path(__file__).resolve().parent.parent

# A stage config at a size a CPU runs in seconds: the demo model one block pair deep (each trainer process
# about half the CPU time of the demo's four), 2 steps, a checkpoint at every step (0, 1, 2) for the runs the
# walk averages; one step (checkpoints 0 and 1: a run saves at its start and its end) for the others. Every
# run of the walk trains at that depth (one run's checkpoint is the next one's --ckpt-path), and the
# converter is told it (`WALK_MODEL`); what reads a checkpoint follows the depth it records.
WALK_DEPTH = "--config.model.depth=1"
WALK_MODEL = "demo --set depth=1"  # from-torch --model: the demo preset at the walk's depth
TRAIN_FAST = f"--config.train.max_steps=2 --config.train.ckpt_every=1 --config.train.log_every=1 {WALK_DEPTH}"
TRAIN_FAST_4 = TRAIN_FAST.replace("max_steps=2", "max_steps=4")  # a resume: two more steps
TRAIN_ONE = f"--config.train.max_steps=1 --config.train.log_every=1 {WALK_DEPTH}"
STAGE_CONFIGS = {"configs/stage1.py": "configs/demo.py", "configs/lambda/stage1.py": "configs/demo.py",
                 "configs/lambda/stage2.py": "configs/demo.py", "configs/lora_example.py": "configs/demo.py"}
LAMBDA = {**STAGE_CONFIGS, "OpenVid1M.csv": "meta.csv"}
# The folder of the LambdaLabs fork's config files in its checkout → our copies of them (tests/fixtures)
OPEN_SORA_CONFIGS = f"{REPO}/tests/fixtures/opensora_configs/lambdalabs/configs/opensora-v1-2/"


@dataclasses.dataclass
class Walk:
    """Run the documented command with these exact-substring `rewrites` (and `extra` arguments at its end);
    it must exit 0, with `expect` leave that path behind, and pass `check` (a command the walk runs anyway is
    not run again by another test: that test's assertions are its `check`)."""
    rewrites: dict = dataclasses.field(default_factory=dict)
    extra: str = ""
    expect: str | None = None
    chain: str = "runs"  # "data" (both chains start with it), "runs" or "tools"
    check: Callable[[pathlib.Path, str], None] | None = None  # (the walk's folder, stdout): what the output says
    then: Callable[[pathlib.Path], None] | None = None  # what happens to the user's files after the command


@dataclasses.dataclass
class Skip:
    why: str


def _search_found_the_boundary(work: pathlib.Path, stdout: str) -> None:
    """The batch-size search on one device, capped at 4 per device, under 0.9 × 0.1 GiB (the walk's depth-1
    model): the images reach the cap, the 8-frame clips stop at the memory boundary below it (3 here, at
    0.08 GiB; each probe a compile of the real step)."""
    found = json.loads((work / "bs.json").read_text())["demo32"]
    assert 1 <= found["8"][1] < found["1"][1] == 4, found  # 8-frame clips fit fewer per device than images
    assert "peak GiB" in stdout, stdout[-2000:]


# The dataset chapter's downloads: OpenVid-1M's clips unzipped into video_folder/ and MiraData's under miradata/,
# the synthetic set's clips and these (name → what happens to it, and the reason it is dropped with):
BAD_DOWNLOADS = {
    "truncated.mp4": "truncated at frame",  # OpenVid: the download cut short (meta names it)
    "short.mp4": "fewer frames than the table says: 4 of 24",  # OpenVid: re-downloaded shorter after meta
    "hung.mp4": "stalled: no result within 2 s",  # OpenVid: its storage hangs after meta (a FIFO, by URL)
    "corrupt.mp4": "decoder error at frame 6: [h264]",  # MiraData: bytes overwritten mid-stream (meta passes it)
    "big.mp4": "file size",  # MiraData: over 50 MB (filter)
}


def _dataset_downloads(work: pathlib.Path, meta: pd.DataFrame) -> None:
    """OpenVid-1M.csv and miradata_v1_330k.csv in their own columns over real clips: the synthetic set's, one row
    with an empty caption, and the bad ones of BAD_DOWNLOADS."""
    from tests.data_tools.clips import corrupt, encode, oversize, truncate

    videos = meta[meta["path"].str.startswith("videos/")].reset_index(drop=True)
    (work / "video_folder").mkdir()
    (work / "miradata" / "000000000007").mkdir(parents=True)
    for i, row in videos.iterrows():
        dst = work / "video_folder" if i < 7 else work / "miradata" / "000000000007"
        if i < 13:
            shutil.copy(work / "data/synthetic" / row["path"], dst / os.path.basename(row["path"]))
    truncate(encode(work / "video_folder" / "truncated.mp4", 24, 32, 32, seed=1))
    encode(work / "video_folder" / "short.mp4", 24, 32, 32, seed=2)
    encode(work / "hung.mp4", 24, 32, 32, seed=3)
    corrupt(encode(work / "miradata" / "000000000007" / "corrupt.mp4", 24, 64, 64, seed=4), 200)  # meta reads it
    oversize(encode(work / "miradata" / "000000000007" / "big.mp4", 24, 32, 32, seed=5), 50_000_001)
    names = [os.path.basename(p) for p in videos["path"][:7]] + ["truncated.mp4", "short.mp4", f"local://{work}/hung.mp4"]
    captions = videos["text"][:7].tolist() + ["a clip cut short", "a clip that changes", "a clip whose disk hangs"]
    captions[6] = ""
    pd.DataFrame({"video": names, "caption": captions, "aesthetic score": 5.0, "motion score": 1.0,
                  "temporal consistency score": 0.95, "camera motion": "static", "frame": 24, "fps": 8.0,
                  "seconds": 3.0}).to_csv(work / "OpenVid-1M.csv", index=False)
    clips = [os.path.basename(p) for p in videos["path"][7:13]] + ["corrupt.mp4", "big.mp4"]
    pd.DataFrame({"clip_id": [f"7.{i}" for i in range(len(clips))], "source": "youtube", "video_url": "https://y",
                  "video_id": "v", "width": 1280, "height": 720, "fps": 30.0, "seconds": 72.0,
                  "timestamp": "['0:00:00.000', '0:01:12.000']", "frame_number": 2160, "framestamp": "[0, 2160]",
                  "file_path": [f"000000000007/{c}" for c in clips],
                  "short_caption": "a short caption", "dense_caption": videos["text"][7:13].tolist() + [
                      "a corrupt clip", "a big clip"], "background_caption": "", "main_object_caption": "",
                  "style_caption": "", "camera_caption": ""}).to_csv(work / "miradata_v1_330k.csv", index=False)


def _storage_changes_under_the_table(work: pathlib.Path) -> None:
    """After meta measured OpenVid's clips: short.mp4 is downloaded again, shorter; the storage under
    hung.mp4 hangs (a FIFO with no writer: whoever opens it waits forever, as on a hung mount)."""
    from tests.data_tools.clips import encode

    encode(work / "video_folder" / "short.mp4", 4, 32, 32, seed=2)
    os.remove(work / "hung.mp4")
    os.mkfifo(work / "hung.mp4")


def _every_bad_clip_named_every_good_one_kept(work: pathlib.Path, stdout: str) -> None:
    """The chapter's table holds the good clips and no other; each bad one was dropped, with its reason, by
    the step meant to drop it; the empty caption was left out by meta."""
    table = pd.read_csv(work / "OpenVid1M-Miradata330k.csv")
    meta = pd.read_csv(work / "data/synthetic/meta.csv")
    videos = [os.path.basename(p) for p in meta["path"] if p.startswith("videos/")]
    assert sorted(os.path.basename(p) for p in table["path"]) == sorted(videos[:6] + videos[7:13])
    reasons = {}
    for name in ("openvid_meta.csv.unreadable.csv", "OpenVid1M.csv.dropped.csv", "Miradata330k.csv.dropped.csv"):
        df = pd.read_csv(work / name)
        reasons.update({os.path.basename(p): r for p, r in zip(df["path"], df["reason"])})
    assert reasons.pop(videos[6]) == "empty caption"
    filtered = pd.read_csv(work / "miradata_meta.csv")
    assert "big.mp4" in {os.path.basename(p) for p in filtered["path"]}
    assert "big.mp4" not in {os.path.basename(p) for p in pd.read_csv(work / "miradata_50mb.csv")["path"]}
    reasons["big.mp4"] = "file size"  # filter's count of it: "file size in [-inf, 50MB] removed 1"
    assert set(reasons) == set(BAD_DOWNLOADS), reasons
    for name, reason in BAD_DOWNLOADS.items():
        assert reasons[name].startswith(reason), (name, reasons[name])


def _the_parts_are_the_one_run_table(work: pathlib.Path, stdout: str) -> None:
    assert (work / "OpenVid1M_parts.csv").read_text() == (work / "OpenVid1M.csv").read_text()


def _app_offers_the_demo_table(work: pathlib.Path, stdout: str) -> None:
    """The app's --dry-run on a demo run: the page would offer the run's 32×32 table, an image or 8 frames."""
    assert "demo32: 1:1 32×32; lengths image, 8 frames" in stdout, stdout[-2000:]


SKIP_CLUSTER = Skip("needs hosts reachable over ssh (tests/cluster runs these against a fake ssh)")
# The walk is two chains, each in a folder of its own after the same data commands (so that `make test`'s
# two workers can run them side by side): "runs" (train, resume, average, convert, sample, serve) and
# "tools" (the batch search, eval, LoRA, text and feature caches). Their runs, in order of their numbers:
R1, R2, R3, R4 = (f"outputs/{i:03d}-demo" for i in range(1, 5))  # chain "runs"
T1, T2, T3, T4, T5 = (f"outputs/{i:03d}-demo" for i in range(1, 6))  # chain "tools"

SKIP_GPU_SETUP = Skip("a GPU node's setup: a venv, pip, a device check (make test installs this machine)")
SKIP_DOWNLOAD = Skip("a download from Hugging Face (this machine has no network): docs/weights.md")
SKIP_HOSTS = Skip("several hosts' environment for one process each (tests/cluster and the multi-process "
                  "tests run two local processes instead)")
SKIP_TPU = Skip("a TPU VM with a GCS bucket (tests/models/test_splash_attention.py compiles the attention for a "
                "TPU topology where libtpu is installed)")

# (a substring that names one command of the README or a docs page, what the walk does with it) — in the order
# walked. The pages are read in the order the README links them (tests/test_docs.py, doc_pages); a command
# written on two pages alike is one command.
WALK: list[tuple[str, Walk | Skip]] = [
    ("make demo", Skip("the demo itself: `make demo` (10 minutes of training), run by hand and in its own CI job")),
    ("make test\n", Skip("runs this walk")),
    ("make test TEST_WORKERS=4", Skip("runs this walk")),
    ("-m pytest tests/models", Skip("a part of the suite this walk belongs to")),
    ("make plan-gpu", Skip("make install, which runs this walk, installs the GPU compiler")),
    ("make plan-tpu", Skip("libtpu for the TPU targets (213 MB), not part of make install")),
    ("python3.12 -m venv", SKIP_GPU_SETUP),
    (". .venv/bin/activate", SKIP_GPU_SETUP),
    ("pip install -e '.[cuda13]'", SKIP_GPU_SETUP),
    ("pip install -U huggingface_hub", SKIP_GPU_SETUP),
    ('python -c "import jax', SKIP_GPU_SETUP),
    ("hf download", SKIP_DOWNLOAD),
    # --- Data: the synthetic set is the walk's raw material (raw.csv: its paths and captions).
    ("data_tools.synthetic --output data/synthetic", Walk(extra="--num-videos 24 --num-images 6 --no-progress",
                                                          expect="data/synthetic/meta.csv", chain="data")),
    ("--input raw.csv --output data/meta.csv", Walk({"--num-workers 16": "--num-workers 2"}, expect="data/meta.csv",
                                                    chain="data")),
    ("--input raw.csv --output meta.csv", Walk({"--num-workers 16": "--num-workers 2"}, expect="meta.csv",
                                               chain="data")),
    ("data_tools.shard --input meta.csv", Walk({"--num-shards 64": "--num-shards 4"}, expect="shards", chain="data")),
    ("data_tools.filter --input meta.csv", Walk({"--frames-min 51 --height-min 240": "--frames-min 1 --height-min 32"},
                                                expect="meta_f.csv", chain="data")),
    ("data_tools.dedup --input meta_f.csv", Walk(expect="meta_u.csv", chain="data")),
    ("data_tools.split --input meta_u.csv --output splits/", Walk(
        {"train=0.95,val=0.05": "train=0.8,val=0.2"}, expect="splits/val.csv", chain="data")),
    ("data_tools.split --input meta_u.csv --output shards/", Walk(
        {"--output shards/ --num-shards 64": "--output pshards/ --num-shards 4"}, expect="pshards", chain="data")),
    ("data_tools.merge --input a.csv", Walk({"a.csv b.parquet": "splits/train.csv splits/val.csv",
                               "more/meta_*.csv": "shards/meta_*.csv"}, expect="all.parquet", chain="data")),
    ("data_tools.stats --input splits/train.csv", Walk(STAGE_CONFIGS, expect="buckets.png", chain="data")),
    ("data_tools.filter --input OpenVid1M.csv", Walk({"OpenVid1M.csv": "meta.csv", "--frames-min 51": "--frames-min 1"},
                                                     expect="data/train.csv", chain="data")),
    ("data_tools.stats --input data/train.csv", Walk(STAGE_CONFIGS, chain="data")),
    # --- Training (the README's quick start, then the Lambda recipe with its example names).
    # the quick start's dry run compiles each bucket: 13 s, 29 at depth 4
    ("stage1.py --data-path data/meta.csv --dry-run\n", Walk(STAGE_CONFIGS, WALK_DEPTH)),
    ("--data-path data/meta.csv\n", Walk(STAGE_CONFIGS, TRAIN_FAST, R1)),
    ("to-torch outputs/001-stage1/checkpoints", Walk({"outputs/001-stage1": R1}, expect="stdit3_stage1.pth")),
    ("--data-path data/meta.csv --config.optim.lr=2e-4", Walk(STAGE_CONFIGS, TRAIN_ONE, R2)),
    ("--data-path data/meta.csv --load 656", Walk({**STAGE_CONFIGS, "--load 656": "--load 1"}, TRAIN_FAST_4,
                                                  R1 + "/checkpoints/4")),
    ("--dry-run --target h100x8", Skip("XL/2 compiled by XLA:GPU for 8 H100s: minutes of CPU a bucket (its flags are "
                                       "checked by tests/test_docs.py; tests/train/test_targets.py runs it on the "
                                       "demo config, tests/train/test_target_hlo.py reads the XL/2 step's HLO)")),
    ("--target tpu-v5p:2x2x2", Skip("XL/2 compiled by libtpu for a TPU v5p slice: minutes of CPU a compile, and "
                                    "libtpu is not in make install (make plan-tpu)")),
    # --ckpt-path: the README's PixArt-Sigma weights (a download) → the first run's checkpoints.
    ("lambda/stage1.py --data-path OpenVid1M.csv", Walk(
        {**LAMBDA, "pretrained_models/PixArt-Sigma-XL-2-2K-MS.pth": R1 + "/checkpoints"}, TRAIN_FAST, R3)),
    ("--ckpt-path outputs_speedrun/001-lambda-stage1/checkpoints", Walk(
        {**LAMBDA, "outputs_speedrun/001-lambda-stage1": R3}, TRAIN_ONE, R4)),
    ("--data-path OpenVid1M.csv --load 2", Walk({**LAMBDA, "--load 2": "--load 4"}, TRAIN_FAST,
                                               R4 + "/checkpoints/2")),
    ("python -m jaxsora.runs", Walk()),
    # Open-Sora's own config files (docs/training/coming-from-open-sora.md): the LambdaLabs fork's, checked in.
    ("lambda/stage4.py --data-path data/meta.csv --dry-run", Walk({"configs/opensora-v1-2/": OPEN_SORA_CONFIGS})),
    ("jaxsora.config translate", Walk({"configs/opensora-v1-2/": OPEN_SORA_CONFIGS}, expect="my_stage4.py")),
    ("JAX_PROCESS_ID=0", SKIP_HOSTS),
    ("JAX_PROCESS_ID=1", SKIP_HOSTS),
    ("srun python", SKIP_HOSTS),
    ("hosts.txt preflight", SKIP_CLUSTER),
    ("launch --run outputs/stage1", SKIP_CLUSTER),
    ("hosts.txt status", SKIP_CLUSTER),
    ("hosts.txt dump", SKIP_CLUSTER),
    ("hosts.txt stop", SKIP_CLUSTER),
    ("--slurm 123456", SKIP_CLUSTER),
    ("launch --run outputs/s1", SKIP_CLUSTER),
    ("launch --run outputs/s2", SKIP_CLUSTER),
    # --- TPUs (docs/training/tpu.md).
    ("pip install -e '.[tpu]'", Skip("installs libtpu (684 MB): a TPU VM's setup, or the machine that runs "
                                     "tests/models/test_splash_attention.py's TPU compile")),
    ("--outputs /mnt/bucket/outputs\n", SKIP_TPU),
    ("tpu-vm ssh", SKIP_TPU),
    ("average outputs/s7/checkpoints", Walk({"outputs/s7/checkpoints --steps 4000,4500,5000":
                                             R3 + "/checkpoints --steps 0,1,2", "outputs/s7-avg": "outputs/avg7"},
                                            expect="outputs/avg7")),
    ("to-torch outputs/s7-avg", Walk({"outputs/s7-avg": "outputs/avg7"}, expect="stdit3_s7.safetensors")),
    ("sample --ckpt-path outputs/s7-avg", Walk({"outputs/s7-avg": "outputs/avg7"}, "--num-sampling-steps 4",
                                               expect="samples/s7")),
    ("average outputs/012-stage7/checkpoints", Walk({"outputs/012-stage7/checkpoints --steps 400,500,600":
                                                     R1 + "/checkpoints --steps 2,3,4"}, expect="outputs/avg")),
    ("ckpt verify outputs/avg", Walk()),
    ("ckpt list outputs/avg", Walk()),
    ("from-torch OpenSora-STDiT-v3.safetensors", Walk({"OpenSora-STDiT-v3.safetensors": "stdit3_s7.safetensors",
                                                       "STDiT3-XL/2": WALK_MODEL}, expect="ckpt")),
    ("python scripts/inference.py", Skip("Open-Sora's own command, in its checkout: "
                                         "tests/convert/test_reference_crosscheck.py loads our export into it")),
    # --- Sampling (the docs' outputs/demo is `make demo`'s run: here the first run).
    ('outputs/demo --prompt "a red circle moving right" --output samples/', Walk(
        {"outputs/demo": R1}, "--num-sampling-steps 4", expect="samples")),
    ("--image-size 32 32 --num-frames 16", Walk({"outputs/demo": R1, "--step 400": "--step 3"},
                                                "--num-sampling-steps 4")),
    ("from-torch OpenSora-STDiT-v3/model.safetensors", Walk({"OpenSora-STDiT-v3/model.safetensors ckpt/":
                                                             "stdit3_s7.safetensors ckpt_st/",
                                                             "STDiT3-XL/2": WALK_MODEL}, expect="ckpt_st")),
    ("--vae pretrained_models/OpenSora-VAE-v1.2", Skip("the released VAE and T5-XXL weights at 480p-720p: downloads "
                                                       "and a GPU (tests/infer and tests/app hold the same options on "
                                                       "tiny models)")),
    ('--reference-path first.png', Walk({"ckpt/ ...": R1 + " --num-sampling-steps 4"})),
    ('--reference-path clip.mp4', Walk({"ckpt/ ...": R1 + " --num-sampling-steps 4 --num-frames 16"})),
    ('"reference_path": "a.png;b.png"', Walk({"ckpt/ ...": R1 + " --num-sampling-steps 4"})),
    ('--loop 3 --condition-frame-length 5', Walk({"ckpt/ ...": R1 + " --num-sampling-steps 4"})),
    ("jaxsora.app outputs/demo --prompt-path", Skip("a server runs until stopped: tests/app/test_app_browser.py "
                                                     "opens one in headless Chromium; its --dry-run form is walked")),
    ("jaxsora.app outputs/demo --dry-run", Walk({"outputs/demo": R1}, check=_app_offers_the_demo_table)),
    ("--preset low4s", Skip("a server runs until stopped, at 360p × 102 frames; its `--once` form is walked below")),
    ("--preset high4s", Skip("a server runs until stopped, at 720p; its `--once` form is walked below")),
    ("--preset demo --presets-file demo_preset.json", Walk({"outputs/demo": R2}, expect=R2 + "/samples/demo")),
    ("data_tools.judge samples/", Walk(expect="samples.png")),
    # --- The tools chain.
    # A CPU reports no memory limit: the search needs one (the docs' is the device's own).
    ("search_bs --config configs/stage1.py --data-path meta.csv --fraction", Walk(
        {**STAGE_CONFIGS, "--fraction 0.9": "--fraction 0.9 --max-batch 4 --no-progress"},
        f"--config.train.device_memory_gib=0.1 {WALK_DEPTH}", expect="bs.json", chain="tools",
        check=_search_found_the_boundary)),
    ("bucket_config_file=bs.json", Walk(STAGE_CONFIGS, TRAIN_ONE, T1, chain="tools")),
    ("--config.eval.table=heldout.csv", Walk({**STAGE_CONFIGS, "train.csv": "splits/train.csv",
                                              "heldout.csv": "splits/val.csv", "eval.every=1000": "eval.every=1"},
                                             TRAIN_ONE, T2 + "/eval.jsonl", chain="tools")),
    ("to-torch outputs/stage1/checkpoints", Walk({"outputs/stage1": T2, "[--ema] [--dtype bf16]": "--ema --dtype bf16"},
                                                 expect="stdit3.pth", chain="tools")),
    ("from-torch PixArt-Sigma-XL-2-2K-MS.pth", Walk({"PixArt-Sigma-XL-2-2K-MS.pth ckpt/": "stdit3.pth ckpt_pth/",
                                                     "STDiT3-XL/2": WALK_MODEL}, expect="ckpt_pth", chain="tools")),
    # LoRA on the Open-Sora state dict exported above (the docs: Open-Sora's released weights).
    ("configs/lora_example.py", Walk({**STAGE_CONFIGS, "clips.csv": "splits/train.csv",
                                      "pretrained_models/OpenSora-STDiT-v3/model.safetensors": "stdit3.pth"},
                                     TRAIN_ONE, T3, chain="tools")),
    ("lora merge", Walk({"outputs/013-lora": T3}, expect="merged", chain="tools")),
    ("lora export-adapters", Walk({"outputs/013-lora": T3}, expect="adapters/adapter_config.json", chain="tools")),
    ("precompute --input meta.csv --text-encoder", Walk(STAGE_CONFIGS, "--no-progress", expect="t5cache",
                                                        chain="tools")),
    ("--config.data.text_cache=t5cache/", Walk(STAGE_CONFIGS, TRAIN_ONE, T4, chain="tools")),
    ("precompute --latents", Walk({**STAGE_CONFIGS,
                                   "--shard-size 256 --batch-size 16": "--shard-size 8 --batch-size 4"},
                                  "--no-progress", expect="feats/manifest.json", chain="tools")),
    ("--config.data.features=feats/", Walk(STAGE_CONFIGS, TRAIN_ONE, T5, chain="tools")),
    # The dataset chapter (docs/data.md): OpenVid-1M's and MiraData's tables as downloaded, over synthetic clips
    # and clips gone bad (`_dataset_downloads`), to one training table.
    ("--input OpenVid-1M.csv --root video_folder", Walk(expect="openvid_meta.csv", chain="tools",
                                                        then=_storage_changes_under_the_table)),
    ("--input miradata_v1_330k.csv --root miradata", Walk(expect="miradata_meta.csv", chain="tools")),
    ("--input openvid_meta.csv --output openvid_50mb.csv", Walk(expect="openvid_50mb.csv", chain="tools")),
    ("--input miradata_meta.csv --output miradata_50mb.csv", Walk(expect="miradata_50mb.csv", chain="tools")),
    ("--input openvid_50mb.csv --output OpenVid1M.csv", Walk(extra="--time-limit 2", expect="OpenVid1M.csv",
                                                             chain="tools")),
    ("--input miradata_50mb.csv --output Miradata330k.csv", Walk(expect="Miradata330k.csv", chain="tools")),
    ("--output OpenVid1M-Miradata330k.csv", Walk(expect="OpenVid1M-Miradata330k.csv", chain="tools",
                                                 check=_every_bad_clip_named_every_good_one_kept)),
    ("--data-path OpenVid1M-Miradata330k.csv --dry-run", Walk(STAGE_CONFIGS, WALK_DEPTH, chain="tools")),
    ("launch --run outputs/check", SKIP_CLUSTER),
    ("sbatch --array", Skip("a SLURM job array (tests/data_tools/test_check.py runs --shard auto under "
                            "jaxsora.cluster launch; the parts' merge is walked below)")),
    ("--shard 0/24", Walk({"--shard 0/24": "--shard 0/1"}, "--time-limit 2",
                          expect="checked/openvid_0000-of-0001.csv", chain="tools")),
    ("'checked/openvid_*-of-0024.csv'", Walk({"0024": "0001", "--output OpenVid1M.csv": "--output OpenVid1M_parts.csv"},
                                             chain="tools", check=_the_parts_are_the_one_run_table)),
    ("bench/", Skip("benchmarks: timed by hand on a quiet machine (docs/benchmarks.md), never in CI")),
]
# The docs' Python example (the sampling API, docs/sampling.md), run with the walk's first run as outputs/demo.
PYTHON_EXAMPLE_REWRITES = {'"outputs/demo"': f'"{R1}"', "num_sampling_steps=30": "num_sampling_steps=4"}


def doc_commands() -> list[str]:
    """Each command of the README's and the docs pages' bash blocks (tests/test_docs.py reads them: continuation
    lines joined, comments dropped), in reading order, a command written twice alike once; each ends in a
    newline (so a key may name a command's end)."""
    out = []
    for page in doc_pages():
        for command in bash_commands(page):
            if command + "\n" not in out:
                out.append(command + "\n")
    return out


def python_example() -> str:
    blocks = [b for page in doc_pages() for b in python_blocks(page) if "from jaxsora" in b]
    assert len(blocks) == 1, "the walk knows one Python example of the API in the docs"
    return blocks[0]


def _claims() -> list[tuple[str, Walk | Skip, str]]:
    """(key, action, the documented command it names), in walk order; every documented command claimed once."""
    commands = doc_commands()
    claimed, problems = [], []
    for key, action in WALK:
        hits = [c for c in commands if key in c]
        if isinstance(action, Skip) and hits:  # one reason may skip several commands (the benchmarks)
            claimed += [(key, action, c) for c in hits]
        elif len(hits) != 1:
            problems.append(f"walk key {key!r} names {len(hits)} documented commands: {hits}")
        else:
            claimed.append((key, action, hits[0]))
    named = [c for _, _, c in claimed]
    problems += [f"a documented command claimed twice: {c.strip()}" for c in set(named) if named.count(c) > 1]
    problems += [f"a documented command the walk does not know: {c.strip()}" for c in commands if c not in named]
    assert not problems, "\n".join(problems)
    return claimed


def test_the_walk_knows_every_documented_command():
    _claims()


def _as_walked(command: str, walk: Walk) -> list[str]:
    for old, new in walk.rewrites.items():
        if old in command:
            command = command.replace(old, new)
        elif old not in STAGE_CONFIGS:  # the shared config map names configs a command may not use
            raise AssertionError(f"rewrite {old!r} not in the documented command {command.strip()!r}")
    args = shlex.split(command) + shlex.split(walk.extra)
    assert args[0] == "python", command
    return [PYTHON, *args[1:]]


def _user_inputs(work: pathlib.Path) -> None:
    """What a user brings, made from the docs' synthetic set once it exists: a table of their own
    files with only paths, captions and the scores `filter` reads; prompts; a reference image and clip;
    the presets file of the docs' server example."""
    meta = pd.read_csv(work / "data/synthetic/meta.csv")
    raw = pd.DataFrame(dict(path="data/synthetic/" + meta["path"], text=meta["text"], aes=6.0, flow=1.0,
                            ocr=0.0, match=0.5))
    raw.to_csv(work / "raw.csv", index=False)
    prompts = (work / "data/synthetic/prompts.txt").read_text().splitlines()[:2]
    (work / "prompts.txt").write_text("\n".join(prompts) + "\n")
    images = meta[meta["num_frames"] <= 1]["path"].tolist()
    clips = meta[meta["num_frames"] > 1]["path"].tolist()
    for name, src in (("first.png", images[0]), ("a.png", images[0]), ("b.png", images[1]), ("clip.mp4", clips[0])):
        shutil.copy(work / "data/synthetic" / src, work / name)
    text = " ".join(" ".join(page.read_text().split()) for page in doc_pages())
    preset = re.search(r"`(\{\"demo\": \{.*?\}\})`", text)
    assert preset, "the docs' demo preset example (docs/sampling.md)"
    (work / "demo_preset.json").write_text(json.dumps(json.loads(preset.group(1))))
    _dataset_downloads(work, meta)


def walk(chain: str, work: pathlib.Path) -> list[str]:
    """Run the data commands, then `chain`'s, in WALK order in `work`; returns the log (command, exit code,
    seconds)."""
    (work / "configs").symlink_to(REPO / "configs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled",
           "XLA_FLAGS": cpu_flags(1)}  # a user's CPU: one device
    log = []
    for key, action, command in _claims():
        if isinstance(action, Skip) or action.chain not in ("data", chain):
            continue
        args = _as_walked(command, action)
        t0 = time.monotonic()
        r = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        log.append(f"$ {shlex.join(args[1:])}  → {r.returncode} ({time.monotonic() - t0:.1f} s)")
        assert r.returncode == 0, "\n".join(log) + f"\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-5000:]}"
        if action.expect:
            assert (work / action.expect).exists(), "\n".join(log) + f"\n{action.expect} was not written"
        if action.check:
            action.check(work, r.stdout)
        if action.then:
            action.then(work)
        if key.startswith("data_tools.synthetic"):
            _user_inputs(work)
    if chain == "runs":  # the docs' Python example samples the first run
        code = python_example()
        for old, new in PYTHON_EXAMPLE_REWRITES.items():
            assert old in code, old
            code = code.replace(old, new)
        started = time.time()
        r = subprocess.run([PYTHON, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-5000:]
        assert any(v.stat().st_mtime >= started for v in (work / "samples").glob("*.mp4")), "the example wrote no video"
    # The runs the chain made are the ones it named, and `python -m jaxsora.runs` lists each.
    runs = subprocess.run([PYTHON, "-m", "jaxsora.runs"], cwd=work, env=env, capture_output=True, text=True)
    named = {"/".join(a.expect.split("/")[:2]) for _, a in WALK  # outputs/NNN-demo[/...] → outputs/NNN-demo
             if isinstance(a, Walk) and a.chain == chain and a.expect and a.expect.startswith("outputs/0")}
    assert named, chain
    for run in sorted(named):
        assert (work / run / "checkpoints").is_dir(), run
        assert pathlib.Path(run).name.split("-")[0] in runs.stdout, runs.stdout
    return log


@pytest.mark.slow(seconds=240)
def test_readme_walk_runs(tmp_path):
    print("\n".join(walk("runs", tmp_path)))
