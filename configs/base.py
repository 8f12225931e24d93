"""Base config: Open-Sora 1.2 settings shared by every stage (Open-Sora's `configs/opensora-v1-2/train/`).

Stages import this module and change what differs. Every value can be overridden on the command
line: `python -m jaxsora.train --config configs/stage1.py --config.optim.lr=2e-4`.
"""
import ml_collections as mlc

from jaxsora.data.text_length import DEFAULT_LENGTHS as TEXT_LENGTHS
from jaxsora.models.text_defaults import TINY_DEFAULTS

# Open-Sora 1.2 stage 1 bucket_config: {resolution: {num_frames: (keep_prob, per-device batch)}};
# a tuple keep_prob is (p_res, p_frames) (docs/data.md#buckets).
STAGE1_BUCKETS = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27), 204: ((1.0, 0.1), 13), 408: ((1.0, 0.1), 6)},
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 0.1), 5), 408: ((0.5, 0.1), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 0.1), 5), 408: ((0.4, 0.1), 2)},
    "360p": {1: (0.2, 141), 51: (0.15, 8), 102: ((0.15, 0.33), 4), 204: ((0.15, 0.1), 2), 408: ((0.15, 0.1), 1)},
    "512": {1: (0.1, 141)},
    "480p": {1: (0.1, 89)},
    "720p": {1: (0.05, 36)},
    "1024": {1: (0.05, 36)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.1, 5)},
}

# Open-Sora 1.2 configs/opensora-v1-2/misc/eval_loss.py batch sizes (per device here; a bucket's last batch
# is padded, so a small held-out table loses no rows on a large mesh).
EVAL_BUCKETS = {
    "144p": {1: (1.0, 100), 51: (1.0, 30), 102: (1.0, 20), 204: (1.0, 8), 408: (1.0, 4)},
    "240p": {1: (1.0, 100), 51: (1.0, 24), 102: (1.0, 12), 204: (1.0, 4), 408: (1.0, 2)},
    "360p": {1: (1.0, 60), 51: (1.0, 12), 102: (1.0, 6), 204: (1.0, 2), 408: (1.0, 1)},
    "480p": {1: (1.0, 40), 51: (1.0, 6), 102: (1.0, 3), 204: (1.0, 1)},
    "720p": {1: (1.0, 20), 51: (1.0, 2), 102: (1.0, 1)},
    "1080p": {1: (1.0, 10)},
    "2048": {1: (1.0, 5)},
}

# Open-Sora 1.2 stage 1 mask_ratios (identity = the rest, 0.80).
STAGE1_MASKS = {
    "random": 0.05, "intepolate": 0.005, "quarter_random": 0.005, "quarter_head": 0.005, "quarter_tail": 0.005,
    "quarter_head_tail": 0.005, "image_random": 0.025, "image_head": 0.05, "image_tail": 0.025,
    "image_head_tail": 0.025,
}


def get_config():
    c = mlc.ConfigDict()

    c.model = mlc.ConfigDict(dict(
        name="STDiT3-XL/2",
        compute_dtype="bfloat16",       # Open-Sora 1.2 trains in bf16; parameters stay fp32 (masters)
        remat="auto",                   # per bucket, the cheapest remat whose compiled step fits the device (none →
                                        # save_matmuls → save_qkv_proj → full on the first k pairs → full; Open-Sora
                                        # 1.2's grad_checkpoint=True is "full" everywhere); or one of none | full |
                                        # dots_saveable | dots_with_no_batch_dims | offload | save_matmuls |
                                        # save_qkv_proj (see STDiT3Config)
        remat_blocks=-1,                # block pairs rematerialized, from the first (-1: all)
        scan_blocks=False,              # one lax.scan over the block pairs: 1 pair compiled instead of 28
        attention_impl="auto",          # cuDNN flash attention on GPU in bf16, Pallas splash on TPU, else XLA
        freeze_y_embedder=True,         # every 1.2 stage config
        class_dropout_prob=0.1,
        input_sq_size=512,              # the 2D pos-emb's unit: positions scale by sqrt(H·W)/input_sq_size pixels
        fix_final_layer_double_mod=False,
        # The preset's shape, open to the command line (None: the preset's own), e.g. a shallower model of
        # the same width: --config.model.depth=2. Checkpoints record the shape they were trained at.
        depth=mlc.config_dict.placeholder(int),
        hidden_size=mlc.config_dict.placeholder(int),
        num_heads=mlc.config_dict.placeholder(int),
    ))
    # kind "opensora" uses path/dtype; kind "identity" (pixel space) uses downsample.
    c.vae = mlc.ConfigDict(dict(kind="opensora", path="pretrained_models/OpenSora-VAE-v1.2", dtype="bfloat16",
                                downsample=(1, 8, 8)))
    # kind "t5" uses path/dtype; kind "tiny" (random weights, byte tokenizer, no files) uses the sizes.
    # T5 weights in bf16, as Open-Sora casts the frozen encoder (train.py: dtype=bf16): 9.5 GB, not 19.
    # The tiny kind's sizes are its library defaults (models/text_defaults.py), here so that a stage
    # config switched to it can override them on the command line.
    tiny = {k: TINY_DEFAULTS[k] for k in ("d_model", "num_layers", "num_heads", "d_ff", "seed")}
    c.text_encoder = mlc.ConfigDict(dict(kind="t5", path="pretrained_models/t5-v1_1-xxl", model_max_length=300,
                                         dtype="bfloat16", param_dtype="bfloat16", **tiny))
    c.data = mlc.ConfigDict(dict(
        table="",                       # --data-path
        bucket_config=STAGE1_BUCKETS,
        bucket_config_file="",          # JSON replacing bucket_config (python -m jaxsora.tools.search_bs)
        batch_size_override=0,          # > 0: every bucket's per-device batch (smoke tests of a stage config)
        text_cache="",                  # a data_tools.precompute folder: cached T5 states instead of T5 in the step
        features="",                    # a data_tools.precompute --latents folder: cached latents + T5 states
                                        # (no video decoding, no VAE, no T5 in the run; data.table not read)
        resolutions={},                 # extra resolution tables {name: [(ar_key, (H, W)), ...]} beside the reference's
        frame_interval=1,
        num_workers=8,                  # grain worker processes decoding batches (0: in the train process)
        decode_threads=1,               # grain read threads per process (batches decoded side by side)
        codec_threads=0,                # FFmpeg threads per sample (0: host cores ÷ (workers × read threads), 1-4)
        prefetch=2,                     # batches buffered ahead, per worker
        index_dir="",                   # table index folder ("": <run>/table_index); reused while unchanged
        # Each batch's captions are cut to the shortest of these token counts that holds its longest
        # caption (the full model_max_length otherwise), as Open-Sora packs the valid tokens; each
        # (bucket, length) compiles once, when first met. (): always the full length.
        text_lengths=TEXT_LENGTHS,
        seed=42,
    ))
    c.scheduler = mlc.ConfigDict(dict(
        sample_method="logit-normal", use_timestep_transform=True, loc=0.0, scale=1.0, transform_scale=1.0,
    ))
    c.mask_ratios = mlc.ConfigDict(STAGE1_MASKS)
    c.optim = mlc.ConfigDict(dict(
        lr=1e-4, betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0, grad_clip=1.0,
        lr_schedule="linear_warmup", warmup_steps=1000,
        min_lr=0.0, max_lr=0.0, cooldown_steps=0, anneal_strategy="cos", decay_start=0,
        ema_decay=0.99,
    ))
    # Params, grads, EMA and Adam moments sharded over every device (Open-Sora 1.2 runs ColossalAI
    # ZeRO-2 over all ranks). Many nodes: --config.mesh.data=<nodes> --config.mesh.fsdp=<GPUs per node>.
    c.mesh = mlc.ConfigDict(dict(data=1, fsdp=-1, sequence=1))
    c.train = mlc.ConfigDict(dict(
        outputs="outputs", experiment="stdit3-xl2", seed=42,
        max_steps=100_000, ckpt_every=200, keep_ckpts=3, log_every=10,
        epochs=0,                       # > 0: train this many epochs (Open-Sora's `epochs`), max_steps a cap
        max_nonfinite_steps=5,          # rejected steps in a row before the run stops
        max_param_norm_growth=2.0,      # reject an update growing the parameter norm more than this (0: off)
        watchdog_factor=10.0, watchdog_min_seconds=300.0,
        async_checkpoint=True, compilation_cache=True,
        check_memory=True,              # compile every bucket before step 0; refuse buckets that do not fit
        device_memory_gib=0.0,          # > 0: plan for this much per device (e.g. 80 for an H100 from a CPU dry run)
        target="",                      # plan for other chips, compiled here by their own compiler (--target):
                                        # h100x8 | h200x8 | a100-80gx8 | tpu-v5p:2x2x2 | tpu-v5e:4x4 | tpu-v6e:2x4;
                                        # dry run and batch search only ("": this machine's devices)
        remat_memory_fraction=0.9,      # model.remat="auto" plans each bucket's step into this share of the device
        compile_threads=0,              # parallel bucket compiles (0: min(8, CPUs))
        peak_flops=0.0,                 # > 0: peak FLOP/s per device for the logged MFU (0: H100/H200/A100 table;
                                        # unknown devices and CPU log no MFU)
    ))
    # Validation loss on a held-out table (Open-Sora 1.2 eval/loss/eval_loss.py): fixed timesteps,
    # fixed noise, per (resolution, num_frames) bucket; see jaxsora/train/eval/loss.py. Off while table is "".
    c.eval = mlc.ConfigDict(dict(
        table="",                       # held-out CSV/parquet table ("": no eval)
        every=0,                        # steps between evals (0: none during training)
        at_start=False,                 # also evaluate the weights a run starts from (runs starting at step 0)
        at_end=True,                    # also evaluate after the last step
        num_timesteps=10,               # t = linspace(0, 1000, n + 2)[1:-1], as the reference
        bucket_config=EVAL_BUCKETS,     # {res: {frames: (keep_prob, per-device batch)}}; every row that fits counts
        max_batches_per_bucket=0,       # cap per (res, frames) bucket (0: every row of the table)
        use_ema=False,                  # False: the trained params (as the reference's eval); True: the EMA
        seed=42,                        # the eval's noise, VAE samples and temporal crops (misc/eval_loss.py: 42)
        decode_threads=2,               # batches decoded ahead while the device evaluates
        text_cache="",                  # with data.text_cache: the eval table's cached text states
    ))
    # LoRA fine-tuning (jaxsora/models/lora.py): rank > 0 wraps the targeted Linear layers with low-rank
    # adapters y = x·W + b + (alpha/rank)·(dropout(x)·A)·B and trains only A and B (optimizer state and EMA
    # hold adapters only); the base model (usually --ckpt-path) stays frozen and is kept in every checkpoint.
    c.lora = mlc.ConfigDict(dict(
        rank=0,                         # 0: off (full training, as every Open-Sora stage); e.g. 16
        alpha=16.0,                     # scale = alpha / rank
        dropout=0.0,                    # dropout on the adapters' input, training only
        targets=("attention", "cross_attention"),  # presets attention | cross_attention | mlp | all, or module
                                        # path patterns matched against Linear paths: "attn.qkv", "mlp.fc1",
                                        # "temporal_blocks", "spatial_blocks.*.cross_attn.q_linear", "t_block.1"
        init="kaiming",                 # A's init as peft: kaiming (U(±1/sqrt(din))) | gaussian (N(0, 1/rank²)); B = 0
        base="",                        # set by the trainer: the --ckpt-path the base came from (a record only)
    ))
    c.wandb = mlc.ConfigDict(dict(enabled=False, project="jaxsora", mode="online", name=""))
    # What samples of this run default to (jaxsora.sample, the server); cfg_scale: Open-Sora 1.2's 7.0.
    c.sample = mlc.ConfigDict(dict(num_frames=51, height=240, width=426, fps=24, cfg_scale=7.0))
    return c
