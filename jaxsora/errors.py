"""User errors: what every jaxsora command prints for a mistake in its input.

A `UserError` is a problem with what the user gave — a flag, a config key or value, a path, a
table, a checkpoint, the mesh, a missing optional dependency. Every command (`train`, `sample`,
`convert`, `ckpt`, the tools and `data_tools`) reports one as one line on stderr and exits with
code 2; `--debug` (or JAXSORA_DEBUG=1) shows the traceback instead. Anything else is a bug of
ours and keeps its traceback.

The specific errors (ConfigError, MeshError, TableError, CheckpointError, ...) live beside the
code that raises them and subclass `UserError` (and ValueError where callers catch that).
This module imports nothing heavy, so `data/` can use it without JAX.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

EXIT_USER_ERROR = 2  # argparse's and absl's code for a usage error
# `python -m jaxsora.train`'s other exit codes: 3 after train.max_nonfinite_steps rejected steps in a
# row; 75 (EX_TEMPFAIL, sysexits.h) stopped by a signal (SIGTERM, preemption) after saving a
# checkpoint, so run again with --load (launch/slurm.sbatch requeues the job on it).
# 76 (EX_PROTOCOL) another process of a multi-process run was lost (killed, its host gone): every
# survivor stops with one line naming it and the checkpoint to --load (jaxsora.parallel.peers).
EXIT_NONFINITE = 3
EXIT_STOPPED = 75
EXIT_PEER_LOST = 76
TRAIN_EXIT_MEANINGS = {0: "done", 1: "crashed: see its log", EXIT_USER_ERROR: "user error: see its log",
                       EXIT_NONFINITE: "non-finite steps: see its log", EXIT_STOPPED: "stopped: --load resumes",
                       EXIT_PEER_LOST: "another process was lost: --load resumes",
                       137: "killed (SIGKILL or out of memory)", 143: "terminated (SIGTERM)"}


class UserError(Exception):
    """A mistake in the user's input: one line, exit code 2."""


class WeightsError(UserError, ValueError):
    """A weights file that cannot be read as what it was given as."""


class MissingFile(UserError, FileNotFoundError):
    """A path the user named does not exist (or holds nothing of the kind expected)."""


class BadInput(UserError, ValueError):
    """A value, file or table that is not what the command needs."""


class UnknownKey(UserError, KeyError):
    """A name that does not exist: a table column, a model preset, ..."""

    def __str__(self):  # KeyError quotes its message
        return str(self.args[0]) if self.args else ""


class OutputExists(UserError, FileExistsError):
    """The output would overwrite something without being told to."""


class ConfigError(UserError, ValueError):
    """A run config that cannot work (checked before any work: `jaxsora.train.plan.validate`)."""


class MissingDependency(UserError, ImportError):
    """An optional extra is needed for what the config asks (wandb, torch, ...)."""


def one_line(msg: str) -> str:
    """A message folded onto one line (multi-line messages joined with ' | ')."""
    return " | ".join(part.strip() for part in str(msg).strip().splitlines() if part.strip())


def debug_requested(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("JAXSORA_DEBUG", "") not in ("", "0")


def fail(prog: str, msg: str) -> NoReturn:  # noqa: F821
    """Print `prog: msg` as one line on stderr and exit with code 2."""
    print(f"{prog}: {one_line(msg)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def run_cli(prog: str, fn: Callable[[], int], argv: Sequence[str] | None = None) -> int:
    """Run a command's body: a UserError becomes one line and exit code 2 (unless --debug)."""
    from jaxsora.lazy_imports import install

    install()  # before the command starts threads (see jaxsora.lazy_imports)
    try:
        return fn()
    except UserError as e:
        if debug_requested(sys.argv if argv is None else argv):
            raise
        fail(prog, str(e))
