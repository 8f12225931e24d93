"""jaxsora.parallel.distributed: which settings win (flags > JAX_* variables > the cluster jax detects),
what jax's own detection gives under a fake SLURM job (and the two places jaxsora corrects it), one-line
errors for settings that do not fit, the single-process path, and a real two-process start on 127.0.0.1
with conflicting SLURM variables around it."""
import os
import subprocess

import jax
import pytest
from jax._src import clusters

from jaxsora.errors import EXIT_USER_ERROR, UserError
from jaxsora.parallel import distributed
from jaxsora.parallel.distributed import DistributedError, first_slurm_host, plan, resolve
from tests.conftest import REPO
from tests.ports import free_port
from tests.xla_flags import cpu_flags
from tests.zygote import PYTHON

MANAGED = ("SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "JOB_COMPLETION_INDEX", "JAX_COORDINATOR", "JAX_NUM_PROCESSES",
           "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "JAXSORA_INIT_TIMEOUT", "TPU_")


def _slurm(ntasks=4, procid=2, localid=0, nodes=4, nodelist="gpu[03-04,07,11]", job="123457"):
    """The variables srun gives a task (those jax reads, plus the job-wide node list)."""
    return dict(SLURM_JOB_ID=job, SLURM_JOB_NODELIST="gpu[01-16]", SLURM_STEP_NODELIST=nodelist,
                SLURM_NTASKS=str(ntasks), SLURM_PROCID=str(procid), SLURM_LOCALID=str(localid),
                SLURM_STEP_NUM_NODES=str(nodes), SLURM_NNODES="16")


@pytest.fixture
def env(monkeypatch):
    """A clean process environment (no cluster, no JAX_* settings); returns a setter."""
    for key in list(os.environ):
        if key.startswith(MANAGED):
            monkeypatch.delenv(key)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))
    return set_env


@pytest.fixture
def fake_jax(monkeypatch):
    """jax.distributed.initialize recording its arguments instead of starting anything."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(distributed, "_announced", False)
    return calls


def _jax_autodetect():
    """What jax.distributed.initialize() would compute on its own here (its detection function)."""
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, None)


def test_nothing_set_is_a_single_process(env, fake_jax, capsys):
    assert resolve() is None
    assert distributed.initialize() is False and fake_jax == []
    out = capsys.readouterr().out
    assert out == "[jaxsora] single process (no multi-host flags, JAX_* variables or detected cluster)\n"


def test_slurm_is_detected_by_jax(env):
    env(**_slurm())
    coordinator, n, i, _ = _jax_autodetect()
    args, source = plan()
    # jax's own numbers: first host of the step's node list, port from the job id, SLURM_NTASKS, SLURM_PROCID
    assert args == dict(coordinator_address=coordinator, num_processes=n, process_id=i)
    assert args == dict(coordinator_address=f"gpu03:{123457 % 4096 + 61440}", num_processes=4, process_id=2)
    assert source == "slurm (detected by jax)"
    env(JAX_COORDINATOR_PORT=12355)  # jax's port override
    assert resolve()["coordinator_address"] == "gpu03:12355" == _jax_autodetect()[0]


def test_the_step_node_list_wins_over_the_job_node_list(env):
    """A step on a subset of the job's nodes: its coordinator is the step's first node, not the job's."""
    env(**_slurm(nodelist="gpu[05-06]", ntasks=2, nodes=2, procid=1))
    assert resolve()["coordinator_address"].startswith("gpu05:")


@pytest.mark.parametrize("nodelist, host", [
    ("gpu07", "gpu07"), ("gpu07,cpu1", "gpu07"), ("node[01-04,07],other", "node01"), ("node[07,01-04]", "node07"),
    ("rack[1-2]-gpu[1-4]", "rack1-gpu1"),  # jax's parser (and the old hand parser) say 'rack1'
    ("node[001]", "node001"), ("a[1-2],b[3-4]", "a1"), ("10.0.0.5", "10.0.0.5"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_several_bracket_ranges_give_a_real_host(env):
    env(**_slurm(nodelist="rack[1-2]-gpu[1-4]", ntasks=8, nodes=8, procid=5))
    assert resolve()["coordinator_address"] == f"rack1-gpu1:{123457 % 4096 + 61440}"


def test_one_task_per_node_keeps_every_gpu_several_keep_jax_one_each(env):
    # jax alone restricts every SLURM task to the GPU of its local rank
    env(**_slurm(ntasks=2, nodes=2, procid=1, localid=0))
    assert _jax_autodetect()[3] == [0]
    assert "local_device_ids" not in resolve()  # jaxsora's layout: one task per node, all its GPUs
    env(**_slurm(ntasks=16, nodes=2, procid=9, localid=1))  # 8 tasks per node: one GPU each, as jax does
    assert resolve()["local_device_ids"] == [1]
    env(JAX_LOCAL_DEVICE_IDS="0,1")  # jax reads this one itself: nothing from us
    assert "local_device_ids" not in resolve()


def test_a_single_slurm_task_is_a_single_process(env, fake_jax, capsys):
    env(**_slurm(ntasks=1, nodes=1, procid=0))
    assert plan() == (None, "single process (a process count of 1 from slurm (detected by jax))")
    assert distributed.initialize() is False and fake_jax == []
    assert "single process" in capsys.readouterr().out


def test_jax_variables_win_over_slurm(env):
    env(**_slurm(), JAX_COORDINATOR_ADDRESS="node-a:12355", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1)
    assert plan() == (dict(coordinator_address="node-a:12355", num_processes=2, process_id=1), "JAX_* variables")


def test_flags_win_over_jax_variables(env):
    env(JAX_COORDINATOR_ADDRESS="node-a:12355", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1)
    assert plan("10.0.0.1:1234", 3, 2) == (dict(coordinator_address="10.0.0.1:1234", num_processes=3, process_id=2),
                                           "flags")
    assert plan(process_id=0) == (dict(coordinator_address="node-a:12355", num_processes=2, process_id=0),
                                  "JAX_* variables + flags")
    # the same from a given mapping (what `jaxsora.cluster launch` exports)
    given = dict(JAX_COORDINATOR_ADDRESS="h:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0")
    assert resolve(env=given) == dict(coordinator_address="h:1", num_processes=2, process_id=0)


def test_what_is_not_given_comes_from_the_detected_cluster(env):
    env(**_slurm(ntasks=2, nodes=2, procid=1), JAX_COORDINATOR_ADDRESS="10.0.0.9:4000")
    assert plan() == (dict(coordinator_address="10.0.0.9:4000", num_processes=2, process_id=1),
                      "JAX_* variables + slurm (detected by jax)")


def test_initialize_hands_jax_everything_explicitly(env, fake_jax, capsys):
    env(**_slurm(ntasks=2, nodes=2, procid=0), JAX_COORDINATOR_PORT=12399, JAXSORA_INIT_TIMEOUT=42)
    assert distributed.initialize() is True
    [(posargs, kwargs)] = fake_jax
    # no detection left to jax: it would add its one-GPU-per-task restriction
    assert posargs == () and kwargs == dict(coordinator_address="gpu03:12399", num_processes=2, process_id=0,
                                            initialization_timeout=42, cluster_detection_method="deactivate")
    out = capsys.readouterr().out
    assert ("[jaxsora] jax.distributed from slurm (detected by jax): process 0 of 2, coordinator gpu03:12399 "
            "(waiting up to 42 s for every process)") in out
    assert distributed.initialize() is True and len(fake_jax) == 1  # once


def test_explicit_settings_skip_the_cluster_detection(env, fake_jax, monkeypatch):
    env(**_slurm(), JAX_COORDINATOR_ADDRESS="node-a:12355", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1)
    monkeypatch.setattr(distributed, "detected_cluster", lambda: pytest.fail("detection consulted"))
    distributed.initialize(timeout=7)
    [(_, kwargs)] = fake_jax
    assert kwargs == dict(coordinator_address="node-a:12355", num_processes=2, process_id=1,
                          initialization_timeout=7, cluster_detection_method="deactivate")


@pytest.mark.parametrize("flags, variables, needle", [
    (dict(num_processes=2, process_id=2, coordinator="h:1"), {},
     "--process-id 2 is out of range for 2 processes (ids 0..1; settings from flags)"),
    ({}, dict(JAX_COORDINATOR_ADDRESS="h:1", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=-1),
     "JAX_PROCESS_ID=-1 is out of range for 2 processes"),
    ({}, dict(JAX_COORDINATOR_ADDRESS="h:1"), "multi-host settings without a process count: "
     "JAX_COORDINATOR_ADDRESS=h:1 given, but no --num-processes, JAX_NUM_PROCESSES or detected cluster"),
    (dict(process_id=1), {}, "without a process count: --process-id 1 given"),
    ({}, dict(JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=0),
     "JAX_NUM_PROCESSES=2 needs --coordinator / JAX_COORDINATOR_ADDRESS (host:port) too"),
    (dict(num_processes=2, coordinator="h:1"), {}, "--num-processes 2 needs --process-id / JAX_PROCESS_ID too"),
    ({}, dict(JAX_COORDINATOR_ADDRESS="h", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=0),
     "JAX_COORDINATOR_ADDRESS=h needs a port: host:port"),
    ({}, dict(JAX_NUM_PROCESSES="two"), "JAX_NUM_PROCESSES='two' is not an integer"),
    (dict(num_processes=0), {}, "--num-processes 0: the process count must be at least 1"),
    ({}, dict(JAX_NUM_PROCESSES=1, JAX_PROCESS_ID=1), "JAX_PROCESS_ID=1 is out of range for 1 process (ids 0..0"),
    # explicit values are checked against the detected cluster's too
    ({}, dict(JAX_PROCESS_ID=4, **_slurm()), "JAX_PROCESS_ID=4 is out of range for 4 processes"),
])
def test_settings_that_do_not_fit_are_one_line_user_errors(env, flags, variables, needle):
    env(**variables)
    with pytest.raises(DistributedError) as ei:
        plan(**flags)
    assert isinstance(ei.value, UserError) and isinstance(ei.value, ValueError)
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_bad_timeout_is_a_user_error(env, fake_jax):
    env(JAXSORA_INIT_TIMEOUT="soon")
    with pytest.raises(DistributedError, match="JAXSORA_INIT_TIMEOUT='soon' is not an integer"):
        distributed.initialize()
    with pytest.raises(DistributedError, match="at least 1 s"):
        distributed.initialize(timeout=0)


def test_kubernetes_without_its_package_is_a_quiet_single_process(env, recwarn):
    try:
        import kubernetes  # noqa: F401
        pytest.skip("the kubernetes package is installed: jax would query the API")
    except ImportError:
        pass
    env(KUBERNETES_SERVICE_HOST="10.0.0.1")
    args, source = plan()
    assert args is None and "single process" in source and "kubernetes" in source.lower()
    assert not [w for w in recwarn if "kubernetes" in str(w.message).lower()]  # no stray warning on stderr


def test_the_train_command_reports_bad_settings_in_one_line(env, tmp_path):
    # a table that passes the checks made before jax.distributed (the settings are what this test is about)
    (tmp_path / "t.csv").write_text("path,text,num_frames,height,width\na.mp4,x,8,32,32\n")
    cmd = [PYTHON, "-m", "jaxsora.train", "--config", os.path.join(REPO, "configs", "demo.py"),
           "--data-path", "t.csv", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"]
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == EXIT_USER_ERROR and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("jaxsora.train: --process-id 2 is out of range"), lines


TWO_PROCESSES = """
import sys
import jax
from jaxsora.parallel.distributed import initialize
assert initialize() is True
# One write of the whole line (Gloo's threads log in the same pipe; print writes its newline apart when unbuffered)
sys.stdout.write(f"PROC {jax.process_index()} {jax.process_count()} {jax.device_count()}\\n")
sys.stdout.flush()
"""


def test_two_processes_start_from_jax_variables_despite_slurm(env, tmp_path):
    """Two real processes on 127.0.0.1; SLURM variables pointing elsewhere (4 tasks, an unknown host)
    are ignored because the JAX_* variables are all set."""
    port = free_port()
    base = {**os.environ, **_slurm(ntasks=4, nodes=4, nodelist="nowhere[1-4]"), "PYTHONPATH": str(REPO),
            "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_flags(2),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAXSORA_INIT_TIMEOUT": "120"}
    procs = [subprocess.Popen([PYTHON, "-c", TWO_PROCESSES], env={**base, "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    for i, out in enumerate(outs):
        assert f"PROC {i} 2 4" in out, out[-3000:]
        assert (f"[jaxsora] jax.distributed from JAX_* variables: process {i} of 2, coordinator 127.0.0.1:{port} "
                f"(waiting up to 120 s for every process)") in out, out[-3000:]
    assert "[jaxsora] jax.distributed: 2 processes, 4 devices" in outs[0]
