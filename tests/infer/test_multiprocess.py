"""`python -m jaxsora.sample` in 2 processes (jax.distributed on 127.0.0.1, one CPU device each),
as on 2 hosts: the same videos and sidecars as one process with 2 devices, written by process 0
only — with the prompts sharded over the processes (--dp-size 2) and with each video's tokens
spread over them (Ulysses, --sp-size 2); user mistakes end both processes with one line and exit
code 2, no hang.

The sampler runs through run_sample.py, which also saves each video's frames losslessly (.mp4.npy):
the frames are compared, not the mp4s (this tests the sampler, not the encoder; equal frames giving
equal mp4 bytes is `tests/data/test_video.py::test_the_same_frames_give_the_same_file`).
Every run is started at once (the module fixture); each test waits for its own."""
import os
import subprocess

import pytest

from tests.conftest import REPO
from tests.ports import free_port
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

PROMPTS = ["wave 0.50", "wave 1.50", "wave 2.50"]  # 3 prompts in batches of 2: the second batch is padded
RUNNER = os.path.join(os.path.dirname(__file__), "run_sample.py")  # python -m jaxsora.sample, + the frames
TIMEOUT = 240  # seconds a run may take (the runs share 2 cores); jax.distributed waits up to half of it


def _env(devices: int, **extra) -> dict:
    cache = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")  # tests/conftest.py's
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k in cache}
    return {**env, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "JAXSORA_INIT_TIMEOUT": str(TIMEOUT // 2),
            "XLA_FLAGS": cpu_flags(devices), **extra}


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, RUNNER, *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Job:
    """Processes of one run: one with 2 devices, or 2 under jax.distributed (process i gets args(i))."""

    def __init__(self, args, processes: int = 1):
        if processes == 1:
            self.procs = [_start(args(0), _env(2, JAX_NUM_PROCESSES="1"))]
        else:
            multi = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(processes))
            self.procs = [_start(args(i), _env(1, **multi, JAX_PROCESS_ID=str(i))) for i in range(processes)]
        self._results = None

    def results(self) -> list[tuple[int, str, str]]:
        """(exit code, stdout, stderr) of each process; a run past TIMEOUT is killed and fails the test."""
        if self._results is None:
            try:
                outs = [p.communicate(timeout=TIMEOUT) for p in self.procs]
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"a sampler process hung (still running after {TIMEOUT} s)")
            self._results = [(p.returncode, o, e) for p, (o, e) in zip(self.procs, outs)]
        return self._results

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.fixture(scope="module")
def jobs(run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    (tmp / "prompts.txt").write_text("".join(p + "\n" for p in PROMPTS))
    common = ["--ckpt", run, "--prompt-file", tmp / "prompts.txt", "--num-sampling-steps", 2, "--batch-size", 2,
              "--seed", 7]
    meshes = {"dp": ["--dp-size", 2], "sp": ["--dp-size", 1, "--sp-size", 2]}
    started = {}
    for name, mesh in meshes.items():
        # process i writes to <name>/p<i>: only p0 may appear (the output folder is all that differs)
        started[name] = Job(lambda i, name=name, mesh=mesh: [*common, *mesh, "--output", tmp / name / f"p{i}"], 2)
        started[name + "-ref"] = Job(lambda i, name=name, mesh=mesh: [*common, *mesh, "--output", tmp / f"{name}-ref"])
    started["missing"] = Job(lambda i: [*common[2:], "--ckpt", tmp / "nowhere", "--dp-size", 2], 2)
    started["differ"] = Job(lambda i: [*common, "--dp-size", 2, "--output", tmp / "differ", "--seed", 7 + i], 2)
    yield tmp, started
    for job in started.values():
        job.kill()


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp", "sp"])
def test_two_processes_write_what_one_process_writes(jobs, mesh):
    tmp, started = jobs
    (rc0, out0, err0), (rc1, out1, err1) = started[mesh].results()
    assert rc0 == 0 and rc1 == 0, (err0[-3000:], err1[-3000:])
    (rc, _, err), = started[mesh + "-ref"].results()
    assert rc == 0, err[-3000:]
    ref, got = tmp / f"{mesh}-ref", tmp / mesh / "p0"
    names = sorted(os.listdir(ref))
    assert names == [f"sample_000{i}.{e}" for i in range(3) for e in ("json", "mp4", "mp4.npy")]
    assert sorted(os.listdir(got)) == names
    assert not (tmp / mesh / "p1").exists(), "process 1 wrote files"
    for name in names:  # byte for byte: the frames (.mp4.npy) and the sidecars
        if not name.endswith(".mp4"):
            assert (got / name).read_bytes() == (ref / name).read_bytes(), name
    assert out0.count(" → ") == 3 and " → " not in out1  # the list of files: process 0's
    assert "2 processes, 2 devices" in out0
    assert "sampling" in err0 and "prompts" in err0  # the progress bars show on process 0 only
    assert "sampling" not in err1 and "prompts" not in err1 and "[jaxsora.sample]" not in err1, err1[-3000:]


def _one_line_each(job, needle):
    for rc, _, err in job.results():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, (rc, err[-3000:])
        assert lines[0].startswith("jaxsora.sample: ") and needle in lines[0], lines[0]


def test_user_mistakes_end_both_processes_with_one_line(jobs):
    """A missing checkpoint (found before connecting), and processes given different flags (found
    after connecting, by all of them together)."""
    tmp, started = jobs
    _one_line_each(started["missing"], "checkpoint folder not found")
    _one_line_each(started["differ"], "process 1 of 2 was given other prompts or flags than process 0")
    assert not (tmp / "differ").exists()
