"""The app's sampling service: one `Pipeline` (jaxsora.infer), one request at a time, each video written with its
sidecar as `jaxsora.sample` writes them. No Gradio here: the page (`jaxsora.app.page`) calls `Studio.generate`.

- One at a time per device: the pipeline spans every device of its mesh, and a lock lets one request sample at
  a time (the page's queue also runs one; the lock holds for any other caller).
- Compiled samplers are kept per shape: the pipeline's jitted functions cache one program per shape (rows,
  latent frames × height × width, steps, with or without a reference). `Studio.generate` reads the pipeline's
  trace counts around each request, so every result says whether it compiled or reused a sampler.
- Files: `<output>/sample_NNNN.mp4` (one frame: .png) and `sample_NNNN.json` (`write_samples`: the prompt as
  given and as fed, the seed, every setting, the checkpoint), numbered on from what the folder holds; an
  uploaded reference is copied beside them (`sample_NNNN_reference.<ext>`) and the sidecar names that copy.
  The sidecar's "app" entry says when the request started and finished sampling and whether it compiled.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import threading
import time
import traceback

from jaxsora.app.offer import Offer, Request, settings_for
from jaxsora.errors import UserError
from jaxsora.infer.options import SampleSettings

_NUMBERED = re.compile(r"^sample_(\d+)")


@dataclasses.dataclass
class Result:
    """A finished request: `media` the mp4 (or png), `sidecar` its JSON; or `error` the message for the page."""
    media: str | None = None
    sidecar: str | None = None
    error: str | None = None
    compiled: bool = False
    seconds: float = 0.0
    waited: float = 0.0
    shape: tuple = ()

    @property
    def ok(self) -> bool:
        return self.error is None


def user_message(e: BaseException) -> str:
    """A user error's message as the page shows it: the sampler's flag names read as the page's."""
    msg = str(e)
    for flag, word in (("--reference-path: ", "reference: "), ("--mask-strategy", "mask strategy")):
        msg = msg.replace(flag, word)
    return msg


class Studio:
    """pipe: a loaded `jaxsora.infer.Pipeline`; offer: what the page offers (`offer_for`); defaults: the page's
    initial settings (also what a request leaves unset); output: where the videos go."""

    def __init__(self, pipe, offer: Offer, defaults: SampleSettings, output: str, log=sys.stderr):
        self.pipe, self.offer, self.defaults, self.output = pipe, offer, defaults, output
        self.log = log
        self.lock = threading.Lock()
        self.shapes: set[tuple] = set()  # sampler shapes compiled in this process
        self.served = 0
        os.makedirs(output, exist_ok=True)

    def _next_index(self) -> int:
        taken = [int(m.group(1)) for name in os.listdir(self.output) if (m := _NUMBERED.match(name))]
        return max(taken, default=-1) + 1

    def _traces(self) -> int:
        return sum(self.pipe.trace_counts.values())

    def check_reference(self, settings: SampleSettings) -> None:
        """Read the uploaded reference at the sample's size (the pipeline's own reader): an unreadable file is a
        BadInput before the request waits for its turn."""
        from jaxsora.infer.conditioning import read_reference

        if settings.reference_path:
            r = settings.validate(self.pipe.extra_resolutions)
            read_reference(str(settings.reference_path), r.height, r.width)

    def generate(self, request: Request, progress: bool = True) -> Result:
        """Sample one request (waiting for the one before it). A user error is a Result with its `error`; any
        other failure too, its traceback on the server's log, and the service keeps serving."""
        came = time.time()
        try:
            settings = settings_for(request, self.offer, self.defaults)
            resolved = settings.validate(self.pipe.extra_resolutions)
            self.check_reference(settings)
        except UserError as e:
            return Result(error=user_message(e))
        shape = (resolved.num_frames, resolved.height, resolved.width)
        with self.lock:
            started = time.time()
            try:
                return self._generate(request.prompt.strip(), settings, shape, came, started, progress)
            except UserError as e:
                return Result(error=user_message(e), waited=started - came)
            except Exception as e:  # noqa: BLE001 — a bug or the device: said on the page, the traceback logged
                traceback.print_exc(file=self.log)
                text = str(e).splitlines()[0] if str(e) else ""
                if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                    return Result(error=f"out of device memory sampling {shape[0]}×{shape[1]}×{shape[2]}: choose a "
                                        "lower resolution or a shorter length", waited=started - came)
                return Result(error=f"sampling failed: {type(e).__name__}: {text} (the traceback is in the "
                                    "server's log)", waited=started - came)

    def _generate(self, prompt: str, settings: SampleSettings, shape: tuple, came: float, started: float,
                  progress: bool) -> Result:
        from jaxsora.infer.writing import write_samples

        traces = self._traces()
        video = self.pipe.generate([prompt], settings, progress=progress)[0]
        compiled = self._traces() > traces
        key = (shape, int(settings.num_sampling_steps), bool(settings.reference_path), int(settings.loop))
        if compiled:
            self.shapes.add(key)
        index = self._next_index()
        written = settings
        if settings.reference_path:  # the upload lives in the server's temp folder: keep a copy beside the video
            src = str(settings.reference_path)
            copy = os.path.join(self.output, f"sample_{index:04d}_reference{os.path.splitext(src)[1].lower()}")
            shutil.copyfile(src, copy)
            written = settings.replace(reference_path=copy)
        finished = time.time()
        app = {"request": self.served, "started": round(started, 3), "finished": round(finished, 3),
               "compiled": compiled}
        media = write_samples([video], [prompt], written, self.output, {**self.pipe.meta(), "app": app},
                              start_index=index)[0]
        self.served += 1
        print(f"[jaxsora.app] {os.path.basename(media)}: {prompt!r} {shape[0]}×{shape[1]}×{shape[2]}, "
              f"{settings.num_sampling_steps} steps, {'compiled' if compiled else 'reused'} the sampler, "
              f"{finished - started:.1f} s (waited {started - came:.1f} s)", file=self.log, flush=True)
        return Result(media=media, sidecar=os.path.splitext(media)[0] + ".json", compiled=compiled,
                      seconds=finished - started, waited=started - came, shape=shape)


def describe_offer(offer: Offer) -> list[str]:
    """The offer in lines (the console at start, `--dry-run`)."""
    lines = [f"choices from {offer.source}:"]
    for res, names in offer.resolutions.items():
        sizes = ", ".join(f"{n} {'×'.join(map(str, offer.size(res, n)))}" for n in names)
        lines.append(f"  {res}: {sizes}; lengths {', '.join(offer.length_names(res))}")
    lines.append(f"  aesthetic score: {'offered' if offer.aes else 'not offered (the run samples without it)'}; "
                 f"motion score and camera motion: {'offered' if offer.motion else 'not offered'}")
    return lines

