"""bench/sample.py: the two samplers take turns — the reference's process is built once and samples on request, each
round runs it and then jaxsora's loop — and the ratio is the median over rounds of the two times of one round."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_sample", ROOT / "bench" / "sample.py")
bench_sample = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_sample)

# A stand-in for Open-Sora's sampler process, speaking ReferenceSampler's protocol: READY once built, a line "run" →
# an output (z + 1) and a time (1 s, 2 s, ... per run: "REF {...}"), "end" → gone, leaving its count of runs in
# $FAKE_RUNS.
FAKE_REFERENCE = r'''
import json, os, sys
import numpy as np
a = json.loads(open(sys.argv[1]).read())
if a["steps"] == 3:  # the failing case
    sys.exit("RuntimeError: the reference could not load the weights")
print("READY", flush=True)
runs = 0
for line in sys.stdin:
    if line.strip() == "end":
        break
    runs += 1
    np.save(a["out"], np.load(a["inputs"])["z"] + 1.0)
    print("REF " + json.dumps(dict(seconds=float(runs), threads=2)), flush=True)
open(os.environ["FAKE_RUNS"], "w").write(str(runs))
'''
TINY = dict(overrides=dict(depth=1, hidden_size=64, num_heads=2, caption_channels=32, model_max_length=16),
            latent=(2, 8, 8), batch=1)


def _args(steps=2, repeat=3):
    import argparse

    return argparse.Namespace(steps=steps, repeat=repeat, reference=sys.executable)


def test_reference_and_jaxsora_take_turns_and_the_ratio_is_per_round(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_sample, "REF_SCRIPT", FAKE_REFERENCE)
    monkeypatch.setitem(bench_sample.SHAPES, "tiny", TINY)
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs"))
    folders = []
    real_close = bench_sample.ReferenceSampler.close
    monkeypatch.setattr(bench_sample.ReferenceSampler, "close", lambda self: (folders.append(self.dir.name),
                                                                              real_close(self))[1])
    order = []
    real_timed = bench_sample.timed
    monkeypatch.setattr(bench_sample, "timed", lambda fn: (order.append("jax"), real_timed(fn))[1])
    real_run = bench_sample.ReferenceSampler.run
    monkeypatch.setattr(bench_sample.ReferenceSampler, "run", lambda self: (order.append("ref"), real_run(self))[1])

    [row] = bench_sample.bench_shape("tiny", _args(), ["xla"])

    assert order == ["jax"] + ["ref", "jax"] * 3  # the first call (compile) alone, then the rounds
    assert row["ref"] == [1.0, 2.0, 3.0] and len(row["jax"]) == 3
    ratios = sorted(j / r for j, r in zip(row["jax"], row["ref"]))
    assert row["ratio"] == ratios[1] and row["ratio_range"] == (ratios[0], ratios[2])
    assert row["ref_s"] == 2.0 and row["jax_s"] == sorted(row["jax"])[1] and row["threads"] == 2
    assert 0 < row["rel_diff"] < 10  # the fake's output is z + 1, jaxsora's a sample: compared, not equal
    # the reference's process ran 3 loops and was ended ("end"), its folder (weights, inputs, script) removed
    assert (tmp_path / "runs").read_text() == "3"
    assert len(folders) == 1 and not Path(folders[0]).exists()


def test_a_reference_that_fails_raises_with_its_stderr(monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(bench_sample, "REF_SCRIPT", FAKE_REFERENCE)
    monkeypatch.setitem(bench_sample.SHAPES, "tiny", TINY)
    with pytest.raises(RuntimeError, match="could not load the weights"):
        bench_sample.bench_shape("tiny", _args(steps=3, repeat=1), ["xla"])


def test_table_has_the_ratio_range(monkeypatch, capsys):
    rows = [dict(shape="tiny", first_s=5.0, jax_s=1.0, ref_s=2.0, ratio=0.5, ratio_range=(0.4, 0.6), rel_diff=1e-6,
                 threads=2, jax=[1.0], ref=[2.0])]
    monkeypatch.setattr(bench_sample, "bench_shape", lambda name, args, matmuls: rows)
    bench_sample.main(["--shapes", "realistic", "--reference", "python", "--repeat", "1"])
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("tiny")][0]
    assert line.split() == ["tiny", "1.00", "5.0", "2.00", "0.50", "0.40–0.60", "1.0e-06"], line
