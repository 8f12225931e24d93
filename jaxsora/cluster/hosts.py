"""The hosts of a job: a hostfile (one host per line) or a running SLURM job's nodes."""
from __future__ import annotations

import re
import shutil
import subprocess

from jaxsora.errors import BadInput, MissingFile, UserError

_HOST = re.compile(r"^[A-Za-z0-9_.:@\[\]-]+$")


def read_hostfile(path: str) -> list[str]:
    """Hosts in file order (process 0 = the first = the coordinator). `#` starts a comment; words
    after the host (`slots=8` of DeepSpeed/ColossalAI hostfiles) are ignored."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise MissingFile(f"hostfile {path} does not exist") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read hostfile {path}: {e}") from None
    hosts, seen = [], {}
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host = words[0]
        if host.startswith("-") or not _HOST.match(host):
            raise BadInput(f"{path}:{n}: {host!r} is not a host name")
        if host in seen:
            raise BadInput(f"{path}:{n}: host {host} is already on line {seen[host]} (jaxsora runs one process "
                           f"per host, using all its GPUs)")
        seen[host] = n
        hosts.append(host)
    if not hosts:
        raise BadInput(f"hostfile {path} names no host (one host per line; # starts a comment)")
    return hosts


def address_of(host: str) -> str:
    """The network name of an ssh destination: `user@node1` → `node1`."""
    return host.rsplit("@", 1)[-1]


def log_name(host: str) -> str:
    """A host as a file name (for `<logdir>/<host>.log`)."""
    return re.sub(r"[^A-Za-z0-9._@-]", "_", host)


def _slurm(argv: list[str], timeout: float = 30.0) -> str:
    if shutil.which(argv[0]) is None:
        raise UserError(f"--slurm needs `{argv[0]}` on PATH: run this on a SLURM login node")
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"`{' '.join(argv)}` did not answer in {timeout:.0f}s") from None
    if p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise UserError(f"`{' '.join(argv)}` failed: {msg[-1] if msg else f'exit code {p.returncode}'}")
    return p.stdout


def slurm_hosts(job: str) -> list[str]:
    """The nodes of a running SLURM job, in node-list order (SLURM_PROCID order for one task per
    node): `squeue -j JOB -h -o '%T %N'` → `scontrol show hostnames NODELIST`."""
    if not re.match(r"^[0-9]+([_+][0-9]+)?$", job):
        raise BadInput(f"--slurm expects a job id (like 123456), got {job!r}")
    lines = [ln.split() for ln in _slurm(["squeue", "-j", job, "-h", "-o", "%T %N"]).splitlines() if ln.strip()]
    if not lines:
        raise UserError(f"SLURM job {job} is not in the queue (finished or never existed)")
    state = lines[0][0]
    if state != "RUNNING" or len(lines[0]) < 2:
        raise UserError(f"SLURM job {job} is {state}, not RUNNING: it has no nodes yet")
    hosts = [h for h in _slurm(["scontrol", "show", "hostnames", lines[0][1]]).split() if h]
    if not hosts:
        raise UserError(f"scontrol gives no host for the node list {lines[0][1]!r} of job {job}")
    return hosts
