"""The CPU demo (`make demo`): a ~2M-parameter STDiT3 learning a synthetic video set in minutes.

Pixel-space latents (IdentityVAE, 2× spatial average pooling) and a tiny random byte-level text
encoder, so nothing is downloaded; everything else (rectified flow with the timestep shift, frame
masks, AdamW + EMA, buckets, checkpoints) is the stage-1 machinery.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.model.update(dict(name="demo", compute_dtype="float32", remat="none", freeze_y_embedder=False))
    c.vae = dict(kind="identity", downsample=(1, 2, 2))
    c.text_encoder = dict(kind="tiny", d_model=64, num_layers=2, num_heads=2, d_ff=128, model_max_length=48, seed=0)
    c.data.table = "outputs/demo/data/meta.csv"
    # A custom 32×32 resolution (the reference tables start at 144p), bucketed by the reference rules:
    # images in the 1-frame bucket, clips of > 8 frames in the 8-frame bucket.
    c.data.resolutions = {"demo32": [("1.00", (32, 32))]}  # {name: [(H/W key, (H, W)), ...]}
    c.data.bucket_config = {"demo32": {1: (1.0, 8), 8: (1.0, 4)}}
    c.data.num_workers = 0
    # The reference's timestep shift scales with sqrt(H·W)/512: at 32×32 pixels it would squeeze
    # training t toward 0 (ratio 0.0625) and leave the model blind at high noise. The demo turns it
    # off; the stage configs keep it. The sampler follows what the checkpoint's config says.
    c.scheduler.use_timestep_transform = False
    c.optim.update(dict(lr=1e-3, warmup_steps=50, weight_decay=0.0, ema_decay=0.99))
    c.mesh.update(dict(data=-1, fsdp=1, sequence=1))
    c.train.update(dict(outputs="outputs", experiment="demo", max_steps=600, ckpt_every=200, log_every=50,
                        watchdog_min_seconds=60.0))
    # The synthetic captions carry no aesthetic/motion scores, so sampling appends none (Open-Sora
    # appends " aesthetic score: 6.5." by default).
    c.sample.update(dict(num_frames=8, height=32, width=32, fps=8, aes=None, flow=None))
    # The eval, once a held-out table is given (--config.eval.table=...): every 100 steps, small batches.
    c.eval.update(dict(every=100, decode_threads=1))
    c.eval.bucket_config = {"demo32": {1: (1.0, 4), 8: (1.0, 4)}}
    return c
