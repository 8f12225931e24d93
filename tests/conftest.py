"""Test-session setup shared by every test.

* 8 fake CPU devices, so mesh tests run in-process (must be set before jax is imported).
* Goldens live in tests/fixtures/ with the recipe that made them (tests/fixtures/README.md).
"""
import os
import pathlib
import tempfile

from tests.xla_flags import cpu_flags

os.environ.setdefault("XLA_FLAGS", cpu_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
# libtpu (the `tpu` extra) lets one process at a time load it unless told otherwise; the tests only compile for
# TPU topologies (no chip is opened), so several workers may (docs/training/tpu.md)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent compilation cache for the whole session, subprocesses included (the loop tests
# compile the same small train step many times).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxsora-test-jax-cache"))
# Every program, not only those that compile in over a second (jax's default): a CLI test's process compiles
# hundreds of small ones (initializers, the checkpoint fingerprints, the sampler's pieces), which add up to
# seconds per process and are read back in milliseconds.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
REPO = pathlib.Path(__file__).parent.parent


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (the parity metric the issues name)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture
def fixtures_dir() -> pathlib.Path:
    return FIXTURES


_ZYGOTE = None


def pytest_configure(config):
    """Start this process's zygote (tests/zygote.py) before the test modules are imported: they take
    `tests.zygote.PYTHON` (the launcher) instead of sys.executable for the commands they run. Not in
    pytest-xdist's controller, which runs no test."""
    global _ZYGOTE
    from tests import zygote

    if os.environ.get("JAXSORA_TEST_ZYGOTE") == "0" or (config.getoption("dist", "no") != "no"
                                                       and not hasattr(config, "workerinput")):
        return
    _ZYGOTE = zygote.Zygote()
    _ZYGOTE.start(dict(os.environ))
    zygote.PYTHON = _ZYGOTE.python


def pytest_unconfigure(config):
    if _ZYGOTE is not None:
        _ZYGOTE.stop()


def pytest_collection_modifyitems(config, items):
    """Files holding `slow` tests run first, the longest first (`@pytest.mark.slow(seconds=N)`, default 20),
    stable otherwise: `make test` hands whole files to its workers (pytest-xdist, `--dist loadfile`) in this
    order, so the longest ones — the README walk, the multi-process runs — start at once instead of leaving
    one worker busy at the end."""
    seconds: dict = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            seconds[item.fspath] = max(seconds.get(item.fspath, 0), mark.kwargs.get("seconds", 20))
    items.sort(key=lambda item: -seconds.get(item.fspath, 0))
