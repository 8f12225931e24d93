"""Open-Sora 1.2's inference options (pure Python): names of sizes and durations, prompts, mask
strategies. Golden values are read off the reference at ee909a7 (`opensora/datasets/aspect.py`
get_image_size / NUM_FRAMES_MAP, `opensora/utils/inference_utils.py`) and its docs' examples."""
import numpy as np
import pytest

from jaxsora.errors import BadInput, UserError
from jaxsora.infer import SampleSettings, build_condition, find_nearest_point, get_image_size, get_num_frames
from jaxsora.infer import options as opt
from jaxsora.infer.options import MaskGroup, parse_mask_strategy, place_group


# ---- (e) sizes and durations --------------------------------------------------------------
@pytest.mark.parametrize("res, ar, hw", [
    ("240p", "9:16", (240, 426)),    # the 1.2 default: key 0.56 = H/W, i.e. landscape
    ("240p", "16:9", (426, 240)),    # 1.78: portrait
    ("240p", "1:1", (320, 320)),
    ("240p", "0.56", (240, 426)),    # a raw key
    ("144p", "9:16", (144, 256)),
    ("144p", "1:1", (192, 192)),
    ("144p", "3:8", (117, 312)),     # the literal table's odd sizes
    ("144p", "50:27", (277, 132)),   # the map's "50:27" → "2.08"
    ("360p", "9:16", (360, 640)),
    ("360p", "3:4", (416, 554)),
    ("480p", "9:16", (480, 854)),
    ("480p", "4:3", (740, 555)),
    ("720p", "9:16", (720, 1280)),
    ("720p", "1:1", (960, 960)),
    ("1080p", "9:16", (1080, 1920)),
    ("2k", "9:16", (1440, 2560)),
    ("4k", "9:16", (2160, 3840)),
    ("512", "1:1", (512, 512)),
    ("512", "0.57", (384, 672)),
    ("1024", "1:1", (1024, 1024)),
])
def test_image_size_names(res, ar, hw):
    assert get_image_size(res, ar) == hw


def test_image_size_errors_and_custom_tables():
    with pytest.raises(BadInput, match="unknown resolution '999p'"):
        get_image_size("999p", "9:16")
    with pytest.raises(BadInput, match="aspect ratio '9:16' not found for resolution '512'"):
        get_image_size("512", "9:16")  # PixArt tables have no 0.56 key (the reference asserts)
    with pytest.raises(BadInput, match="not found"):
        get_image_size("240p", "7:5")
    demo = {"demo32": [("1.00", (32, 32))]}  # a run config's data.resolutions
    assert get_image_size("demo32", "1:1", demo) == (32, 32)


@pytest.mark.parametrize("name, frames", [
    ("2s", 51), ("4s", 102), ("8s", 204), ("16s", 408), ("32s", 816),
    ("1x", 51), ("2x", 102), ("4x", 204), ("8x", 408), ("16x", 816),
    ("17", 17), (1, 1), (51, 51), ("102", 102),
])
def test_num_frames_names(name, frames):
    assert get_num_frames(name) == frames


@pytest.mark.parametrize("bad", ["3s", "two", "0", -1, "1.5"])
def test_num_frames_errors(bad):
    with pytest.raises(BadInput, match="num_frames"):
        get_num_frames(bad)


def test_settings_defaults_are_open_sora_s_and_validate():
    s = SampleSettings()
    assert (s.resolution, s.aspect_ratio, s.num_frames, s.fps, s.num_sampling_steps, s.cfg_scale, s.aes, s.flow,
            s.seed, s.batch_size, s.loop, s.condition_frame_length) == ("240p", "9:16", 51, 24, 30, 7.0, 6.5, None,
                                                                        42, 1, 1, 5)
    r = s.validate()
    assert (r.height, r.width, r.num_frames) == (240, 426, 51)
    r = SampleSettings(resolution="720p", num_frames="4s").validate()
    assert (r.height, r.width, r.num_frames) == (720, 1280, 102)
    assert SampleSettings(image_size=(32, 32), resolution="nonsense").validate().height == 32  # image_size wins
    for bad, match in [(dict(num_sampling_steps=0), "num_sampling_steps"), (dict(batch_size=0), "batch_size"),
                       (dict(image_size=(0, 4)), "image_size"), (dict(loop=0), "loop"), (dict(fps=0), "fps"),
                       (dict(aes="high"), "aes"), (dict(condition_frame_edit=2), "condition_frame_edit")]:
        with pytest.raises(BadInput, match=match):
            SampleSettings(**bad).validate()


def test_the_run_config_sample_section_sets_the_defaults():
    """A run's `sample` section (the demo's: 32×32, 8 frames, no score, guidance 4) replaces Open-Sora's defaults;
    a flag of jaxsora.sample replaces it; a run config without cfg_scale (older runs) keeps Open-Sora's 7.0."""
    from jaxsora.infer.pipeline import default_settings
    from jaxsora.sample import build_parser, make_settings

    run = {"sample": {"height": 32, "width": 32, "num_frames": 8, "fps": 8, "aes": None, "cfg_scale": 4.0}}
    s = default_settings(run)
    assert (s.image_size, s.num_frames, s.fps, s.aes, s.cfg_scale) == ((32, 32), 8, 8, None, 4.0)
    assert default_settings(run, cfg_scale=2.5).cfg_scale == 2.5
    assert default_settings({"sample": {"fps": 8}}).cfg_scale == default_settings(None).cfg_scale == 7.0
    assert make_settings(build_parser().parse_args(["run", "--prompt", "x"]), run).cfg_scale == 4.0
    assert make_settings(build_parser().parse_args(["run", "--prompt", "x", "--cfg-scale", "6"]), run).cfg_scale == 6.0
    assert make_settings(build_parser().parse_args(["run", "--prompt", "x"]), None).cfg_scale == 7.0


# ---- prompts ------------------------------------------------------------------------------
def test_scores_appended_as_the_reference():
    assert opt.append_score_to_prompts(["a cat"], aes=6.5) == ["a cat aesthetic score: 6.5."]
    assert opt.append_score_to_prompts(["a cat"], aes=6.5, flow=5, camera_motion="pan left") == [
        "a cat aesthetic score: 6.5. motion score: 5.0. camera motion: pan left."]
    assert opt.append_score_to_prompts(["a cat aesthetic score: 5.0."], aes=6.5) == ["a cat aesthetic score: 5.0."]
    assert opt.append_score_to_prompts(["a cat"]) == ["a cat"]
    # loop prompts get the scores per segment
    assert opt.prepare_prompt("|0|a cat|2| a dog", aes=6.5) == \
        "|0|a cat aesthetic score: 6.5.|2|a dog aesthetic score: 6.5."


def test_loop_prompts_and_json_suffix():
    p = "|0|a cat|2|a dog|3|a bird"
    assert opt.split_prompt(p) == (["a cat", "a dog", "a bird"], [0, 2, 3])
    assert [opt.extract_prompt_loop(p, i) for i in range(5)] == ["a cat", "a cat", "a dog", "a bird", "a bird"]
    assert opt.extract_prompt_loop("plain", 3) == "plain"
    text, info = opt.extract_json('A sunrise.{"reference_path": "a.png;b.png", "mask_strategy": "0;0,1,0,-1,1"}')
    assert text == "A sunrise." and info == {"reference_path": "a.png;b.png", "mask_strategy": "0;0,1,0,-1,1"}
    with pytest.raises(BadInput, match="invalid key"):
        opt.extract_json('x{"seed": 1}')
    with pytest.raises(BadInput, match="not JSON"):
        opt.extract_json("x{oops}")
    with pytest.raises(BadInput, match="loop"):
        opt.split_prompt("|0|a|x|b")
    assert opt.per_prompt("a.png", 3, "reference_path") == ["a.png"] * 3
    assert opt.per_prompt(None, 2, "x") == ["", ""]
    with pytest.raises(BadInput, match="one per prompt"):
        opt.per_prompt(["a", "b"], 3, "mask_strategy")


# ---- (d) mask strategies ------------------------------------------------------------------
def test_mask_strategy_parsing():
    assert parse_mask_strategy("0") == [MaskGroup(0, 0, 0, 0, 1, 0.0)]  # image-to-video
    assert parse_mask_strategy("") == [] and parse_mask_strategy(None) == []
    # the docs' examples (docs/commands.md, docs/config.md, configs/opensora-v1-1/inference/sample-ref.py)
    assert parse_mask_strategy("0,0,0,-8,8") == [MaskGroup(0, 0, 0, -8, 8, 0.0)]          # video extension
    assert parse_mask_strategy("0,0,-8,0,8") == [MaskGroup(0, 0, -8, 0, 8, 0.0)]
    assert parse_mask_strategy("0;0,1,0,-1,1") == [MaskGroup(0, 0, 0, 0, 1, 0.0),          # connecting
                                                   MaskGroup(0, 1, 0, -1, 1, 0.0)]
    assert parse_mask_strategy("0,0,0,0,32,0.4") == [MaskGroup(0, 0, 0, 0, 32, 0.4)]       # editing
    assert parse_mask_strategy("0,0,0,0,1;0,0,0,-1,1") == [MaskGroup(0, 0, 0, 0, 1, 0.0),
                                                           MaskGroup(0, 0, 0, -1, 1, 0.0)]
    assert parse_mask_strategy("1,1,-5,0,5,0.0") == [MaskGroup(1, 1, -5, 0, 5, 0.0)]       # what a loop appends
    for bad in ("0,0,0,0,1,0,0", "a", "0,,1", "0,0,0,0,1,x", "0;", "0,0,0,0,-1", "0,0,0,0,1,1.5"):
        with pytest.raises(BadInput, match="mask strategy"):
            parse_mask_strategy(bad)


def test_find_nearest_point_is_the_reference_s():
    # t = v // p; round up when the remainder is more than p/2 and t < max // p - 1
    assert [find_nearest_point(v, 5, 30) for v in (0, 2, 3, 7, 8, 13, 22, 25, 28)] == [0, 0, 5, 5, 10, 15, 20, 25, 25]
    assert find_nearest_point(14, 5, 15) == 10  # no rounding up into the last chunk
    assert find_nearest_point(13, 5, 15) == 10
    assert find_nearest_point(10, 5, 15) == 10


def test_mask_groups_placed_as_apply_mask_strategy():
    g = parse_mask_strategy
    # image-to-video at 51 frames (15 latent frames), an image reference (1 latent frame)
    assert place_group(g("0")[0], 1, 15, 5) == (0, 0, 1)
    # connecting: the "last frame" (-1 → 14) snaps to 10 with align = 5, as in Open-Sora 1.2
    assert place_group(g("0;0,1,0,-1,1")[1], 1, 15, 5) == (0, 10, 1)
    assert place_group(g("0;0,1,0,-1,1")[1], 1, 15, None) == (0, 14, 1)
    # extension at 102 frames (30 latent frames): -8 → 22 → 20, 8 frames of the reference
    assert place_group(g("0,0,0,-8,8")[0], 30, 30, 5) == (0, 20, 8)
    # what a loop appends with condition_frame_length 5: the reference clip's last 5 latent frames
    assert place_group(g("1,1,-5,0,5,0.0")[0], 15, 15, 5) == (10, 0, 5)
    # length limited by what is left in the sample and in the reference
    assert place_group(g("0,0,0,12,8")[0], 30, 15, None) == (0, 12, 3)
    assert place_group(g("0,0,25,0,8")[0], 30, 15, None) == (25, 0, 5)
    with pytest.raises(BadInput, match="outside the clip"):
        place_group(g("0,0,0,20,1")[0], 1, 15, None)


def test_build_condition_mask_and_latents():
    c, t, h, w = 2, 6, 1, 1
    ref0 = np.full((c, 1, h, w), 7.0, np.float32)
    ref1 = np.arange(c * 6, dtype=np.float32).reshape(c, 6, h, w)
    mask, x = build_condition(["0;0,1,2,3,2,0.5", ""], [[ref0, ref1], []], 0, (c, t, h, w), None)
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0.5, 0.5, 1], [1] * 6])
    np.testing.assert_array_equal(x[0, :, 0], ref0[:, 0])
    np.testing.assert_array_equal(x[0, :, 3:5], ref1[:, 2:4])
    assert build_condition(["", ""], [[], []], 0, (c, t, h, w), None) == (None, None)  # plain T2V: no mask
    # groups of other loops are skipped
    assert build_condition(["1,0"], [[ref0]], 0, (c, t, h, w), None) == (None, None)


def test_reference_counts_checked_up_front():
    opt.check_references("0;0,1,0,-1,1", "a.png;b.png", 1)
    opt.check_references("1,1,-5,0,5", "a.png", 2)  # loop 1 may use the clip loop 0 appended
    with pytest.raises(BadInput, match="uses reference 1"):
        opt.check_references("0;0,1,0,-1,1", "a.png", 1)
    with pytest.raises(BadInput, match="give --reference-path"):
        opt.check_references("0", "", 1)
    with pytest.raises(BadInput, match="is for loop 2"):
        opt.check_references("2,0", "a.png", 2)
    assert issubclass(BadInput, UserError)


def test_sampler_per_sample_keys_are_batch_independent():
    """rflow.denoise with a [B] array of keys: each row's re-noising (and so its result) depends
    on its own key only."""
    import jax
    import jax.numpy as jnp

    from jaxsora.diffusion import rflow

    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 2, 3, 2, 2)).astype(np.float32)
    ref = rng.standard_normal(z.shape).astype(np.float32)
    edit = np.array([[0.0, 0.6, 1.0], [0.3, 1.0, 1.0]], np.float32)
    y = rng.standard_normal((2, 1, 3, 2)).astype(np.float32)

    def fn(x, t, *, y, mask, x_mask=None):
        return jnp.concatenate([jnp.sin(x) + jnp.mean(y, axis=(1, 2, 3))[:, None, None, None, None], x * 0], 1)

    ts = rflow.sampling_timesteps(4, [64, 64], [64, 64], [17, 17])
    keys = jax.random.split(jax.random.key(3), 2)
    cond = dict(y=y, mask=np.ones((2, 3), np.int32))
    both = rflow.denoise(fn, z, cond, y[0, 0], ts, key=keys, mask=edit, x_cond=ref)
    one = rflow.denoise(fn, z[1:], dict(y=y[1:], mask=cond["mask"][1:]), y[0, 0], ts[:, 1:], key=keys[1:],
                        mask=edit[1:], x_cond=ref[1:])
    np.testing.assert_allclose(np.asarray(both)[1], np.asarray(one)[0], rtol=1e-6, atol=1e-6)
    other = rflow.denoise(fn, z, cond, y[0, 0], ts, key=jax.random.split(jax.random.key(4), 2), mask=edit, x_cond=ref)
    assert not np.allclose(np.asarray(other)[1], np.asarray(both)[1])
