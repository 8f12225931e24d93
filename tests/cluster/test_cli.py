"""User errors of `python -m jaxsora.cluster`: one line on stderr, exit code 2."""
import subprocess
import sys

import pytest


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "jaxsora.cluster", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@pytest.mark.parametrize("hostfile,args,message", [
    (None, ["--hostfile", "missing.txt", "status"], "hostfile missing.txt does not exist"),
    ("# only a comment\n\n", ["--hostfile", "hosts.txt", "status"], "names no host"),
    ("a\nb\n", ["--hostfile", "hosts.txt", "launch"], "no command after `--`"),
    ("a\nb\n", ["--hostfile", "hosts.txt", "launch", "--"], "no command after `--`"),
    ("a\na\n", ["--hostfile", "hosts.txt", "status"], "host a is already on line 1"),
    ("a\n", ["status"], "give --hostfile FILE"),
    ("a\n", ["--hostfile", "hosts.txt", "--slurm", "1", "status"], "not both"),
])
def test_user_errors(tmp_path, hostfile, args, message):
    if hostfile is not None:
        (tmp_path / "hosts.txt").write_text(hostfile)
    p = _run(*args, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxsora.cluster: ") and message in lines[0], p.stderr


def test_options_after_the_command(tmp_path):
    """--hostfile etc. work after the command too."""
    p = _run("status", "--hostfile", "nope.txt", cwd=tmp_path)
    assert p.returncode == 2 and "hostfile nope.txt does not exist" in p.stderr
