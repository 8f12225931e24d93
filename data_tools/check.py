"""`python -m data_tools.check --input T.csv --output ok.csv [--shard K/N] [--num-workers N]`: decode every
frame of every clip as training reads them; keep the clips that decode cleanly.

Each clip is decoded with `jaxsora.data.video.load_sample` (the loader's own reading path), all its
frames, in a worker process, one per core (`--num-workers`). A clip is kept when every frame it
should have decodes and FFmpeg logs no error (the rule of `ffmpeg -v error`, which the tutorial runs
on every file). The others go to `<output>.dropped.csv` (their rows, a `reason` after the `path`):

  missing file                              no file at the path
  unreadable: …                             empty, not a video FFmpeg can open, no video stream
  truncated at frame k of M                 the file ends after k of the M frames its container lists
  decoder error at frame k: …               the demuxer or decoder failed, or reported corrupt data
  fewer frames than the table says: k of N  the clip is whole, but shorter than its `num_frames`
  stalled: no result within S s             the read or decode did not return: its worker was killed
  crashed: …                                its worker died (a segfault in the decoder)

A clip that stalls is cut off after `--time-limit` seconds per 1,000 frames of its `num_frames` (at
least that long for every clip): its worker process is killed (SIGKILL; a thread blocked in C
cannot be stopped) and replaced, and the check goes on.

Resume: every finished clip is appended to `<output>.progress` as it finishes. Interrupted (Ctrl-C,
SIGTERM: exit code 75; a killed process or host), the same command goes on with the clips not yet
checked. The outputs are written at the end, in the table's row order, and the progress file removed.
A progress file made for another table is refused: delete it to start over.

Many hosts: `--shard K/N` checks part K of N (counted from 0) and writes `<stem>_KKKK-of-NNNN<ext>`;
`--shard auto` takes K and N from what `jaxsora.cluster launch` (JAX_PROCESS_ID, JAX_NUM_PROCESSES),
a SLURM job array or srun set. The parts are contiguous runs of rows balanced by the decoding work
(frames × pixels), so `data_tools.merge --input 'ok_*-of-NNNN.csv'` gives the table one run gives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import time

import numpy as np

from data_tools import stream
from data_tools.workers import Workers
from jaxsora.errors import EXIT_STOPPED, OutputExists

PROG = "check"
DEFAULT_TIME_LIMIT = 120.0  # seconds per 1,000 frames: 8 frames/s, several times slower than a core decodes 1080p
PROGRESS_VERSION = 1


def main(argv=None) -> int:
    ap = stream.parser(PROG, __doc__)
    ap.add_argument("--input", required=True, help="the table (path, num_frames, ...; data_tools.meta's output): "
                    "CSV/parquet file, folder or glob of shards")
    ap.add_argument("--output", required=True, help="the rows of the clips that decode (.csv or .parquet); the "
                    "others go to <output>.dropped.csv with their reason")
    stream.add_reading_flags(ap, "check")
    ap.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, metavar="SECONDS",
                    help="seconds a clip may take per 1,000 of its frames, at least this long for any clip; a clip "
                    "that takes longer is dropped as stalled (default %(default)g)")
    args = stream.parse_args(ap, argv)
    return stream.run(PROG, lambda: _check(args), argv)


def dropped_path(output: str) -> str:
    return output + ".dropped.csv"


def progress_path(output: str) -> str:
    return output + ".progress"


def reason_kind(reason: str) -> str:
    """What a reason counts as in the summary: its words before ':' or ' at frame'."""
    return re.split(r":| at frame", reason, maxsplit=1)[0]


class Progress:
    """`<output>.progress`: a header line (what is being checked), then `row<TAB>reason` per finished
    clip (an empty reason: kept), appended and flushed as each finishes."""

    def __init__(self, path: str, header: dict):
        self.path, self.done = path, {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            try:
                found = json.loads(lines[0])
            except json.JSONDecodeError:
                found = None
            if found != header:
                raise OutputExists(f"{path} is the progress of a check of another table or part of it; delete it "
                                   f"to start over")
            for line in lines[1:-1]:  # the last piece: '' after the final newline, or a torn line
                row, _, reason = line.partition("\t")
                self.done[int(row)] = reason
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps(header) + "\n")
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def add(self, row: int, reason: str) -> None:
        self.done[row] = reason
        os.write(self._fd, f"{row}\t{' '.join(reason.split())}\n".encode())

    def close(self) -> None:
        os.close(self._fd)


class Stop(Exception):
    """SIGTERM: stop like Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Stop()


def _check(args) -> int:
    files, shard, output = stream.reading_tool_setup(args, ["path", "num_frames"],
                                                     "check (the clips and their frame counts)")
    for path in (output, dropped_path(output)):
        stream.check_output(path, args.overwrite)
    header = dict(tool=f"data_tools.{PROG}", version=PROGRESS_VERSION,
                  input=[[f, os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files], shard=list(shard))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    progress = Progress(progress_path(output), header)  # (the part's rows follow from the table and the shard)
    first, end, rows = stream.shard_rows(files, shard, args.chunk_size, progress=not args.no_progress)
    part = f" part {shard[0]}/{shard[1]}: rows {first}–{end - 1} of {rows}" if args.shard else f" {rows} rows"
    resumed = f"; {len(progress.done)} checked before, going on" if progress.done else ""
    print(f"{args.input}{part}{resumed}", flush=True)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.monotonic()
    try:
        checked, frames = _run(args, files, first, end, progress)
    except (KeyboardInterrupt, Stop):
        print(f"data_tools.{PROG}: stopped with {len(progress.done)} of {end - first} clips checked; the same command "
              f"goes on from there", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
    seconds = time.monotonic() - started
    kept, dropped, kinds = _write(args, files, first, end, progress.done, output)
    os.remove(progress.path)
    rate = f"; {checked} clips ({frames} frames) in {seconds:.1f} s with {args.num_workers} workers" if checked else ""
    print(f"{kept} clips kept → {output}; {dropped} dropped → {dropped_path(output)}{rate}")
    for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<40} {count}")
    return 0


def _tasks(args, files, first: int, end: int, progress: Progress, direct: list):
    """(row, (path, num_frames), seconds) of the rows in [first, end) not yet checked; rows with no
    usable frame count go to `direct` (row, reason) without a worker."""
    for chunk in stream.iter_chunks(files, args.chunk_size, columns=["path", "num_frames"], progress=False):
        lo, hi = max(first, chunk.start), min(end, chunk.start + len(chunk.df))
        if lo >= hi:
            continue
        sel = slice(lo - chunk.start, hi - chunk.start)
        paths = stream.resolve_paths(chunk.df["path"].iloc[sel].tolist(), chunk.base)
        counts = stream.numeric(chunk.df.iloc[sel], "num_frames")
        for row, path, n in zip(range(lo, hi), paths, counts):
            if row in progress.done:
                continue
            if not path:
                direct.append((row, "missing file: the row has no path"))
            elif not (np.isfinite(n) and n >= 1 and n == int(n)):
                direct.append((row, f"num_frames is not a whole number ≥ 1 ({n:g})"))
            else:
                yield row, (path, int(n)), args.time_limit * max(1.0, n / 1000)


def _run(args, files, first: int, end: int, progress: Progress) -> tuple[int, int]:
    """Check the rows not yet in `progress`; (clips checked, their frames) by this run."""
    from tqdm.auto import tqdm

    direct: list = []
    checked = frames = 0
    todo = (end - first) - len(progress.done)
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=end - first, initial=len(progress.done), desc=PROG, unit="clip",
                                       file=sys.stderr, disable=args.no_progress, dynamic_ncols=True))
        if todo <= 0:
            return 0, 0
        workers = stack.enter_context(Workers("data_tools.reading:check_clip", min(args.num_workers, todo)))
        counts = {}

        def tasks():
            for row, task, seconds in _tasks(args, files, first, end, progress, direct):
                counts[row] = task[1]
                yield row, task, seconds

        for row, result in workers.run(tasks()):
            progress.add(row, result if isinstance(result, str) else str(result))
            checked, frames = checked + 1, frames + counts.pop(row)
            bar.update(1)
            while direct:
                progress.add(*direct.pop())
                bar.update(1)
        while direct:
            progress.add(*direct.pop())
            bar.update(1)
    return checked, frames


def _write(args, files, first: int, end: int, reasons: dict, output: str) -> tuple[int, int, dict]:
    """The kept rows → output and the dropped ones (with `reason` after `path`) → its sidecar, in
    table order."""
    columns = stream.union_columns(files)
    kinds: dict = {}
    with stream.TableWriter(output, columns, args.overwrite) as kept, \
            stream.TableWriter(dropped_path(output), ["path", "reason", *[c for c in columns if c not in
                                                                          ("path", "reason")]],
                               args.overwrite) as dropped:
        for chunk in stream.iter_chunks(files, args.chunk_size, progress=False):
            lo, hi = max(first, chunk.start), min(end, chunk.start + len(chunk.df))
            if lo >= hi:
                continue
            why = [reasons[row] for row in range(lo, hi)]
            ok = np.zeros(len(chunk.df), bool)
            ok[lo - chunk.start:hi - chunk.start] = [not r for r in why]
            kept.write(chunk, ok)
            bad = np.zeros(len(chunk.df), bool)
            bad[lo - chunk.start:hi - chunk.start] = [bool(r) for r in why]
            if bad.any():
                df = chunk.df[bad].copy()
                df["reason"] = [r for r in why if r]  # (a `reason` column of the input's own is replaced)
                dropped.write(dataclasses.replace(chunk, df=df))
                for r in why:
                    if r:
                        kinds[reason_kind(r)] = kinds.get(reason_kind(r), 0) + 1
    return kept.rows, dropped.rows, kinds


if __name__ == "__main__":
    sys.exit(main())
