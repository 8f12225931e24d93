"""What does a trained demo model use? Its velocity error on its own training clips, per noise level,
with the inputs changed one at a time (docs/demo.md):

    python bench/demo_probe.py outputs/demo/checkpoints outputs/demo/data [--clips 32]

Columns (mean squared error of the predicted velocity on frames 1..7, as training measures it):
  t2v        every frame noised, the clip's own caption (training without a frame mask)
  opposite   the same with the caption's direction word swapped (right <-> left, up <-> down)
  shape      the same with the caption's shape word swapped for each of the two others, the mean of both
             ("a red circle ..." read as "a red square ..." and as "a red bar ...")
  null       the same with the null caption (what classifier-free guidance contrasts with)
  i2v        frame 0 given clean (x_mask, as the image_head frame mask trains it)
  i2v other  frame 0 given clean, but another clip's
A model that reads its direction word has `opposite` well above `t2v` (its shape word: `shape`); one that
uses a given first frame has `i2v` well below `t2v` and `i2v other` above it. Same noise and clips in every column.

A second table judges, per noise level, the model's one-step estimate of the clean clip (x0 = x_t + t/1000 · v,
own caption, every frame noised) by its pixels, as data_tools.judge judges a sample: per shape the clips whose
estimate shows their shape, and the estimate's fit (elongation, disc, square; see data_tools.judge). Where that estimate
is a round blob whatever the caption says, a sampler passing through that noise level gets no shape from it.

With `--trace`, a third table follows a sampler instead: the held-out captions (DATA/prompts.txt, 4 seeds each)
sampled by the sampler's own steps (uniform; the run's guidance unless `--cfg`), and at every third step the
estimate of the clean clip judged as above, with how much longer than wide it is across its motion ("across": the
square root of the piece's second moments across over along the motion; a bar is ~2, a disc 1). It shows at which
step a sample's shape is decided and what it is then.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OPPOSITE = {"right": "left", "left": "right", "up": "down", "down": "up"}
# each shape word to the next one and to the one after (circle -> square -> bar -> circle), the two swaps
SHAPE_SWAPS = ({"circle": "square", "square": "bar", "bar": "circle"},
               {"circle": "bar", "square": "circle", "bar": "square"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="a demo run's checkpoints/ (or run folder)")
    ap.add_argument("data", help="the synthetic set it trained on (meta.csv, videos/)")
    ap.add_argument("--clips", type=int, default=32)
    ap.add_argument("--t", default="300,500,700,850,950", help="model timesteps (0..1000)")
    ap.add_argument("--no-ema", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also follow the sampler on DATA/prompts.txt (third table)")
    ap.add_argument("--cfg", type=float, help="--trace's guidance scale (default: the run's sample.cfg_scale)")
    ap.add_argument("--steps", type=int, default=30, help="--trace's sampling steps")
    args = ap.parse_args(argv)

    import jax.numpy as jnp
    import pandas as pd
    from flax import nnx

    from data_tools.judge import judge_frames, parse_caption, read_video
    from jaxsora.data.video import to_model_range
    from jaxsora.diffusion import rflow
    from jaxsora.infer.pipeline import Pipeline

    pipe = Pipeline.load(args.ckpt, ema=not args.no_ema)
    model = nnx.merge(pipe.graphdef, pipe.state)
    df = pd.read_csv(os.path.join(args.data, "meta.csv"))
    df = df[df.num_frames >= 8].head(args.clips)
    video = to_model_range(np.stack([read_video(os.path.join(args.data, p))[:8] for p in df.path]))  # [B, T, H, W, 3]
    x0 = jnp.asarray(pipe.encode_video(np.transpose(video, (0, 4, 1, 2, 3))))  # [B, C, T, h, w]
    b, c, t = x0.shape[:3]

    def caption_states(texts):
        y, m = pipe.text_encoder.encode(list(texts))
        return jnp.asarray(y), jnp.asarray(m)

    def swap(words):
        return [" ".join(words.get(w, w) for w in s.split()) for s in df.text]

    y, m = caption_states(df.text)
    y_opp, m_opp = caption_states(swap(OPPOSITE))
    shape_states = [caption_states(swap(s)) for s in SHAPE_SWAPS]
    y_null = jnp.broadcast_to(model.y_embedder.y_embedding[...][None, None, : y.shape[2]], y.shape)
    size = dict(fps=jnp.full((b,), 8.0), height=jnp.full((b,), float(video.shape[2])),
                width=jnp.full((b,), float(video.shape[3])))
    noise = jnp.asarray(np.random.default_rng(0).standard_normal(x0.shape).astype(np.float32))
    first_given = jnp.ones((b, t), bool).at[:, 0].set(False)  # x_mask: False = the clean condition frame
    other = x0.at[:, :, 0].set(jnp.roll(x0, 1, axis=0)[:, :, 0])

    def error(tv, clip, y_, m_, x_mask=None, estimate=False):
        tt = jnp.full((b,), float(tv))
        xt = rflow.add_noise(clip, noise, tt)
        kw = dict(size, y=y_, mask=m_)
        if x_mask is not None:
            xt = jnp.where(x_mask[:, None, :, None, None], xt, clip)
            kw["x_mask"] = x_mask
        v = model(xt, tt, **kw)[:, :c]
        if estimate:  # x_t = (1 − τ)·x0 + τ·ε and v ≈ x0 − ε, so x0 ≈ x_t + τ·v
            return xt + tv / 1000 * v
        return float(jnp.mean(jnp.square(v - (clip - noise))[:, :, 1:]))  # target: rflow.training_loss_explicit

    print(f"{len(df)} clips; velocity error on frames 1..{t - 1}")
    print(f"{'t':>5} {'t2v':>8} {'opposite':>9} {'shape':>8} {'null':>8} {'i2v':>8} {'i2v other':>10}")
    for tv in (int(v) for v in args.t.split(",")):
        row = (error(tv, x0, y, m), error(tv, x0, y_opp, m_opp),
               float(np.mean([error(tv, x0, ys, ms) for ys, ms in shape_states])), error(tv, x0, y_null, m),
               error(tv, x0, y, m, first_given), error(tv, other, y, m, first_given))
        print(f"{tv:>5} " + " ".join(f"{v:>{w}.4f}" for v, w in zip(row, (8, 9, 8, 8, 8, 10))))

    asked = np.asarray([parse_caption(text)["shape"] for text in df.text])
    shapes = [s for s in ("circle", "square", "bar") if (asked == s).any()]
    print("\none-step estimate of the clean clip, judged: per shape, clips showing it / clips, mean fit "
          "(elongation, disc, square)")
    print(f"{'t':>5} " + " ".join(f"{s:>27}" for s in shapes))
    for tv in (int(v) for v in args.t.split(",")):
        est = np.asarray(pipe.vae.decode(error(tv, x0, y, m, estimate=True), t))  # [B, 3, T, H, W] in [-1, 1]
        frames = np.clip(np.round((np.transpose(est, (0, 2, 3, 4, 1)) + 1) * 127.5), 0, 255)
        verdicts = np.asarray([judge_frames(f) for f in frames], object)
        cells = []
        for s in shapes:
            vs = verdicts[asked == s]
            fit = np.mean([v.fit for v in vs], axis=0)
            cells.append(f"{sum(v.shape == s for v in vs)}/{len(vs)} ({fit[0]:.2f}, {fit[1]:.2f}, {fit[2]:.2f})")
        print(f"{tv:>5} " + " ".join(f"{cell:>27}" for cell in cells))
    if args.trace:
        trace(pipe, model, os.path.join(args.data, "prompts.txt"), cfg=args.cfg, steps=args.steps)
    return 0


def _across(frames: np.ndarray, direction: str | None) -> float:
    """frames [T, H, W, 3] → the median over frames of the judge's largest foreground piece's extent across the
    motion over its extent along it (the square root of its second moments' ratio)."""
    from data_tools import judge

    fg = judge.background_distance(frames) > judge.FOREGROUND_DISTANCE
    fg = fg[fg.sum(axis=(1, 2)) >= judge.MIN_FOREGROUND_PIXELS]
    if not len(fg):
        return 1.0
    cy, cx = judge._circular_centroid(fg, axis=1), judge._circular_centroid(fg, axis=2)
    ratios = []
    for piece in (judge.largest_piece(*a) for a in zip(fg, cy, cx)):
        ys, xs = np.nonzero(piece)
        ratios.append(np.sqrt(ys.var() / max(xs.var(), 1e-6)))
    r = float(np.median(ratios))
    return r if direction in ("left", "right") else 1.0 / r  # a horizontal motion: across is the vertical


def trace(pipe, model, prompts_path: str, *, cfg: float | None, steps: int, seeds: int = 4) -> None:
    """The third table (module docstring): the sampler's estimate of the clean clip, judged every third step.
    Each step is `rflow.sample_steps` itself (one step at a time); its velocity is read back from the step it
    took, v = (z_next − z) / Δt, and the estimate is z + t/1000 · v."""
    import jax
    import jax.numpy as jnp

    from data_tools.judge import judge_frames, parse_caption
    from jaxsora.diffusion import rflow

    sample = pipe.run_config["sample"]
    cfg = float(sample["cfg_scale"]) if cfg is None else cfg
    with open(prompts_path) as f:
        texts = [line.strip() for line in f if line.strip() for _ in range(seeds)]
    b = len(texts)
    frames, h, w = (int(sample[k]) for k in ("num_frames", "height", "width"))
    y, m = (jnp.asarray(a) for a in pipe.text_encoder.encode(texts))
    cond = dict(y=y, mask=m, fps=jnp.full((b,), float(sample["fps"])), height=jnp.full((b,), float(h)),
                width=jnp.full((b,), float(w)))
    latent = pipe.encode_video(np.zeros((1, 3, frames, h, w), np.float32)).shape[1:]  # [C, T, h, w]
    z = jax.random.normal(jax.random.PRNGKey(0), (b, *latent))
    carry, cond2 = rflow.sample_init(z, cond, model.y_embedder.y_embedding[...][: y.shape[-2]])
    ts = rflow.sampling_timesteps(steps, jnp.full((b,), h), w, frames, use_timestep_transform=False)  # [steps, B]
    dts = np.append(ts[:-1, 0] - ts[1:, 0], ts[-1, 0]) / 1000  # what sample_steps steps by; the last to 0
    step = jax.jit(lambda carry, i: rflow.sample_steps(model, carry, cond2, None, ts, cfg_scale=cfg, start=i,
                                                       stop=i + 1))

    caps = [parse_caption(s) for s in texts]
    shapes = [s for s in ("circle", "square", "bar") if any(c["shape"] == s for c in caps)]
    print(f"\nsampling {b} videos (prompts.txt x {seeds} seeds, guidance {cfg}, {steps} steps): the estimate of the "
          "clean clip per step, per shape clips showing it / clips, mean (elongation, disc, square) and across")
    print(f"{'t':>6} " + " ".join(f"{s:>34}" for s in shapes))
    for i in range(steps):
        nxt = step(carry, i)
        if i % 3 == 0 or i == steps - 1:
            z, tv = carry[0], float(ts[i, 0])
            est = np.asarray(pipe.vae.decode(z + tv / 1000 * (nxt[0] - z) / dts[i], frames))
            video = np.clip(np.round((np.transpose(est, (0, 2, 3, 4, 1)) + 1) * 127.5), 0, 255)
            verdicts = [judge_frames(f) for f in video]
            cells = []
            for s in shapes:
                idx = [k for k, c in enumerate(caps) if c["shape"] == s]
                fit = np.mean([verdicts[k].fit for k in idx], axis=0)
                across = np.mean([_across(video[k], caps[k]["direction"]) for k in idx])
                cells.append(f"{sum(verdicts[k].shape == s for k in idx)}/{len(idx)} ({fit[0]:.2f}, {fit[1]:.2f}, "
                             f"{fit[2]:.2f}) {across:.2f}")
            print(f"{tv:>6.1f} " + " ".join(f"{cell:>34}" for cell in cells))
        carry = nxt


if __name__ == "__main__":
    sys.exit(main())
