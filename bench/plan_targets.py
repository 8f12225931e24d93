"""The stage configs planned for other chips: every bucket's batch, chosen remat and peak memory per device on an
H100 and on a TPU v5p slice, compiled on this machine by their own compilers (`--dry-run --target`), as
docs/training/memory-and-speed.md shows them.

    python bench/plan_targets.py --write-table stage1.csv --config configs/stage1.py   # one row set per bucket
    python bench/plan_targets.py --configs configs/stage1.py --targets h100x8,tpu-v5p:2x2x2 --out plan.md

`--write-table` writes a table whose rows fall into every bucket of the config (at 9:16, or 1:1 for the square
resolutions), enough of them per bucket that the keep probabilities leave each bucket some: the rows are made up
(no file is read by a dry run). The run mode plans each config for each target in its own dry-run process, one
after another (`nice` it: a whole stage of XL/2 takes tens of minutes of 2 CPU cores), and prints one Markdown
table of every bucket: its per-device batch, the remat `auto` chose and the peak GiB per device of each target,
with each dry run's wall time. Nothing runs on a device: every number is the compiler's.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
ROWS_PER_BUCKET = 64  # at keep probability 0.1, 64 rows leave a bucket empty once in a thousand tables
SQUARE = ("256", "512", "1024", "2048")


def write_table(config_path: str, out: str) -> int:
    """A CSV whose rows fall into every bucket of the config's bucket_config; returns its row count."""
    import importlib.util

    import pandas as pd

    from jaxsora.config_files import register_configs_package
    from jaxsora.data.aspect import resolution_tables
    from jaxsora.data.buckets import normalize_bucket_config
    from jaxsora.train.run.setup import plain

    register_configs_package(config_path)
    spec = importlib.util.spec_from_file_location("plan_config", config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    tables = resolution_tables(plain(config.data.resolutions) if config.data.get("resolutions") else None)
    rows = []
    for res, frames in normalize_bucket_config(plain(config.data.bucket_config)).items():
        ratios = tables[res][1]
        h, w = ratios.get("1.00" if res in SQUARE else "0.56") or max(ratios.values(), key=lambda hw: hw[0] * hw[1])
        for f, (_prob, bs) in frames.items():
            if bs is None:
                continue
            for i in range(ROWS_PER_BUCKET):
                # a clip of T frames lands in a T-frame bucket when it has more than T (an image: 1)
                rows.append(dict(path=f"plan/{res}_{f}_{i}.mp4", text=f"a {res} clip of {f} frames",
                                 num_frames=f + (f > 1), height=h, width=w, fps=24.0))
    pd.DataFrame(rows).to_csv(out, index=False)
    return len(rows)


_ROW = re.compile(r"^(\S+) (\d+)×(\d+)×(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+?)\s{2,}\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                  r"([\d.]+)\s+([\d.]+)\s+(yes|NO|\?)\s*$")


def parse_plan(stdout: str) -> dict:
    """{(res, T, H, W): (per-device batch, remat, peak GiB, fits)} from a dry run's table."""
    out = {}
    for line in stdout.splitlines():
        m = _ROW.match(line)
        if m:
            res, t, h, w = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
            out[(res, t, h, w)] = (int(m.group(6)), m.group(8).strip(), float(m.group(13)), m.group(14))
    return out


def plan(config: str, table: str, target: str, extra=()) -> tuple[dict, float, str]:
    cmd = [sys.executable, "-m", "jaxsora.train", "--config", config, "--data-path", table, "--dry-run",
           "--target", target, *extra]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode not in (0, 2):
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return parse_plan(done.stdout), wall, done.stdout + done.stderr


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-table", help="write a table covering every bucket of --config, and stop")
    ap.add_argument("--config", default="configs/stage1.py")
    ap.add_argument("--configs", default="configs/stage1.py,configs/stage2.py,configs/stage3.py")
    ap.add_argument("--targets", default="h100x8,tpu-v5p:2x2x2")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument("--logs", default=None, help="folder for each dry run's whole output")
    ap.add_argument("extra", nargs="*", help="more flags for every dry run, e.g. --config.model.scan_blocks=True")
    args = ap.parse_args(argv)
    if args.write_table:
        n = write_table(args.config, args.write_table)
        print(f"wrote {args.write_table}: {n} rows")
        return
    targets = args.targets.split(",")
    lines = ["| config | bucket | batch / device | " + " | ".join(f"{t}: remat, peak GiB" for t in targets) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in targets) + " |"]
    for config in args.configs.split(","):
        table = f"/tmp/plan-{os.path.basename(config)}.csv"
        write_table(config, table)
        results = []
        for t in targets:
            got, wall, text = plan(config, table, t, args.extra)
            print(f"{config} on {t}: {len(got)} buckets in {wall / 60:.1f} min", flush=True)
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                with open(os.path.join(args.logs, f"{os.path.basename(config)}-{t.replace(':', '_')}.txt"), "w") as f:
                    f.write(text)
            results.append(got)
        for b in sorted(set().union(*results), key=lambda b: (b[0], b[1])):
            cells = []
            for got in results:
                bs, remat, peak, fits = got.get(b, (None, "-", float("nan"), "?"))
                cells.append(f"{remat}, {peak:.1f}" + ("" if fits != "NO" else " (does not fit)"))
            batch = next((g[b][0] for g in results if b in g), "?")
            lines.append(f"| {os.path.basename(config)} | {b[0]} {b[1]}×{b[2]}×{b[3]} | {batch} | "
                         + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
