"""tests/zygote.py: a command forked from the zygote behaves as `python` would run it — argv, environment,
directory, stdin/stdout/stderr, exit code, a traceback's exit code 1, signals forwarded, SIGKILL of the launcher
ending the command — and the launcher runs the real interpreter where that equivalence is not certain."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.conftest import REPO

SHOW = "import json, os, sys; print(json.dumps([sys.argv, os.getcwd(), os.environ.get('X'), sys.path[0], {}]))"


@pytest.fixture(scope="module")
def python():
    if sys.executable == zygote.PYTHON:
        pytest.skip("no zygote in this run (JAXSORA_TEST_ZYGOTE=0)")
    return zygote.PYTHON


def _forked(proc) -> bool:
    return zygote.command_pid(proc) != proc.pid


def test_a_forked_command_sees_what_python_gives_it(python, tmp_path):
    code = SHOW.format("'jax' in sys.modules")  # imported already: this is the zygote's fork
    r = subprocess.run([python, "-c", code, "a", "b c"], cwd=tmp_path, env={**os.environ, "X": "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [["-c", "a", "b c"], str(tmp_path), "1", "", True]
    script = tmp_path / "s.py"
    script.write_text(SHOW.format("__name__") + "\nraise SystemExit(7)\n")
    r = subprocess.run([python, str(script), "x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 7 and json.loads(r.stdout)[0] == [str(script), "x"], r.stderr
    assert json.loads(r.stdout)[3] == str(tmp_path) and json.loads(r.stdout)[4] == "__main__"
    r = subprocess.run([python, "-m", "jaxsora.runs", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr
    r = subprocess.run([python, "-c", "import sys; sys.stdout.write(sys.stdin.read().upper()); 1/0"],
                       input="hello", capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "HELLO"
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero"), r.stderr


# Waits in short sleeps: a Python handler runs between bytecodes, and a signal that lands after the last check
# but before a sleep's system call began would wait out a long sleep (seen under load, with python itself too).
WAIT = "\nfor _ in range(1200):\n    time.sleep(0.05)\n"


def test_signals_reach_the_command_and_its_status_comes_back(python):
    handler = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
               "print('up', flush=True)" + WAIT)
    proc = subprocess.Popen([python, "-c", handler], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n" and _forked(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75
    proc.stdout.close()
    # python's own SIGINT handler, set here: a shell's background job (`make test &`) starts with SIGINT ignored,
    # and python — the real one as the zygote's fork — keeps it ignored
    handler = "import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\nprint('up', flush=True)"
    proc = subprocess.Popen([python, "-c", handler + WAIT],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.send_signal(signal.SIGINT)  # KeyboardInterrupt, then the interpreter ends itself with SIGINT
    assert proc.wait(timeout=30) == -signal.SIGINT
    proc.stdout.close()


@pytest.mark.parametrize("how", ["command", "launcher"])
def test_sigkill_ends_the_command(python, how):
    proc = subprocess.Popen([python, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    pid = zygote.command_pid(proc)
    assert pid != proc.pid
    zygote.kill(proc) if how == "command" else proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # the launcher's: a moment later
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    proc.stdout.close()


def test_the_real_interpreter_runs_what_the_zygote_cannot_reproduce(python):
    code = "import sys; print('jax' in sys.modules)"
    env = {**os.environ, "JAX_ENABLE_X64": "1"}  # jax reads its config variables at import
    for args, kw in [(["-X", "importtime", "-c", code], {}), (["-c", code], {"env": env})]:
        proc = subprocess.Popen([python, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **kw)
        assert proc.communicate(timeout=60)[0] == "False\n" and proc.returncode == 0
        assert zygote.command_pid(proc) == proc.pid
