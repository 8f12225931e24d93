"""Fakes for the cluster tool: an `ssh` that ignores the host and runs the command here (with
`$FAKE_HOSTBIN/<host>` first on PATH, for per-host `nvidia-smi`, `date`, `hostname`), and SLURM's
`squeue`/`scontrol`/`srun`. No real ssh, GPU or SLURM is needed."""
import contextlib
import json
import os
import shutil
import signal
import stat
import sys
import time

import pytest

from jaxsora.cluster.__main__ import main

FAKE_SSH = """#!/bin/sh
# fake ssh: skip options, take the host, run the command here in a shell
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l|-F|-J) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
host=$1; shift
case " $FAKE_SSH_DOWN " in
  *" $host "*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255;;
esac
export FAKE_HOST="$host"
[ -d "$FAKE_HOSTBIN/$host" ] && PATH="$FAKE_HOSTBIN/$host:$PATH" && export PATH
exec sh -c "$*"
"""

FAKE_SRUN = """#!/bin/sh
# fake srun: log the options, run the command (after them) on "the node" given by --nodelist
echo "$1 $2 $3 $4 $5 $6 $7 $8" >> "$FAKE_SLURM_LOG"
host=
while [ $# -gt 0 ]; do
  case "$1" in
    --nodelist|-w) host=$2; shift 2;;
    --jobid) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
export FAKE_HOST="$host"
[ -d "$FAKE_HOSTBIN/$host" ] && PATH="$FAKE_HOSTBIN/$host:$PATH" && export PATH
exec "$@"
"""

NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=*) cat <<'END'
{gpus}
END
  ;;
  *--query-compute-apps=*) cat <<'END'
{apps}
END
  ;;
esac
"""


def write_exe(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


class Cluster:
    """A fake cluster in tmp_path: hostfile, fake ssh, per-host bins, workdir, logdir."""

    def __init__(self, tmp_path, monkeypatch):
        self.tmp = tmp_path
        self.hostbin = tmp_path / "hostbin"
        self.hostbin.mkdir()
        self.ssh = write_exe(tmp_path / "bin" / "fake-ssh", FAKE_SSH)
        self.workdir = str(tmp_path / "work")
        os.makedirs(self.workdir)
        self.logdir = os.path.join(self.workdir, "logs", "cluster")
        self.run = os.path.join(self.workdir, "outputs", "exp")
        monkeypatch.setenv("FAKE_HOSTBIN", str(self.hostbin))
        monkeypatch.delenv("FAKE_SSH_DOWN", raising=False)

    def hosts(self, *names, nvidia=True):
        path = self.tmp / "hosts.txt"
        path.write_text("# test hosts\n" + "".join(f"{n} slots=8\n" for n in names))
        if nvidia:  # an idle GPU on each host, so launch's check of busy GPUs sees none
            for n in names:
                if not (self.hostbin / n / "nvidia-smi").exists():
                    self.nvidia(n, "0, NVIDIA H100 80GB HBM3, 1, 81559, 70.0, 345, 1980, 0, 30, 0", "")
        return str(path)

    def nvidia(self, host, gpus, apps):
        write_exe(self.hostbin / host / "nvidia-smi", NVIDIA_SMI.format(gpus=gpus, apps=apps))

    def tool(self, host, name, text):
        write_exe(self.hostbin / host / name, text)

    def cli(self, hostfile, *args):
        """`python -m jaxsora.cluster --hostfile F --ssh fake --workdir W ARGS` in this process → exit code."""
        return main(["--hostfile", hostfile, "--ssh", self.ssh, "--workdir", self.workdir, "--timeout", "20", *args])

    def pids(self):
        with open(os.path.join(self.logdir, "pids.json")) as f:
            return json.load(f)

    def log(self, host):
        try:
            with open(os.path.join(self.logdir, f"{host}.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def kill_launched(self):
        """End what this test launched (by the pids it recorded)."""
        try:
            entries = self.pids()["hosts"]
        except (OSError, ValueError, KeyError):
            return
        for e in entries:
            if e["pid"] == os.getpid():  # a test may record itself as a live "trainer"
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(e["pid"], signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    c = Cluster(tmp_path, monkeypatch)
    yield c
    c.kill_launched()


def wait_for(cond, timeout=20.0, what="a condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def printed(text: str, line: str) -> bool:
    """Whether a host's log holds `line` as a line of its own — not inside the launch's echo of the command,
    which may quote it (a child's "ready" seen there, before the child ran, let the test signal too early)."""
    return line in (row.strip() for row in text.splitlines())


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


PY = sys.executable
REAL_DATE = shutil.which("date")
