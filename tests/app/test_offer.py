"""What the app's page offers for a checkpoint and how it reads a request (`jaxsora.app.offer`, `page.initial_choices`):
plain Python, no model. The page in a browser is tests/app/test_app_browser.py."""
import pytest

from jaxsora.app.offer import Offer, Request, length_name, offer_for, parse_length, settings_for
from jaxsora.app.page import initial_choices, page_css
from jaxsora.errors import BadInput
from jaxsora.infer.options import SampleSettings, default_settings
from jaxsora.opensora_config.reader import plain


def _config(name):
    import importlib

    return plain(importlib.import_module(f"configs.{name}").get_config())


def test_the_demo_offers_its_32x32_table_an_image_or_8_frames_and_no_scores():
    offer = offer_for(_config("demo"))
    assert offer.resolutions == {"demo32": ["1:1"]}  # no 720p: the demo's table has one 32×32 entry
    assert offer.lengths == {"demo32": [1, 8]}
    assert offer.length_names("demo32") == ["image", "8 frames"]
    assert offer.size("demo32", "1:1") == (32, 32)
    assert (offer.aes, offer.motion) == (False, False)  # its captions carry neither score


def test_a_stage_run_offers_what_each_resolution_trained_on():
    offer = offer_for(_config("stage3"))
    assert "720p" in offer.resolutions and "1080p" in offer.resolutions
    assert offer.length_names("720p") == ["image", "2s", "4s"]  # 8s at 720p has keep_prob 0: not trained
    assert offer.length_names("1080p") == ["image"]
    assert offer.length_names("240p") == ["image", "2s", "4s", "8s", "16s"]
    assert offer.resolutions["240p"] == ["9:16", "16:9", "3:4", "4:3", "1:1"]  # Open-Sora's app's five
    assert (offer.aes, offer.motion) == (True, True)


def test_a_converted_checkpoint_offers_open_soras_app_choices():
    offer = offer_for(None)
    assert list(offer.resolutions) == ["144p", "240p", "360p", "480p", "720p"]
    assert offer.length_names("720p") == ["image", "2s", "4s", "8s", "16s"]
    assert offer.size("240p", "9:16") == (240, 426)


@pytest.mark.parametrize("text,frames", [("image", 1), ("2s", 51), ("16s", 408), ("8 frames", 8), ("8", 8),
                                         (" 1 frame ", 1)])
def test_lengths_read_as_the_page_gives_them(text, frames):
    assert parse_length(text) == frames
    assert parse_length(length_name(frames)) == frames


def _demo():
    run = _config("demo")
    return offer_for(run), default_settings(run)


def test_a_request_becomes_the_samplers_settings():
    offer, base = _demo()
    s = settings_for(Request("a red circle moving right", "demo32", "1:1", "8 frames", seed=7.0, steps=12.0,
                             cfg_scale=2.5, aes=6.5, flow=5, camera_motion="pan left"), offer, base)
    assert (s.resolution, s.aspect_ratio, s.image_size, s.num_frames) == ("demo32", "1:1", None, 8)
    assert (s.seed, s.num_sampling_steps, s.cfg_scale, s.fps) == (7, 12, 2.5, base.fps)
    assert (s.aes, s.flow, s.camera_motion) == (None, None, None)  # not offered: never appended
    assert s.reference_path is None and s.mask_strategy is None
    assert s.validate(offer.extra_resolutions).height == 32
    ref = settings_for(Request("x", "demo32", "1:1", "8", reference="/tmp/a.png", mask_strategy=""), offer, base)
    assert (ref.reference_path, ref.mask_strategy) == ("/tmp/a.png", "0")  # a reference is the first frame


def test_scores_are_appended_where_offered_and_the_motion_ones_for_videos_only():
    offer, base = offer_for(None), SampleSettings()
    s = settings_for(Request("x", "240p", "9:16", "2s", aes=6.0, flow=5, camera_motion="pan left"), offer, base)
    assert (s.aes, s.flow, s.camera_motion) == (6.0, 5, "pan left")
    s = settings_for(Request("x", "240p", "9:16", "image", aes=6.0, flow=5, camera_motion="pan left"), offer, base)
    assert (s.aes, s.flow, s.camera_motion) == (6.0, None, None)


@pytest.mark.parametrize("request_,message", [
    (Request("  ", "demo32", "1:1", "8"), "the prompt is empty"),
    (Request("x", "720p", "9:16", "8"), "resolution '720p' is not one this checkpoint serves (demo32)"),
    (Request("x", "demo32", "9:16", "8"), "aspect ratio '9:16' is not offered at demo32 (1:1)"),
    (Request("x", "demo32", "1:1", "64"), "64 frames is more than this checkpoint takes at demo32: it was trained "
                                          "on image, 8 frames (at most 8 frames)"),
    (Request("x", "demo32", "1:1", "long"), "length 'long'"),
    (Request("x", "demo32", "1:1", "8", steps=0), "steps must be a whole number of at least 1"),
    (Request("x", "demo32", "1:1", "8", seed=1.5), "seed must be a whole number"),
    (Request("x", "demo32", "1:1", "image", reference="a.png", mask_strategy="0,0,0,4,1"), "an image has one frame"),
])
def test_requests_the_checkpoint_cannot_serve_are_one_line_messages(request_, message):
    offer, base = _demo()
    with pytest.raises(BadInput) as e:
        settings_for(request_, offer, base)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_pages_first_values_are_the_samplers_defaults_where_offered():
    offer, base = _demo()
    assert initial_choices(offer, base) == ("demo32", "1:1", "8 frames")  # the run's sample size: 32×32, 8 frames
    stage = offer_for(_config("stage3"))
    assert initial_choices(stage, SampleSettings(resolution="720p", aspect_ratio="16:9", num_frames="4s")) == (
        "720p", "16:9", "4s")
    # 16s at 720p was not trained: the first video length offered there instead
    assert initial_choices(stage, SampleSettings(resolution="720p", aspect_ratio="9:16", num_frames="16s")) == (
        "720p", "9:16", "2s")
    # a size no table of the run has: the first choices
    assert initial_choices(offer, SampleSettings(image_size=(48, 64))) == ("demo32", "1:1", "8 frames")
    assert initial_choices(Offer({"240p": ["9:16"]}, {"240p": [1]}), SampleSettings()) == ("240p", "9:16", "image")


def test_small_videos_are_shown_pixel_for_pixel():
    assert "pixelated" in page_css(offer_for(_config("demo")))
    assert page_css(offer_for(None)) == ""  # 144p-720p: scaled smoothly
