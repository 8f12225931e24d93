"""`python -m jaxsora.sample ARGS`, with every video also saved losslessly as <name>.mp4.npy (its
[T, H, W, 3] uint8 frames) for test_multiprocess.py to compare exactly: the sampler's output itself,
not the encoder's.

usage: run_sample.py ARGS...   (the sampler's own arguments; the JAX_* variables as for it)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import numpy as np  # noqa: E402

from jaxsora.data import video  # noqa: E402
from jaxsora.errors import run_cli  # noqa: E402
from jaxsora.sample import main  # noqa: E402
from tests.multiprocess_cache import share_compilation_cache  # noqa: E402

_write_mp4 = video.write_mp4


def write_mp4(frames, path, fps, **kw):
    np.save(path + ".npy", np.asarray(frames))
    return _write_mp4(frames, path, fps, **kw)


video.write_mp4 = write_mp4  # write_samples imports it when it writes
share_compilation_cache()
sys.exit(run_cli("jaxsora.sample", main))
