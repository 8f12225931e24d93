"""Orbax and tensorstore failures as one line (used by `jaxsora.checkpoint`).

A failed checkpoint read or write is turned into one `CheckpointError` line by the checkpoint
code; this module keeps the rest quiet and helps it say things: log filters for what orbax,
asyncio and tensorstore's background threads print besides the exception, the recognition of
filesystem failures (disk full, quota, read-only, I/O errors) in exception chains, a context
manager that silences orbax's own records while reading, and small reporting helpers.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys

import jax

# What a failed read or write leaves behind besides the exception we turn into one line:
# - orbax logs the exception (with traceback) from its save threads (absl logger, ERROR);
# - when one read fails, orbax closes its event loop while other tensorstore reads are still
#   running; their completion callbacks then raise "Event loop is closed", the abandoned read
#   coroutines raise when garbage collected (both reported through sys.unraisablehook), and the
#   abandoned futures log "Future exception was never retrieved" (asyncio logger).
# The filters below drop exactly those records; everything else passes.
_IO_TEXT = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|Input/output error|"
                      r"os_error_code='\d+'|RESOURCE_EXHAUSTED|Stale file handle")
_STORE_TEXT = re.compile(r"OCDBT|TensorStore|tensorstore|zarr|Encountered error while reading|Event loop is closed")


def chain(exc):
    """An exception, its causes/contexts and the members of exception groups (depth-limited)."""
    todo, seen, out = [exc], set(), []
    while todo and len(out) < 32:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])
    return out


def io_failure(exc) -> str | None:
    """The reason (e.g. 'No space left on device') when `exc` is, or wraps, a filesystem error."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return os.strerror(e.errno)
    for e in chain(exc):
        m = re.search(r"os_error_code='(\d+)'", str(e))
        if m:
            return os.strerror(int(m.group(1)))
        m = _IO_TEXT.search(str(e))
        if m:
            return m.group(0)
    for e in chain(exc):
        if isinstance(e, OSError):
            return str(e) or type(e).__name__
    return None


class _OrbaxIOErrorLogs(logging.Filter):
    """Drops orbax's own ERROR logs of a filesystem failure (re-raised to the caller in one line)."""

    def filter(self, record):
        if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in (record.pathname or ""):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and io_failure(exc)) or _IO_TEXT.search(record.getMessage()))


class _AbandonedReadLogs(logging.Filter):
    """Drops asyncio's reports of tensorstore reads abandoned after another read failed."""

    def filter(self, record):
        msg = record.getMessage()
        if "exception was never retrieved" not in msg and not msg.startswith("Exception in callback"):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not _STORE_TEXT.search(msg + " " + " ".join(str(e) for e in chain(exc)))


class _OrbaxChatter(logging.Filter):
    """While reading checkpoints: drops orbax's own log records below `level` (by default all:
    warnings about metadata files of the item folders it reads, errors it also raises — which
    become one line)."""

    def __init__(self, level: int | None = None):
        super().__init__()
        self.level = level

    def filter(self, record):
        if self.level is not None and record.levelno >= self.level:
            return True
        return f"{os.sep}orbax{os.sep}" not in (record.pathname or "")


@contextlib.contextmanager
def quiet_orbax(level: int | None = None):
    """Orbax's log records below `level` (None: all of them) are dropped inside the block."""
    f = _OrbaxChatter(level)
    logger = logging.getLogger("absl")
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _abandoned_read_noise(unraisable) -> bool:
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    # orbax's read coroutines abandoned by the failed gather, closed at garbage collection
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def install_noise_filters():
    """Idempotent. The unraisable hook is re-installed when something replaced it (pytest does,
    per test)."""
    for name, cls in (("absl", _OrbaxIOErrorLogs), ("asyncio", _AbandonedReadLogs)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())
    previous = sys.unraisablehook
    if getattr(previous, "_jaxsora_filter", False):
        return

    def hook(unraisable):
        if not _abandoned_read_noise(unraisable):
            previous(unraisable)

    hook._jaxsora_filter = True
    sys.unraisablehook = hook


def one_line_error(exc, limit: int = 240) -> str:
    """The root cause of an orbax/tensorstore exception as one line of at most `limit` characters
    (tensorstore appends its whole spec and source locations; they are cut)."""
    causes = [e for e in chain(exc) if str(e).strip()]
    e = causes[-1] if causes else exc
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.split(r" \[(?:source locations|tensorstore_spec)=", text)[0]
    if isinstance(e, KeyError):
        text = text.strip("'\"")
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def say(msg: str):
    if jax.process_index() == 0:
        print(f"[jaxsora] {msg}", file=sys.stderr, flush=True)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def write_json_atomic(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
