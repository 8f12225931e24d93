"""The CPU demo (`make demo`): a ~2.4M-parameter STDiT3 learning a synthetic video set in minutes.

Pixel-space latents (IdentityVAE, 2× spatial average pooling) and a tiny random byte-level text
encoder, so nothing is downloaded; everything else (rectified flow, frame masks, AdamW + EMA,
buckets, checkpoints) is the stage-1 machinery. `make demo` then samples the captions of the
twelve (colour, shape, direction) combinations the set never shows and judges the videos by their
pixels (`python -m data_tools.judge`).

What differs from a stage config, and why (each measured on the demo set; docs/demo.md):
- `model.input_sq_size=32`: the 2D position embedding scales positions by sqrt(H·W)/input_sq_size;
  at 32×32 pixels the reference's 512 spaces neighbouring tokens 16 units apart, where most of the
  sin/cos frequencies alias. 32 gives them the spacing a 512-pixel model has at 512 pixels.
- The timestep shift: the reference's resolution-dependent transform would, at 32 pixels, squeeze
  training t toward 0 (ratio 0.0625). The demo trains instead with logit-normal t around 0.82
  (`scheduler.loc=1.5`), the same distribution as the transform at ratio e^1.5 ≈ 4.5 (it adds
  log(ratio) to the logit). At loc 1 (ratio e ≈ 2.7, the stage configs' shift at 240p-720p) the demo
  drew fewer of its shapes, at 0.5 fewer still and lost motion (docs/demo.md, "The shape"). The
  sampler follows what the checkpoint's config says (no transform: uniform steps).
- `mask_ratios`: more frame-conditioning masks than stage 1 (first, last or random frames given),
  which is where a model learns that motion continues one way in time.
- lr 2e-3 (100 warmup steps), held for three quarters of the run, then down linearly to 2e-5 at the last step
  (`warmup_stable_decay`); 2,000 steps (7.2 minutes of training on a fresh 2-core machine, 11-14 when the
  host is busy: a third of them are the set's stills, at a third of a clip's cost), EMA 0.99.

The set is what makes the direction learnable in that budget (data_tools/synthetic.py, START): every
clip's shape starts near the centre, so its first frame says nothing of where it goes, while where it is
over the clip follows the direction word. On the wrapping set (shapes start anywhere) the same model never
took the direction from the word (motion at chance after 2,000-3,000 steps; docs/demo.md).
The shapes are of radius 0.3 and start within ±1 px of the centre (before: radius 0.2 within ±3.2 px): the
demo trains mostly at high noise, where the best guess of a clip is its shape averaged over where it may be,
and that spread had rounded every shape off. Now bars and squares come out as asked. Circles, the shape a
half-learnt sample loses first (a circle hedged toward a square or a bar reads as neither), came from training
longer and ending it at a low learning rate: 1,600 steps at a constant 2e-3 drew circles for 4-11 of 16 held-out
circle prompts over four runs, 2,000 steps with the decay 13-16 over four seeds and 11-14 in fresh
make demo runs (docs/demo.md, "Circles over seeds").
"""
from configs import base


def get_config():
    c = base.get_config()
    c.model.update(dict(name="demo", compute_dtype="float32", remat="none", freeze_y_embedder=False,
                        input_sq_size=32))
    c.vae = dict(kind="identity", downsample=(1, 2, 2))
    c.text_encoder = dict(kind="tiny", d_model=64, num_layers=2, num_heads=2, d_ff=128, model_max_length=48, seed=0)
    c.data.table = "outputs/demo/data/meta.csv"
    # A custom 32×32 resolution (the reference tables start at 144p), bucketed by the reference rules:
    # images in the 1-frame bucket, clips of > 8 frames (the demo set's 9) in the 8-frame bucket.
    c.data.resolutions = {"demo32": [("1.00", (32, 32))]}  # {name: [(H/W key, (H, W)), ...]}
    c.data.bucket_config = {"demo32": {1: (1.0, 8), 8: (1.0, 4)}}
    c.data.num_workers = 0
    c.scheduler.update(dict(use_timestep_transform=False, loc=1.5))
    c.mask_ratios = dict(image_head=0.25, image_tail=0.1, quarter_head=0.1, random=0.1)
    c.optim.update(dict(lr=2e-3, warmup_steps=100, weight_decay=0.0, ema_decay=0.99, lr_schedule="warmup_stable_decay",
                        min_lr=2e-5, anneal_strategy="linear"))
    c.mesh.update(dict(data=-1, fsdp=1, sequence=1))
    c.train.update(dict(outputs="outputs", experiment="demo", max_steps=2000, ckpt_every=400, log_every=100,
                        watchdog_min_seconds=60.0))
    # the lr decays over the run's last quarter (500 of 2,000 steps), also when --config.train.max_steps changes the
    # run's length: references to it, resolved when read
    c.optim.cooldown_steps = c.train.get_ref("max_steps") // 4
    c.optim.decay_start = c.train.get_ref("max_steps") - c.optim.get_ref("cooldown_steps")
    # The synthetic captions carry no aesthetic/motion scores, so sampling appends none (Open-Sora
    # appends " aesthetic score: 6.5." by default).
    # Guidance 2 instead of 7: on three demo models (fp32 twice, bf16) the held-out captions' motion judged
    # 37-45/48 at 7 (most misses a shape that sits on its word's side without moving), 44-48/48 at 3-5. Between 2
    # and 3 little: on seven models guidance 2 judged more shapes on five (by 2-7 of 48), fewer on two (by 2)
    # (docs/demo.md, "Circles over seeds").
    c.sample.update(dict(num_frames=8, height=32, width=32, fps=8, aes=None, flow=None, cfg_scale=2.0))
    # The eval, once a held-out table is given (--config.eval.table=...): at every checkpoint, small batches.
    c.eval.update(dict(every=400, decode_threads=1))
    c.eval.bucket_config = {"demo32": {1: (1.0, 4), 8: (1.0, 4)}}
    return c
