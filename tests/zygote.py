"""Test runners only: start the suite's Python subprocesses from a process that has imported jax already.

About 270 of the suite's processes are `python -m jaxsora.<command>` or a runner script, and each paid 1–4 s of
CPU importing jax, flax, optax, orbax, grain, torch and jaxsora before doing anything (and 0.4–0.9 s tearing its
modules down at exit). A zygote (this file, run as a script) imports them once and forks a process per command;
`PYTHON` (the launcher below, written by `Zygote.start`) is what the tests run instead of `sys.executable`.
Measured on the 2-core machine (2026-11-27, whole suite, two workers): 857 s → 750 s, user CPU 24.9 → 21.4 min;
`python -m data_tools.filter --help` 0.69 s → 0.15 s.

What a forked command sees is what `python` would give it: its argv, environment, working directory, stdin /
stdout / stderr (the launcher's own, passed over the socket), `__main__`, `sys.path[0]`, exit code (1 and a
traceback for an uncaught exception), non-daemon threads joined and atexit callbacks run at its end, and the
signals sent to the launcher (forwarded). Its pid is not the launcher's: `command_pid(proc)` gives it (what a
trainer writes in its heartbeat), and `kill(proc)` SIGKILLs the command itself — a SIGKILL of the launcher ends
the command too, but a moment later. Nothing in jax's backend is initialized before the fork (XLA reads
XLA_FLAGS, the device count, when a command first asks).

The launcher runs the real interpreter instead (`exec`) whenever that equivalence is not certain: no zygote
(a test run outside pytest), any interpreter option other than `-m`, `-c`, a script or `-u` (`-X importtime`
tests must see the real import order), or an environment that differs from the zygote's in a variable read
at import time (every jax config variable, `PYTHON*`, the thread-pool sizes). Tests that check which modules a
command imports run `sys.executable` themselves. JAXSORA_TEST_ZYGOTE=0 turns the zygote off for a whole run;
JAXSORA_TEST_ZYGOTE_LOG=FILE records each fallback and its reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Modules every kind of command imports (a trainer, the sampler, convert, the data tools): the zygote imports
# them once. Command modules themselves (`jaxsora.train.__main__` …) stay unimported: runpy runs them fresh.
PREIMPORT = ("numpy", "pandas", "PIL.Image", "av", "einops", "absl.flags", "absl.app", "ml_collections",
             "jax", "jax.numpy", "flax", "flax.linen", "flax.nnx", "optax", "orbax.checkpoint", "grain.python",
             "safetensors.numpy", "torch", "jaxsora.train.run.loop", "jaxsora.infer.pipeline",
             "jaxsora.data.loader", "jaxsora.convert.native")
# Environment variables (besides jax's own config variables) that a pre-imported module reads at import time.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "OPENBLAS_", "MKL_", "TF_CPP", "TORCH_", "XLA_PYTHON")
# Applied in the command instead: -u, and PYTHONPATH when it names only the repository (the pre-imported
# jaxsora is the repository's own files: an editable install).
UNCHECKED = ("PYTHONUNBUFFERED", "PYTHONPATH")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MESSAGE = 200_000  # one SOCK_SEQPACKET message: argv + environment


def import_time_env(given: dict, jax_names) -> dict:
    """The variables a command's pre-imported modules read at import: their values as the zygote was given them
    (before its imports, some of which set a few), and jax's names."""
    names = sorted(n.upper() for n in jax_names)
    env = {k: v for k, v in given.items()
           if (k in names or k.startswith(IMPORT_TIME_PREFIXES)) and k not in UNCHECKED}
    return {"env": env, "names": names}


# --------------------------------------------------------------------------------------------------- the zygote
def _serve(path: str):
    """Accept launch requests until killed; returns (in the forked command only) the request to run."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    while True:
        readable, _, _ = select.select([listener], [], [], 1.0)
        _reap()
        if os.getppid() != parent:  # the pytest process is gone: so is the need for a zygote
            os._exit(0)
        if not readable:
            continue
        conn, _ = listener.accept()
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except OSError:
            conn.close()
            continue
        supervisor = os.fork()
        if supervisor:  # the zygote: on to the next request
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        listener.close()
        command = os.fork()
        if command == 0:
            conn.close()
            return json.loads(data), fds
        for fd in fds:
            os.close(fd)
        _supervise(conn, command)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _supervise(conn: socket.socket, pid: int) -> None:
    """The command's parent: tell the launcher its pid, then its wait status; kill it if the launcher dies."""
    status = None
    try:
        conn.send(json.dumps({"pid": pid}).encode())
        pidfd = os.pidfd_open(pid)
        while status is None:
            readable, _, _ = select.select([conn, pidfd], [], [])
            if pidfd in readable:
                status = os.waitpid(pid, 0)[1]
            elif conn in readable and not conn.recv(64):  # the launcher is gone (killed): so is its command
                os.kill(pid, signal.SIGKILL)
                status = os.waitpid(pid, 0)[1]
                break
        conn.send(json.dumps({"status": status}).encode())
    except OSError:
        if status is None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    finally:
        os._exit(0)


def _become(request: dict, fds: list) -> None:
    """In the forked command: take the launcher's stdio, environment, directory, argv and sys.path[0]."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    import tempfile as tempfile_

    tempfile_.tempdir = None  # computed again from this environment (TMPDIR) on first use
    if "numpy" in sys.modules:  # numpy's legacy global generator was seeded once, in the zygote
        sys.modules["numpy"].random.seed()
    if REPO in os.environ.get("PYTHONPATH", "").split(os.pathsep) and REPO not in sys.path:
        sys.path.insert(1, REPO)
    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "module":
        sys.path[0] = request["cwd"]
        sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
    elif kind == "code":
        sys.path[0] = ""
        sys.argv = ["-c", *args]
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        sys.argv = [target, *args]


def _zygote_main(path: str) -> None:
    import importlib

    given = dict(os.environ)
    for name in PREIMPORT:
        with contextlib.suppress(ImportError):  # an optional dependency missing here: commands import it or not
            importlib.import_module(name)
    import gc

    import jax

    gc.freeze()  # what the zygote holds stays out of the commands' collections (no copy-on-write by the GC)

    with open(path + ".env", "w") as f:  # what the launcher compares
        json.dump(import_time_env(given, jax.config.values), f)
    os.replace(path + ".env", path + ".ready")
    request, fds = _serve(path)
    _become(request, fds)
    os._exit(_run(request))


def _run(request: dict) -> int:
    """Run the command as `python` would, then end the way the interpreter does — non-daemon threads joined,
    atexit callbacks (weakref finalizers, multiprocessing's cleanup), stdio flushed — but without tearing down
    the zygote's modules one by one: that touches every inherited object, copying each page of the zygote's
    heap into this process (about a second)."""
    import atexit
    import runpy
    import threading
    import traceback

    kind, target = request["kind"], request["target"]
    interrupted = False
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":
            import types

            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: B036 — what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # as the interpreter ends after an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------------------- the launcher
LAUNCHER = r'''#!{python} -SE
# The suite's `python` (tests/zygote.py): a command forked from the zygote, or the real interpreter.
import json, os, signal, socket, sys, time

REAL, SOCK = {python!r}, {sock!r}


def fallback(why):
    if os.environ.get("JAXSORA_TEST_ZYGOTE_LOG"):
        with open(os.environ["JAXSORA_TEST_ZYGOTE_LOG"], "a") as f:
            f.write(json.dumps([why, sys.argv[1:4]]) + "\n")
    os.execv(REAL, [REAL, *sys.argv[1:]])


def parse(argv):
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if len(argv) >= 2 and argv[0] in ("-m", "-c"):
        return ("module" if argv[0] == "-m" else "code"), argv[1], argv[2:], unbuffered
    if argv and not argv[0].startswith("-"):
        return "script", os.path.abspath(argv[0]), argv[1:], unbuffered
    return None


request = parse(sys.argv[1:])
if request is None:
    fallback("options")
if os.environ.get("JAXSORA_TEST_ZYGOTE") == "0":
    fallback("turned off")
for _ in range(1200):  # a zygote still importing is waited for (a minute at most): cheaper than importing here
    if os.path.exists(SOCK + ".ready"):
        break
    try:  # the zygote still running (not a zombie: one that failed is reaped only when pytest ends)
        with open(SOCK + ".starting") as f, open("/proc/%d/stat" % int(f.read())) as stat:
            alive = stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        alive = False
    if not alive:
        fallback("no zygote")
    time.sleep(0.05)
else:
    fallback("zygote not ready")
with open(SOCK + ".ready") as f:
    ready = json.load(f)
expected, jax_names = ready["env"], set(ready["names"])
names = set(expected) | {{k for k in os.environ
                         if (k in jax_names or k.startswith({prefixes!r})) and k not in {unchecked!r}}}
differ = sorted(k for k in names if os.environ.get(k) != expected.get(k))
if differ:
    fallback("environment: " + " ".join(differ))
if any(p not in ("", {repo!r}) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    fallback("PYTHONPATH")
kind, target, args, unbuffered = request
message = json.dumps({{"kind": kind, "target": target, "args": args, "unbuffered": unbuffered,
                       "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
if len(message) > {max_message}:
    fallback("message size")
pending, pid = [], None


def forward(sig, frame):
    if pid is None:
        pending.append(sig)
    else:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGALRM):
    signal.signal(sig, forward)
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    conn.connect(SOCK)
    socket.send_fds(conn, [message], [0, 1, 2])
    reply = conn.recv(4096)
except OSError as e:
    fallback(repr(e))
if not reply:
    fallback("no reply")
pid = json.loads(reply)["pid"]
with open(os.path.join(os.path.dirname(SOCK), "pids", str(os.getpid())), "w") as f:
    f.write(str(pid))
for sig in pending:
    forward(sig, None)
reply = conn.recv(4096)  # a signal forwarded meanwhile: python retries the call itself (PEP 475)
if not reply:
    sys.stderr.write("tests/zygote.py: the zygote lost the command\n")
    os._exit(70)
code = os.waitstatus_to_exitcode(json.loads(reply)["status"])
if code < 0:
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    os._exit(128 - code)
os._exit(code)
'''


# What the tests run instead of sys.executable: the launcher of this process's zygote once conftest started it.
PYTHON = sys.executable


def command_pid(proc: subprocess.Popen, timeout: float = 10) -> int:
    """The pid of the command `proc` runs: the forked process when `proc` is a launcher that reached the zygote
    (what a trainer writes into its heartbeat and run lock), else `proc.pid`."""
    if proc.args[0] != PYTHON or sys.executable == PYTHON:
        return proc.pid
    path = os.path.join(os.path.dirname(PYTHON), "pids", str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(pathlib.Path(path).read_text())
        except (FileNotFoundError, ValueError):  # not written yet, or this command fell back to the real python
            if proc.poll() is not None or _exec_ed(proc.pid):
                return proc.pid
            time.sleep(0.01)
    return proc.pid


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the command `proc` runs, as `proc.kill()` does to a plain process: `proc.wait()` then returns once
    the command is dead (its file locks released). Killing the launcher instead kills the command a moment
    after the launcher, which a test that takes over a dead run's folder at once would race."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(command_pid(proc), signal.SIGKILL)


def _exec_ed(pid: int) -> bool:
    """Whether the launcher `pid` has replaced itself with the real interpreter (a fallback)."""
    try:
        return "-SE" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return True


class Zygote:
    """One zygote per pytest process: `start` it, run commands with `python` (the launcher's path), `stop` it."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="jaxsora-zygote-")
        if len(self.dir) > 90:  # a socket's path holds at most 107 bytes
            os.rmdir(self.dir)
            self.dir = tempfile.mkdtemp(prefix="jaxsora-zygote-", dir="/tmp")
        self.sock = os.path.join(self.dir, "sock")
        self.python = os.path.join(self.dir, "python")
        self.proc = None

    def start(self, env: dict) -> None:
        pathlib.Path(self.python).write_text(LAUNCHER.format(
            python=sys.executable, sock=self.sock, prefixes=IMPORT_TIME_PREFIXES, unchecked=UNCHECKED,
            max_message=MAX_MESSAGE, repo=REPO))
        os.chmod(self.python, 0o755)
        os.mkdir(os.path.join(self.dir, "pids"))
        self.proc = subprocess.Popen([sys.executable, __file__, self.sock], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(self.sock + ".log", "w"),
                                     cwd=REPO)
        pathlib.Path(self.sock + ".starting").write_text(str(self.proc.pid))

    def wait_ready(self, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.sock + ".ready"):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    _zygote_main(sys.argv[1])
