"""`jaxsora.infer.Pipeline` on a real (2-step) training run in pixel space: per-prompt seeds,
image-to-video exactness, loops, compile-once, EMA choice, the mesh (data and sequence parallel)."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from jaxsora.errors import BadInput
from jaxsora.infer import Pipeline, write_samples
from jaxsora.infer.pipeline import default_mesh, prompt_key, read_reference

A, B = "wave 0.50", "wave 1.50"


def _settings(pipe, **kw):
    return pipe.default_settings(**{"num_sampling_steps": 3, **kw})


def test_run_config_defaults_and_meta(pipe, run):
    s = pipe.default_settings()
    assert s.image_size == (32, 32) and s.num_frames == 8 and s.fps == 8  # the run's `sample` section
    assert s.aes is None and s.flow is None  # the demo's captions carry no scores
    assert pipe.run_config is not None and pipe.step == 2 and pipe.step_dir.endswith(os.path.join("checkpoints", "2"))
    assert pipe.weights == "ema" and pipe.use_timestep_transform is False  # the demo config turns the shift off
    m = pipe.meta()
    assert m["checkpoint"] == pipe.step_dir and m["step"] == 2 and m["vae"]["kind"] == "identity"


def test_sizes_and_single_frames(pipe):
    v = pipe.generate([A], _settings(pipe), progress=False)
    assert len(v) == 1 and v[0].shape == (8, 32, 32, 3) and v[0].dtype == np.uint8
    # odd sizes: the pixel-space VAE pools by 2 and the output is cropped back to what was asked
    img = pipe.generate([A], _settings(pipe, image_size=(18, 22), num_frames=1), progress=False)[0]
    assert img.shape == (1, 18, 22, 3)
    with pytest.raises(BadInput, match="unknown resolution"):
        pipe.generate([A], _settings(pipe, image_size=None, resolution="17p"), progress=False)
    # the run's own resolution table ("demo32") is known by name
    assert pipe.generate([A], _settings(pipe, image_size=None, resolution="demo32", aspect_ratio="1:1", num_frames=1),
                         progress=False)[0].shape == (1, 32, 32, 3)


def test_noise_depends_only_on_seed_and_prompt(pipe):
    """(b) A alone, A beside B, B beside A: the same video. A repeated gets a second draw."""
    s = _settings(pipe, batch_size=2)
    a = pipe.generate([A], s, progress=False)[0]
    ab = pipe.generate([A, B], s, progress=False)
    ba = pipe.generate([B, A], s, progress=False)
    aa = pipe.generate([A, A], s, progress=False)
    # A alone runs a 1-row program, the pairs a 2-row one: equal up to XLA's float rounding (one level)
    assert np.abs(a.astype(int) - ab[0]).max() <= 1
    np.testing.assert_array_equal(ab[0], ba[1])  # same program, another row: exact
    np.testing.assert_array_equal(ab[1], ba[0])
    np.testing.assert_array_equal(aa[0], ab[0])
    assert not np.array_equal(aa[1], aa[0])  # the second occurrence of a prompt is another sample
    assert not np.array_equal(pipe.generate([A], s.replace(seed=43), progress=False)[0], a)
    # one batch at a time (batch_size 1) gives A's 1-row result exactly
    np.testing.assert_array_equal(pipe.generate([B, A], s.replace(batch_size=1), progress=False)[1], a)
    import jax

    kd = [np.asarray(jax.random.key_data(prompt_key(*args))) for args in ((42, A), (42, A, 1), (42, B), (43, A))]
    assert len({k.tobytes() for k in kd}) == 4
    np.testing.assert_array_equal(jax.random.key_data(prompt_key(42, A)), kd[0])  # a pure function


def test_no_retrace_for_a_second_batch_of_the_same_shape(pipe):
    """(g) compile once per shape (trace counter), with or without the step bar."""
    s = _settings(pipe, num_frames=4, batch_size=2)
    quiet = pipe.generate([A, B], s, progress=False)
    before = dict(pipe.trace_counts)
    # The step bar runs the same compiled steps one call per step: no new program, the same videos.
    for a, b in zip(pipe.generate([A, B], s, progress=True), quiet):
        np.testing.assert_array_equal(a, b)
    assert "callback" not in pipe.last_denoise_hlo().lower()  # cacheable: no host callback inside
    pipe.generate(["wave 2.50", "wave 3.50"], s.replace(seed=7, cfg_scale=4.0), progress=False)
    pipe.generate(["a", "b", "c"], s, progress=False)  # two batches, the second padded to 2 rows
    assert dict(pipe.trace_counts) == before
    pipe.generate([A, B], s.replace(num_frames=3), progress=False)
    assert pipe.trace_counts["denoise"] == before["denoise"] + 1
    # prompts cut to another of the run's data.text_lengths (these fill 15 of 16 tokens; A and B 10 → 11)
    pipe.generate(["another prompt", "and another"], s, progress=False)
    assert pipe.trace_counts["denoise"] == before["denoise"] + 2


def test_prompts_cut_to_their_tokens_sample_the_same_video(pipe):
    """The prompts' text states are cut as training cuts its batches (data.text_lengths of the run:
    11 of 16 tokens for A); the video is the one the full 16 tokens give."""
    s = _settings(pipe)
    cut = pipe.generate([A], s, progress=False)[0]
    assert pipe._last_denoise[2]["y"].shape[-2] == 11  # cond2 y [2·rows, 1, tokens, D] as the sampler ran it
    lengths = pipe.run_config["data"]["text_lengths"]
    pipe.run_config["data"]["text_lengths"] = []
    try:
        full = pipe.generate([A], s, progress=False)[0]
        assert pipe._last_denoise[2]["y"].shape[-2] == 16
    finally:
        pipe.run_config["data"]["text_lengths"] = lengths
    assert np.abs(cut.astype(int) - full).max() <= 1  # one level of uint8 rounding at most


def _block_image(rng, h, w):
    """An image constant on 2×2 blocks: the pixel-space VAE (2× average pooling, nearest
    up-sampling) reproduces it exactly."""
    return np.kron(rng.integers(0, 256, (h // 2, w // 2, 3)), np.ones((2, 2, 1))).astype(np.uint8)


def test_image_to_video_keeps_the_reference_frame(pipe, tmp_path):
    """(c) --reference-path img.png --mask-strategy "0": the first frame is the image. With the
    pixel-space VAE the conditioned latent frame is never touched by the sampler (its mask stays 0
    at every t > 0), so what comes back is decode(encode(image)) — exact for 2×2-block images,
    the 2×2 block mean (±1 level of rounding) otherwise."""
    rng = np.random.default_rng(0)
    img, img2 = _block_image(rng, 32, 32), _block_image(rng, 32, 32)
    Image.fromarray(img).save(tmp_path / "ref.png")
    Image.fromarray(img2).save(tmp_path / "end.png")
    s = _settings(pipe, reference_path=str(tmp_path / "ref.png"), mask_strategy="0")
    v = pipe.generate([A], s, progress=False)[0]
    np.testing.assert_array_equal(v[0], img)
    assert np.abs(v[1].astype(int) - img).mean() > 5  # the other frames are generated
    # connecting: first frame from one image, last from another (align: none for this VAE)
    prompt = A + json.dumps({"reference_path": f"{tmp_path / 'ref.png'};{tmp_path / 'end.png'}",
                             "mask_strategy": "0;0,1,0,-1,1"})
    v = pipe.generate([prompt], _settings(pipe), progress=False)[0]
    np.testing.assert_array_equal(v[0], img)
    np.testing.assert_array_equal(v[-1], img2)
    # an arbitrary image: the first frame is its 2×2 block mean
    noisy = rng.integers(0, 256, (32, 32, 3)).astype(np.uint8)
    Image.fromarray(noisy).save(tmp_path / "noisy.png")
    v = pipe.generate([A], s.replace(reference_path=str(tmp_path / "noisy.png")), progress=False)[0]
    mean = noisy.reshape(16, 2, 16, 2, 3).astype(np.float64).mean((1, 3))
    expect = np.kron(mean, np.ones((2, 2, 1)))
    assert np.abs(v[0] - expect).max() <= 1.0


def test_video_reference_and_loops(pipe, tmp_path):
    from jaxsora.data.video import write_mp4

    t2v = pipe.generate([A], _settings(pipe), progress=False)[0]
    # --loop 2: clip 2 continues from clip 1's last 5 latent frames; 8 + (8 − 5) frames
    looped = pipe.generate([A], _settings(pipe, loop=2), progress=False)[0]
    assert looped.shape == (11, 32, 32, 3)
    np.testing.assert_array_equal(looped[:8], t2v)
    # a video reference (extension): its frames 2..5 become frames 0..3 — as decoded (h264 is lossy),
    # resized (here: already 32×32) and passed through the pixel-space VAE (2×2 block means)
    clip = np.stack([_block_image(np.random.default_rng(i), 32, 32) for i in range(6)])
    write_mp4(clip, str(tmp_path / "ref.mp4"), 8)
    v = pipe.generate([A], _settings(pipe, reference_path=str(tmp_path / "ref.mp4"), mask_strategy="0,0,2,0,4"),
                      progress=False)[0]
    frames = read_reference(str(tmp_path / "ref.mp4"), 32, 32)  # [3, 6, 32, 32] in [-1, 1]
    assert frames.shape == (3, 6, 32, 32)
    pooled = frames.reshape(3, 6, 16, 2, 16, 2).mean((3, 5))
    expect = np.floor(np.clip((np.kron(pooled, np.ones((1, 1, 2, 2))) + 1) / 2, 0, 1) * 255 + 0.5)
    expect = expect.transpose(1, 2, 3, 0)
    assert np.abs(v[:4] - expect[2:6]).max() <= 1
    assert np.abs(v[4:].astype(int) - expect[5]).mean() > 10


def test_write_samples_and_sidecars(pipe, tmp_path):
    s = _settings(pipe, batch_size=2, aes=6.5)  # the demo-derived run config appends no score; ask for one
    videos = pipe.generate([A, B], s, progress=False) + pipe.generate([A], s.replace(num_frames=1), progress=False)
    settings = [s, s, s.replace(num_frames=1)]
    paths = write_samples(videos[:2], [A, B], s, str(tmp_path), pipe.meta())
    paths += write_samples(videos[2:], [A], settings[2], str(tmp_path / "img"), pipe.meta())
    assert [os.path.basename(p) for p in paths] == ["sample_0000.mp4", "sample_0001.mp4", "sample_0000.png"]
    rec = json.load(open(tmp_path / "sample_0001.json"))
    assert rec["prompt"] == B and rec["prompt_fed"] == B + " aesthetic score: 6.5." and rec["seed"] == 42
    assert rec["checkpoint"] == pipe.step_dir and rec["step"] == 2 and rec["frames"] == 8
    assert rec["settings"]["num_sampling_steps"] == 3 and rec["settings"]["image_size"] == [32, 32]
    assert "resolution" not in rec["settings"] and "aspect_ratio" not in rec["settings"]  # unused with image_size
    assert rec["noise"]["occurrence"] == 0
    import av

    with av.open(paths[0]) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]
    assert len(frames) == 8 and frames[0].shape == (32, 32, 3)
    assert np.asarray(Image.open(paths[2])).shape == (32, 32, 3)


def test_ema_or_params(run):
    p = Pipeline.load(run, ema=False, mesh=default_mesh(1))
    assert p.weights == "params"
    q = Pipeline.load(run, step=0, mesh=default_mesh(1))  # step 0: EMA = params
    import jax

    a = jax.tree.leaves(p.state)
    b = jax.tree.leaves(Pipeline.load(run, mesh=default_mesh(1)).state)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))
    assert q.step == 0


def test_mesh_data_and_sequence_parallel(pipe, run):
    """Prompts sharded over 2 data-parallel devices (A alone is padded to 2 rows: bit-exact with
    A beside B); Ulysses sequence parallelism over 2 devices gives the same videos, and its
    compiled sampler holds the all-to-alls."""
    s = _settings(pipe, batch_size=2)
    ref = pipe.generate([A, B], s, progress=False)
    dp2 = Pipeline.load(run, mesh=default_mesh(2))
    assert dp2.dp == 2 and dp2.rows(2, 1) == 2
    a = dp2.generate([A], s, progress=False)[0]
    ab = dp2.generate([A, B], s, progress=False)
    np.testing.assert_array_equal(a, ab[0])
    assert max(np.abs(x.astype(int) - y).max() for x, y in zip(ab, ref)) <= 1
    sp2 = Pipeline.load(run, mesh=default_mesh(1, 2))
    assert sp2.model_config.sequence_parallel_axis == "sequence"
    out = sp2.generate([A, B], s, progress=False)
    assert max(np.abs(x.astype(int) - y).max() for x, y in zip(out, ref)) <= 1
    assert "all-to-all" in sp2.last_denoise_hlo()


def test_the_apps_studio_samples_one_at_a_time_keeping_a_sampler_per_shape(pipe, tmp_path):
    """`jaxsora.app`'s service on this pipeline (here to share its compiled programs): a second request of a shape
    compiles nothing (the trace counts), another step count does; each video is written with its sidecar, numbered
    on; a bad request is a message and so is a failure inside the sampler, after which it keeps serving."""
    from jaxsora.app.offer import Request, offer_for
    from jaxsora.app.service import Studio

    offer = offer_for(pipe.run_config)
    studio = Studio(pipe, offer, pipe.default_settings(), str(tmp_path / "out"))
    ask = lambda prompt, **kw: Request(prompt, "demo32", "1:1", "8 frames", **{"steps": 3, **kw})  # noqa: E731
    first = studio.generate(ask(A), progress=False)
    assert first.ok, first.error
    traces = dict(pipe.trace_counts)
    second = studio.generate(ask(B, seed=7, cfg_scale=4.0), progress=False)
    assert second.ok and not second.compiled and dict(pipe.trace_counts) == traces
    assert studio.generate(ask(A, steps=4), progress=False).compiled  # another program: the steps are its shape
    assert [os.path.basename(r.media) for r in (first, second)] == ["sample_0000.mp4", "sample_0001.mp4"]
    meta = json.load(open(second.sidecar))
    assert meta["prompt"] == B and meta["seed"] == 7 and meta["settings"]["resolution"] == "demo32"
    assert meta["app"]["compiled"] is False and meta["app"]["started"] <= meta["app"]["finished"]
    assert meta["checkpoint"] == pipe.step_dir
    # what the page answers instead of a video
    assert studio.generate(ask(""), progress=False).error.startswith("the prompt is empty")
    (tmp_path / "bad.png").write_bytes(b"no image")
    bad = studio.generate(ask(A, reference=str(tmp_path / "bad.png")), progress=False)
    assert bad.error.startswith("reference: cannot read image"), bad.error
    original, pipe.generate = pipe.generate, lambda *a, **k: 1 / 0
    try:
        broken = studio.generate(ask(A), progress=False)
    finally:
        pipe.generate = original
    assert broken.error == "sampling failed: ZeroDivisionError: division by zero (the traceback is in the server's log)"
    assert studio.generate(ask(A), progress=False).ok  # still serving
    image = studio.generate(Request(A, "demo32", "1:1", "image", steps=3), progress=False)
    assert image.media.endswith("sample_0004.png") and image.shape == (1, 32, 32)
    assert sorted(os.listdir(tmp_path / "out")) == [f"sample_000{i}.{e}" for i in range(4) for e in ("json", "mp4")] \
        + ["sample_0004.json", "sample_0004.png"]
