"""The Gradio page over a `Studio` (Open-Sora 1.2's `gradio/app.py` layout: the prompt, the basic settings, the
scores and camera motion, the advanced settings and the reference on the left; the video on the right).

Only the choices the checkpoint serves are offered (`jaxsora.app.offer`); the length is a list of the trained
lengths that also takes a typed one. Every request goes through one queue that runs one at a time, with a
progress bar of the sampling steps (the pipeline's tqdm bars, tracked by Gradio); its answer — the video, the
files to download (the video and its settings) or the message saying why nothing was sampled — appears in the
page. Gradio is imported here only: the rest of the app runs without it.
"""
from __future__ import annotations

import os

from jaxsora.app.offer import CAMERA_MOTIONS, IMAGE, Request, length_name, parse_length
from jaxsora.errors import BadInput

# Open-Sora 1.2's gradio/app.py: its sliders' ranges and defaults.
STEPS_RANGE = (1, 200)
CFG_RANGE = (0.0, 15.0)
AES_RANGE, AES_DEFAULT = (4.0, 7.0), 6.5
FLOW_RANGE, FLOW_DEFAULT = (0, 100), 5
FPS_RANGE = (1, 60)
LOOP_RANGE = (1, 20)
SEED_RANGE = (0, 2**31 - 1)


def initial_choices(offer, settings) -> tuple[str, str, str]:
    """The page's first resolution, aspect ratio and length: the settings' (flags, config file or the run's
    sample size) where offered, else the first offered ones."""
    res = ar = None
    if settings.image_size is not None:
        found = offer.find(*settings.image_size)
        if found:
            res, ar = found
    elif settings.resolution in offer.resolutions and settings.aspect_ratio in offer.resolutions[settings.resolution]:
        res, ar = settings.resolution, settings.aspect_ratio
    if res is None:
        res = next(iter(offer.resolutions))
        ar = offer.resolutions[res][0]
    try:
        frames = parse_length(settings.num_frames)
    except BadInput:
        frames = 0
    lengths = offer.lengths[res]
    if frames not in lengths:
        frames = next((n for n in lengths if n > 1), lengths[0])
    return res, ar, length_name(frames)


def page_css(offer) -> str:
    """The page's style: a checkpoint whose videos are all small (the demo's 32×32) shows them enlarged pixel for
    pixel instead of blurred."""
    largest = max(max(offer.size(res, ar)) for res, names in offer.resolutions.items() for ar in names)
    return "#video video, #image img { image-rendering: pixelated; }" if largest <= 128 else ""


def status_line(result, settings_text: str) -> str:
    if not result.ok:
        return f"**Not sampled:** {result.error}"
    name = os.path.basename(result.media)
    how = "compiled the sampler for this shape" if result.compiled else "reused the sampler compiled for this shape"
    return (f"**{name}** — {settings_text}: sampled in {result.seconds:.1f} s ({how}). Saved with its "
            f"settings as {os.path.basename(result.sidecar)}.")


def build_page(studio, examples: list[str] | None = None, title: str = "jaxsora"):
    """The gr.Blocks page of `studio` (not launched)."""
    import gradio as gr

    offer, d = studio.offer, studio.defaults
    res0, ar0, len0 = initial_choices(offer, d)
    pipe = studio.pipe

    def lengths_info(res: str) -> str:
        return (f"an image, a duration (2s) or a number of frames: at most {offer.max_frames(res)} here (the "
                "longest this checkpoint was trained on)")

    with gr.Blocks(title=title, analytics_enabled=False) as page:
        gr.Markdown(f"# {title}\n`{pipe.step_dir}` — step {pipe.step}, {pipe.weights} weights. Choices from "
                    f"{offer.source}. Videos are saved in `{studio.output}` with their settings.",
                    elem_id="header")
        with gr.Row():
            with gr.Column():
                prompt = gr.Textbox(label="Prompt", placeholder="Describe your video here", lines=3, elem_id="prompt")
                if examples:
                    gr.Examples(examples=[[e] for e in examples], inputs=[prompt], label="Examples",
                                examples_per_page=24)
                gr.Markdown("## Basic settings")
                resolution = gr.Radio(list(offer.resolutions), value=res0, label="Resolution", elem_id="resolution")
                aspect = gr.Radio(offer.resolutions[res0], value=ar0, label="Aspect ratio (H:W)", elem_id="aspect")
                length = gr.Dropdown(offer.length_names(res0), value=len0, allow_custom_value=True, label="Length",
                                     info=lengths_info(res0), elem_id="length")
                with gr.Row():
                    seed = gr.Number(value=int(d.seed), precision=0, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1],
                                     label="Seed", elem_id="seed")
                    steps = gr.Slider(*STEPS_RANGE, value=int(d.num_sampling_steps), step=1, label="Sampling steps",
                                      elem_id="steps")
                    cfg = gr.Slider(*CFG_RANGE, value=float(d.cfg_scale), step=0.1, label="Guidance (CFG scale)",
                                    elem_id="cfg")
                with gr.Row(visible=offer.aes or offer.motion):
                    with gr.Column(visible=offer.motion):
                        flow = gr.Slider(*FLOW_RANGE, value=d.flow if d.flow is not None else FLOW_DEFAULT, step=1,
                                         label="Motion score", info="videos only")
                        use_flow = gr.Checkbox(value=d.flow is not None, label="Enable")
                    with gr.Column(visible=offer.aes):
                        aes = gr.Slider(*AES_RANGE, value=d.aes if d.aes is not None else AES_DEFAULT, step=0.1,
                                        label="Aesthetic score")
                        use_aes = gr.Checkbox(value=d.aes is not None, label="Enable")
                camera = gr.Radio(list(CAMERA_MOTIONS), value=d.camera_motion or "none", label="Camera motion",
                                  visible=offer.motion)
                with gr.Accordion("Advanced settings", open=False):
                    fps = gr.Slider(*FPS_RANGE, value=float(d.fps), step=1, label="FPS",
                                    info="told to the model and of the video")
                    loop = gr.Slider(*LOOP_RANGE, value=1, step=1, label="Loops",
                                     info="clips chained, each continuing the last frames of the one before")
                gr.Markdown("## Reference (image-to-video)")
                reference = gr.File(label="Reference image or video", file_types=["image", "video"],
                                    elem_id="reference")
                mask = gr.Textbox(value="0", label="Mask strategy", elem_id="mask",
                                  info="0: the reference is the first frame; groups loop,ref,ref_start,target_start,"
                                       "length,edit_ratio separated by ';' (as jaxsora.sample --mask-strategy)")
            with gr.Column():
                button = gr.Button("Generate", variant="primary", elem_id="generate")
                video = gr.Video(label="Video", elem_id="video", autoplay=True, loop=True, interactive=False,
                                 height=384)
                image = gr.Image(label="Image", elem_id="image", visible=False, interactive=False, height=384)
                files = gr.File(label="Download: the video and its settings", elem_id="files", file_count="multiple",
                                interactive=False)
                status = gr.Markdown(elem_id="status")

        def on_resolution(res):
            if res not in offer.resolutions:
                return gr.update(), gr.update()
            names = offer.length_names(res)
            return (gr.update(choices=offer.resolutions[res], value=offer.resolutions[res][0]),
                    gr.update(choices=names, value=next((n for n in names if n != IMAGE), names[0]),
                              info=lengths_info(res)))

        resolution.change(on_resolution, inputs=[resolution], outputs=[aspect, length], queue=False)

        tracked = gr.Progress(track_tqdm=True)  # the pipeline's tqdm bars (the steps) as this request's bar

        def run(prompt_, res, ar, length_, seed_, steps_, cfg_, flow_, use_flow_, aes_, use_aes_, camera_, fps_,
                loop_, reference_, mask_, progress=tracked):
            req = Request(prompt=prompt_ or "", resolution=res, aspect_ratio=ar, length=length_, seed=seed_,
                          steps=steps_, cfg_scale=cfg_, aes=aes_ if use_aes_ else None,
                          flow=flow_ if use_flow_ else None, camera_motion=camera_, reference=reference_,
                          mask_strategy=mask_, loop=loop_, fps=fps_)
            result = studio.generate(req)
            if not result.ok:
                return gr.update(value=None), gr.update(value=None, visible=False), None, status_line(result, "")
            t, h, w = result.shape
            text = (f"{length_name(t) if t > 1 else IMAGE} at {res} {ar} ({t}×{h}×{w}), seed {int(seed_)}, "
                    f"{int(steps_)} steps, guidance {float(cfg_):g}" + (", from the reference" if reference_ else ""))
            files_ = [result.media, result.sidecar]
            if result.media.endswith(".png"):
                return (gr.update(value=None, visible=False), gr.update(value=result.media, visible=True), files_,
                        status_line(result, text))
            return (gr.update(value=result.media, visible=True), gr.update(value=None, visible=False), files_,
                    status_line(result, text))

        button.click(run, inputs=[prompt, resolution, aspect, length, seed, steps, cfg, flow, use_flow, aes, use_aes,
                                  camera, fps, loop, reference, mask],
                     outputs=[video, image, files, status], concurrency_limit=1, concurrency_id="sampler")
    # one request samples at a time, the others wait in the queue (their place shown on their page)
    page.queue(default_concurrency_limit=1)
    return page
