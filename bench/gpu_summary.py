"""The summary of bench/gpu_vs_opensora.sh: one line per variant from its JSON (bench/step.py --json), and jaxsora's
time over Open-Sora's — step time at the same batch, time per sample between the two "max" variants (each side at
the largest batch that fits it).

    python bench/gpu_summary.py OUT_DIR "name|env|flags" ...     (the variant lines the script ran)
"""
from __future__ import annotations

import json
import os
import sys
import time


def load(out: str, names: list[str]) -> list[dict]:
    """[{variant, row, shape}] of the variants whose JSON exists (a failed variant has none)."""
    got = []
    for name in names:
        path = os.path.join(out, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for entry in json.load(f):
                for row in entry["rows"]:
                    got.append(dict(variant=name, row=row, shape=entry["shape"]))
    return got


def is_reference(row: dict) -> bool:
    return row["impl"].startswith("Open-Sora")


def ratios(items: list[dict]) -> dict:
    """variant → (jaxsora's time / Open-Sora's, what was compared) for the jaxsora variants that have a partner."""
    refs = [it for it in items if is_reference(it["row"])]
    out = {}
    for it in items:
        row = it["row"]
        if is_reference(row):
            continue
        key = tuple(it["shape"]["latent"])
        same = [r for r in refs if tuple(r["shape"]["latent"]) == key and r["row"]["batch"] == row["batch"]]
        if same:
            out[it["variant"]] = (row["step_s"] / same[0]["row"]["step_s"], f"step, vs {same[0]['variant']}")
            continue
        largest = [r for r in refs if tuple(r["shape"]["latent"]) == key and r["variant"].endswith("max")]
        if it["variant"].endswith("max") and largest:
            r = largest[0]["row"]
            out[it["variant"]] = ((row["step_s"] / row["batch"]) / (r["step_s"] / r["batch"]),
                                  f"per sample, vs {largest[0]['variant']}")
    return out


def table(items: list[dict]) -> str:
    def fmt(v, f):
        return "-" if v is None else format(v, f)

    q = ratios(items)
    head = (f"{'variant':<14} {'side':<9} {'shape':<10} {'batch':>5} {'remat':<16} {'step s':>8} {'tokens/s':>9} "
            f"{'TFLOP/s':>8} {'MFU %':>6} {'peak GiB':>8}  {'jaxsora / Open-Sora':<30}")
    lines = [f"{time.strftime('%Y-%m-%d %H:%M')}  device: {items[0]['row']['device'] if items else '?'}", head,
             "-" * len(head)]
    for it in items:
        r, s = it["row"], it["shape"]
        ratio = q.get(it["variant"])
        lines.append(
            f"{it['variant']:<14} {'Open-Sora' if is_reference(r) else 'jaxsora':<9} "
            f"{'×'.join(map(str, s['latent'])):<10} {r['batch']:>5} {str(r.get('remat'))[:16]:<16} "
            f"{r['step_s']:>8.4f} {r['tokens_per_s']:>9.0f} {r['model_tflops']:>8.1f} "
            f"{fmt(r['mfu'] and 100 * r['mfu'], '6.1f'):>6} {fmt(r['peak_gib'], '8.2f'):>8}  "
            + (f"{ratio[0]:.2f} ({ratio[1]})" if ratio else ""))
    for it in items:
        if is_reference(it["row"]):
            lines.append(f"{it['variant']}: {it['row']['impl']}")
            break
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out, variants = argv[0], argv[1:]
    names = [v.split("|", 1)[0] for v in variants]
    items = load(out, names)
    text = table(items)
    print(text)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    return items


if __name__ == "__main__":
    main()
