"""`python -m jaxsora.runs`: a run folder's number, status, step, losses and newest complete checkpoint,
from its small files; the experiment-number helpers (lookup, next number) shared with train and serve."""
import json
import os
import socket

import pytest

from jaxsora.errors import UserError
from jaxsora.runs import (
    CLAIMS_DIR,
    find_run,
    format_table,
    list_runs,
    new_run_dir,
    next_run_number,
    run_folder_name,
    run_number,
)


def _run(root, name, *, steps, complete, lock_pid=None):
    run = root / name
    for s in steps:
        d = run / "checkpoints" / str(s)
        (d / "config").mkdir(parents=True)
        (d / "meta").mkdir()
        (d / "config" / "metadata").write_text(json.dumps({"train": {"experiment": "stdit3-xl2"},
                                                           "model": {"name": "STDiT3-XL/2"}}))
        (d / "meta" / "metadata").write_text(json.dumps({"wandb_id": "abc123"}))
        if s in complete:
            (d / "integrity.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "epoch": 0}) + "\n"
                                               for s in (10, 20)) + '{"step": 30, "lo')  # a torn last line
    (run / "eval.jsonl").write_text(json.dumps({"step": 20, "eval/loss": 0.25}) + "\n")
    if lock_pid is not None:
        (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": lock_pid, "start": 0}))
    return run


def test_runs_are_listed_by_number_with_their_state(tmp_path):
    _run(tmp_path, "012-stage2", steps=[10, 20], complete=[10], lock_pid=os.getpid())
    _run(tmp_path, "003-stage1", steps=[10], complete=[10])
    (tmp_path / "jax_cache").mkdir()  # not a run
    runs = list_runs(str(tmp_path))
    assert [r["number"] for r in runs] == [3, 12]
    r = runs[1]
    assert r["status"] == f"running (pid {os.getpid()})" and r["step"] == 20 and r["loss"] == 0.05
    assert r["eval_loss"] == 0.25 and r["checkpoint_step"] == 10  # step 20 has no completion marker yet
    assert r["experiment"] == "stdit3-xl2" and r["wandb_id"] == "abc123"
    table = format_table(runs)
    assert "012-stage2" in table and "running" in table and "stopped" in table


@pytest.mark.parametrize("phase, status", [("done", "done"), ("stopped", "stopped: --load it"),
                                           ("failed", "failed"), ("non-finite", "non-finite stop"),
                                           ("compiling", "stopped"), (None, "stopped")])
def test_an_ended_run_says_how_it_ended(tmp_path, phase, status):
    """No lock: the trainer's last heartbeat (process 0) tells done, stopped by a signal, failed; a
    heartbeat from before the first step (killed while compiling) or none at all: "stopped"."""
    from jaxsora.train.run.supervise import write_heartbeat

    run = _run(tmp_path, "004-stage1", steps=[10], complete=[10])
    if phase is not None:
        write_heartbeat(str(run), 0, 10, phase=phase)
    assert list_runs(str(tmp_path))[0]["status"] == status


# ----------------------------------------------------------------------------------------------
# experiment numbers: the lookup train --load, serve --runs and this listing share
# ----------------------------------------------------------------------------------------------
def test_run_numbers_of_folder_names():
    assert run_number("656-stdit3-xl2") == 656 and run_number("/x/outputs/001-demo/") == 1
    assert run_number("demo") is None and run_number("656") is None and run_number("jax_cache") is None
    assert run_folder_name(7, "stage1") == "007-stage1" and run_folder_name(1234, "s") == "1234-s"


def test_find_run_by_number_or_path(tmp_path):
    for name in ("001-stage1", "002-stage2", "010-stage2", "002-copy", "0042-old"):
        (tmp_path / name).mkdir()
    (tmp_path / "7").mkdir()  # a folder named by its number only
    (tmp_path / "015-notes.txt").write_text("")  # not a folder: no run
    out = str(tmp_path)
    assert find_run("1", out) == str(tmp_path / "001-stage1")
    assert find_run("001", out) == find_run("0001", out) == str(tmp_path / "001-stage1")
    assert find_run("10", out) == str(tmp_path / "010-stage2")
    assert find_run("42", out) == str(tmp_path / "0042-old")
    assert find_run("7", out) == str(tmp_path / "7")
    assert find_run(str(tmp_path / "010-stage2"), "elsewhere") == str(tmp_path / "010-stage2")  # a path wins
    with pytest.raises(UserError) as ei:
        find_run("2", out, what="--load")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("--load 2:") and "002-copy" in msg and "002-stage2" in msg
    for missing in ("3", "15"):
        with pytest.raises(UserError) as ei:
            find_run(missing, out)
        msg = str(ei.value)
        assert "\n" not in msg and f"no run numbered {missing}" in msg and "001-stage1, 002-copy" in msg
    with pytest.raises(UserError, match="no such folder"):
        find_run("no-such-run", out)
    with pytest.raises(UserError, match="no outputs folder"):
        find_run("1", str(tmp_path / "missing"))


def test_next_number_counts_every_numbered_entry_and_claim(tmp_path):
    out = str(tmp_path / "outputs")
    assert next_run_number(out) == 1  # no outputs folder yet
    assert new_run_dir(out, "stage1") == os.path.join(out, "001-stage1")
    assert new_run_dir(out, "stage1") == os.path.join(out, "002-stage1")  # the same config: a new folder
    (tmp_path / "outputs" / "998-by-hand").mkdir()
    assert new_run_dir(out, "x") == os.path.join(out, "999-x")
    assert new_run_dir(out, "x") == os.path.join(out, "1000-x")  # more digits when needed
    os.rmdir(os.path.join(out, "1000-x"))
    assert next_run_number(out) == 1001  # a deleted run's number is not handed out again
    assert sorted(os.listdir(os.path.join(out, CLAIMS_DIR))) == ["001", "002", "1000", "999"]
