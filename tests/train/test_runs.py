"""`python -m jaxsora.runs`: a run folder's number, status, step, losses and newest complete checkpoint,
from its small files."""
import json
import os
import socket

from jaxsora.runs import format_table, list_runs


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
