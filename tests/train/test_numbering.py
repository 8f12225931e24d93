"""Experiment numbers in training: a new run gets `<outputs>/<NNN>-<experiment>` (two runs of one
config: 001 and 002), `--load N` resumes into run N's own folder, `--run-dir` names the folder exactly
and refuses one that already holds a run; numbers are claimed race-free by threads and processes, and
in a multi-process run process 0 claims the number for all."""
import json
import os
import subprocess
import sys
import threading
import types

import pytest

import jaxsora.runs as runs_lib
from jaxsora.checkpoint import checkpoint_steps
from jaxsora.errors import UserError
from jaxsora.runs import CLAIMS_DIR, new_run_dir, run_number
from jaxsora.train.run.logging import run_name
from jaxsora.train.run.loop import RunOptions, train
from tests.ports import free_port
from tests.train.common import REPO, small_config
from tests.train.fake_loader import FakeLoader
from tests.zygote import PYTHON

ENV = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


def _train(cfg, opts=None):
    return train(cfg, opts or RunOptions(),
                 loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, per_device_batch=2, text_inputs=t))


def _config(out, steps, **kw):
    return small_config(out, max_steps=steps, ckpt_every=100, mesh=(1, 1, 1), experiment="tiny", **kw)


def _numbered(out):
    return sorted(d for d in os.listdir(out) if run_number(d) is not None) if os.path.isdir(out) else []


def _logged_steps(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(ln)["step"] for ln in f]


def _ckpts(run):
    return checkpoint_steps(os.path.join(run, "checkpoints"))


class _FakeWandbRun:
    def __init__(self, kw):
        self.id = kw.get("id") or f"id-{kw['name']}"

    def log(self, data, step=None):
        pass

    def finish(self):
        pass


def test_new_runs_get_numbers_and_load_by_number_resumes_in_place(tmp_path, monkeypatch, capsys):
    out = tmp_path / "outputs"
    inits = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: (inits.append(kw), _FakeWandbRun(kw))[1]
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def config(steps):
        c = _config(out, steps)
        c.wandb.update(dict(enabled=True, mode="offline"))
        return c

    first, second = _train(config(1)), _train(config(1))
    assert first["outputs"] == str(out / "001-tiny") and second["outputs"] == str(out / "002-tiny")
    assert _numbered(out) == ["001-tiny", "002-tiny"]
    assert _ckpts(out / "001-tiny") == [0, 1] and _logged_steps(out / "002-tiny") == [1]
    assert f"[jaxsora] run folder: {out / '001-tiny'} (new)" in capsys.readouterr().out
    assert [kw["name"] for kw in inits] == ["001-tiny", "002-tiny"]  # the wandb run carries the number

    # a dry run says where a new run would go, and claims nothing
    dry = train(config(1), RunOptions(dry_run=True),
                loader_factory=lambda c, dp, t: FakeLoader(data_parallel_size=dp, per_device_batch=2, text_inputs=t))
    assert dry["outputs"] == str(out / "003-tiny") and not (out / "003-tiny").exists()
    assert sorted(os.listdir(out / CLAIMS_DIR)) == ["001", "002"]

    # --load 1: run 001 goes on in its own folder, in its own wandb run; no new folder
    res = _train(config(2), RunOptions(load="1"))
    assert res["steps"] == 2 and res["outputs"] == str(out / "001-tiny")
    assert _numbered(out) == ["001-tiny", "002-tiny"] and sorted(os.listdir(out / CLAIMS_DIR)) == ["001", "002"]
    assert _ckpts(out / "001-tiny") == [0, 1, 2] and _logged_steps(out / "001-tiny") == [1, 2]
    assert _ckpts(out / "002-tiny") == [0, 1] and _logged_steps(out / "002-tiny") == [1]
    assert inits[-1]["name"] == "001-tiny" and inits[-1]["id"] == "id-001-tiny"
    assert f"run folder: {out / '001-tiny'} (resuming {out / '001-tiny'})" in capsys.readouterr().out


def test_load_of_a_missing_or_ambiguous_number_is_one_line(tmp_path):
    out = tmp_path / "outputs"
    for name in ("003-a", "003-b", "004-c"):
        (out / name).mkdir(parents=True)
    with pytest.raises(UserError) as ei:
        _train(_config(out, 1), RunOptions(load="3"))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("--load 3: 2 folders") and "003-a, 003-b" in msg
    with pytest.raises(UserError) as ei:
        _train(_config(out, 1), RunOptions(load="9"))
    msg = str(ei.value)
    assert "\n" not in msg and "no run numbered 9" in msg and "003-a, 003-b, 004-c" in msg
    assert sorted(os.listdir(out)) == ["003-a", "003-b", "004-c"]  # nothing was written
    # the command line: one line, exit code 2 (and --run-dir is a flag)
    cmd = [PYTHON, "-m", "jaxsora.train", "--config", os.path.join(REPO, "configs", "demo.py"),
           "--outputs", str(out), "--load", "9", "--run-dir", str(tmp_path / "x")]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--load 9: no run numbered 9" in lines[0], r.stderr[-3000:]


def test_run_dir_is_used_as_given_and_refused_when_it_holds_a_run(tmp_path, capsys):
    out, exact = tmp_path / "outputs", tmp_path / "exact"
    res = _train(_config(out, 1), RunOptions(run_dir=str(exact)))
    assert res["outputs"] == str(exact) and _ckpts(exact) == [0, 1]
    assert f"run folder: {exact} (--run-dir)" in capsys.readouterr().out
    assert not (out / CLAIMS_DIR).exists() and _numbered(out) == []  # no number taken
    metrics = (exact / "metrics.jsonl").read_text()
    with pytest.raises(UserError) as ei:  # a new run into it: never appended to
        _train(_config(out, 3), RunOptions(run_dir=str(exact)))
    msg = str(ei.value)
    assert "\n" not in msg and "already holds a run (checkpoints of steps 0..1)" in msg and f"--load {exact}" in msg
    other = _train(_config(out, 1))["outputs"]
    assert other == str(out / "001-tiny")
    with pytest.raises(UserError, match="already holds another run"):  # another run's --load into it
        _train(_config(out, 3), RunOptions(load=other, run_dir=str(exact)))
    assert (exact / "metrics.jsonl").read_text() == metrics and _ckpts(exact) == [0, 1]
    assert not (exact / "run.lock").exists()
    assert json.loads((exact / "heartbeat" / "0.json").read_text())["phase"] == "done"  # refused runs leave it
    # --load of that folder goes on in it; --load into a new --run-dir starts a branch there
    res = _train(_config(out, 2), RunOptions(load=str(exact), run_dir=str(exact)))
    assert res["steps"] == 2 and _logged_steps(exact) == [1, 2] and _ckpts(exact) == [0, 1, 2]
    branch = tmp_path / "branch"
    res = _train(_config(out, 2), RunOptions(load=other, run_dir=str(branch)))
    assert res["outputs"] == str(branch) and _ckpts(branch) == [2] and _ckpts(other) == [0, 1]


def test_wandb_run_name_carries_the_number():
    assert run_name("/o/656-stdit3-xl2") == "656-stdit3-xl2"
    assert run_name("/o/656-stdit3-xl2/", "lr-sweep") == "656-lr-sweep"
    assert run_name("/o/656-stdit3-xl2", "656-mine") == "656-mine"
    assert run_name("/o/demo") == "demo" and run_name("/o/demo", "mine") == "mine"


# ----------------------------------------------------------------------------------------------
# allocation races
# ----------------------------------------------------------------------------------------------
def test_threads_allocating_at_once_get_different_numbers(tmp_path):
    n = 12
    barrier = threading.Barrier(n)
    got = [None] * n

    def work(i):
        barrier.wait()
        got[i] = new_run_dir(str(tmp_path), f"exp{i % 3}")  # the same and different experiment names

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(run_number(p) for p in got) == list(range(1, n + 1))
    assert all(os.path.isdir(p) for p in got)


def test_a_number_claimed_meanwhile_is_skipped(tmp_path, monkeypatch):
    """Another process claims the number (with another experiment name) between our look and our claim."""
    real, seen = runs_lib.next_run_number, []

    def racing(outputs):
        number = real(outputs)
        if not seen:
            os.mkdir(os.path.join(outputs, CLAIMS_DIR, f"{number:03d}"))
            os.mkdir(os.path.join(outputs, f"{number:03d}-other"))
        seen.append(number)
        return number

    monkeypatch.setattr(runs_lib, "next_run_number", racing)
    assert new_run_dir(str(tmp_path), "mine") == str(tmp_path / "002-mine")
    assert seen == [1, 2] and _numbered(tmp_path) == ["001-other", "002-mine"]


def test_processes_allocating_at_once_get_different_numbers(tmp_path):
    code = ("import sys\nfrom jaxsora.runs import new_run_dir\n"
            "for _ in range(5):\n    print(new_run_dir(sys.argv[1], sys.argv[2]), flush=True)\n")
    procs = [subprocess.Popen([PYTHON, "-c", code, str(tmp_path), f"p{i}"], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = [ln for o in outs for ln in o.split()]
    assert sorted(run_number(p) for p in got) == list(range(1, 21))



def test_process_0_numbers_the_run_of_every_process(tmp_path):
    out = tmp_path / "outputs"
    (out / "041-earlier").mkdir(parents=True)
    code = ("import sys\nfrom jaxsora.parallel.distributed import initialize\ninitialize()\n"
            "from ml_collections import ConfigDict\nfrom jaxsora.train.run.loop import _new_run_folder\n"
            "cfg = ConfigDict(dict(train=dict(outputs=sys.argv[1], experiment='multi')))\n"
            "folder = _new_run_folder(cfg)\n"
            "with open(sys.argv[2], 'w') as f:\n    f.write(str(folder))\n")
    port = free_port()
    answers = [tmp_path / f"answer{i}" for i in range(2)]
    procs = [subprocess.Popen([PYTHON, "-c", code, str(out), str(answers[i])],
                              env={**ENV, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                                   "JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    # Each answer in a file of its own: Gloo's threads log on stdout as well as stderr, and once a line of
    # theirs landed inside a printed answer.
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    assert all(a.exists() for a in answers), f"a process exited 0 without its answer:\n{logs[0]}\n---\n{logs[1]}"
    folders = [a.read_text() for a in answers]
    assert folders == [str(out / "042-multi")] * 2
    assert _numbered(out) == ["041-earlier", "042-multi"]  # one folder, made by process 0
