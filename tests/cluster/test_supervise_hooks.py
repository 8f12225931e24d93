"""The trainer's side of `jaxsora.cluster`: heartbeat files and the SIGUSR2 stack dump."""
import json
import os
import signal
import subprocess
import sys
import time

from jaxsora.train.run import supervise


def test_heartbeat(tmp_path, capsys):
    path = supervise.write_heartbeat(str(tmp_path), 3, 120, phase="train")
    assert path == str(tmp_path / "heartbeat" / "3.json")
    hb = json.load(open(path))
    assert hb["step"] == 120 and hb["process"] == 3 and hb["pid"] == os.getpid() and hb["phase"] == "train"
    assert abs(hb["time"] - time.time()) < 5 and hb["pid_start"] == supervise._proc_start(os.getpid())
    assert supervise.write_heartbeat(str(tmp_path), 3, None)
    assert json.load(open(path))["step"] is None
    assert os.listdir(tmp_path / "heartbeat") == ["3.json"]  # no temporary file left
    # an unwritable folder: said once, never raised
    (tmp_path / "file").write_text("")
    supervise._heartbeat_warned = False
    assert supervise.write_heartbeat(str(tmp_path / "file"), 0, 1) is None
    assert supervise.write_heartbeat(str(tmp_path / "file"), 0, 2) is None
    assert capsys.readouterr().err.count("cannot write the heartbeat") == 1


def test_stack_dump_on_sigusr2(tmp_path):
    code = ("import sys, time\nfrom jaxsora.train.run.supervise import register_stack_dump\n"
            "path = register_stack_dump(sys.argv[1], 2)\n"
            "def waiting_here():\n    print(path, flush=True)\n    time.sleep(60)\nwaiting_here()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        assert path == str(tmp_path / "stacks" / "2.txt")
        p.send_signal(signal.SIGUSR2)
        end = time.time() + 10
        while "waiting_here" not in open(path).read() and time.time() < end:
            time.sleep(0.05)
        text = open(path).read()
        assert "waiting_here" in text and text.startswith("# jaxsora stacks of process 2")
        assert p.poll() is None  # still running
        assert supervise.register_stack_dump(str(tmp_path / "x.txt")) == str(tmp_path / "x.txt")
    finally:
        p.kill()
        p.wait()
