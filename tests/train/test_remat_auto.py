"""`model.remat="auto"`: the compile plan picks, per bucket, the cheapest remat whose compiled train step fits
the device's memory (`jaxsora.train.plan.memory.choose_remat`).

Remat changes no number, so the checks are structural: the real step compiled with each rung of the ladder
recomputes what its policy does not keep (the matmuls of the compiled program) and holds less memory the more
it recomputes; a dry run under a smaller budget picks a heavier rung, prints it with each candidate's memory,
and keeps that executable for the bucket — and for the bucket's batches with shorter captions. The blocks are
scanned: XLA:CPU drops the optimization barriers of unrolled remat, so only scanned blocks show its memory here
(tests/models/test_remat_scan.py checks the residuals each policy names)."""
import pytest

from jaxsora.models.config import AUTO_REMAT_LADDER, RematChoice
from jaxsora.train.plan import memory
from jaxsora.train.run.loop import RunOptions, train
from jaxsora.train.run.setup import setup_run
from jaxsora.train.step.train_step import TrainStep, bucket_key
from tests.train.common import small_config
from tests.train.fake_loader import FakeLoader

SIZE = (4, 16, 16)  # the fake loader's bucket
BATCH = 2


def _config(tmp_path, budget_bytes):
    cfg = small_config(tmp_path, mesh=(1, 1, 1))
    cfg.model.update(dict(depth=2, remat="auto", scan_blocks=True))
    cfg.train.update(dict(device_memory_gib=budget_bytes / memory.GIB, remat_memory_fraction=1.0))
    return cfg


def _factory(config, dp, text_inputs):
    return FakeLoader(data_parallel_size=dp, per_device_batch=BATCH, text_inputs=text_inputs)


def _dry_run(cfg, capsys):
    res = train(cfg, RunOptions(dry_run=True, run_dir=cfg.train.outputs + "/run"), loader_factory=_factory)
    (row,) = res["buckets"]
    return row, capsys.readouterr().out


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """A dry run whose budget nothing fits (1 KiB, the memory check off): the plan compiles every rung of the
    ladder — each compiled step recorded here — and ends at full. Its programs land in the persistent
    compilation cache, from which the runs below read them again."""
    cfg = _config(tmp_path_factory.mktemp("walk"), 1024)
    cfg.train.check_memory = False
    compiled = {}
    original = TrainStep.compile_candidate

    def record(self, spec, encoders, remat=None, lowered=None):
        exe, info = original(self, spec, encoders, remat, lowered)
        compiled[remat.label(2)] = exe
        return exe, info

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrainStep, "compile_candidate", record)
        res = train(cfg, RunOptions(dry_run=True, run_dir=cfg.train.outputs + "/run"), loader_factory=_factory)
    (row,) = res["buckets"]
    return cfg, row, compiled


@pytest.mark.slow(seconds=60)  # the fixture: four compiles of the step, cold
def test_each_rung_recomputes_more_and_holds_less(walked):
    """The compiled steps of the ladder, cheapest first: each runs more matmuls (the forward's again, in the
    backward loop: save_matmuls the attention's, save_qkv_proj the attention's and the MLP's, full all) and
    needs less memory than the one before; the plan tried them in this order and, nothing fitting, chose full."""
    _, row, compiled = walked
    order = [c.policy for c in AUTO_REMAT_LADDER]
    assert order == ["none", "save_matmuls", "save_qkv_proj", "full"]
    assert [label for label, _ in row.tried] == order and row.remat == "full" and row.fits is False
    peaks = [peak for _, peak in row.tried]
    dots = [compiled[p].as_text().count(" dot(") for p in order]
    assert dots == sorted(set(dots)), dict(zip(order, dots))  # strictly more recomputed matmuls
    assert peaks == sorted(set(peaks), reverse=True), dict(zip(order, peaks))  # strictly less memory
    assert row.info.peak_bytes == peaks[-1]


def test_a_smaller_budget_picks_a_heavier_remat(walked, tmp_path, capsys):
    """Budgets of exactly a rung's peak: the plan picks that rung (none cheaper fits), prints it in the table
    and with each rung it compiled and its memory, and keeps that executable."""
    _, walk, _ = walked
    peaks = dict(walk.tried)
    for name in ("none", "save_matmuls"):
        row, out = _dry_run(_config(tmp_path / name, peaks[name]), capsys)
        assert row.remat == name and row.fits and row.info.peak_bytes == peaks[name]
        assert [label for label, _ in row.tried] == ["none", "save_matmuls"][:1 + (name != "none")]
        assert f"→ {name}" in out and "remat auto: the cheapest remat whose step fits" in out
        assert f" {name} " in out.split("per-device memory of the compiled train step")[1]  # the table's column


def test_the_choice_is_kept_for_the_bucket_and_its_shorter_captions(walked):
    """The plan's choice belongs to the bucket: the same bucket with captions cut shorter (`data.text_lengths`,
    compiled when first met) is traced with it, another bucket (another batch) is not."""
    cfg, _, _ = walked
    setup = setup_run(cfg, abstract_encoders=True)  # the step of the walk's dry run: one process reuses it
    full = setup.batch_spec(SIZE, BATCH)
    assert setup.step.remat_for(full) == RematChoice("full") and setup.step.compiled(full)
    cut = dict(full)
    for k in ("ids", "text_mask"):
        shape = full[k].shape
        cut[k] = full[k].update(shape=(shape[0], shape[1] // 2, *shape[2:]))
    assert bucket_key(cut) == bucket_key(full) and setup.step.remat_for(cut) == RematChoice("full")
    assert setup.step.remat_for(setup.batch_spec(SIZE, 2 * BATCH)) is None


class _FakeStep:
    """compile_candidate answers a peak per remat from a table (no compiles): choose_remat's arithmetic alone.
    Partial remat's peak is 60 bytes above the line between none and full (the estimate falls short)."""

    def __init__(self, peaks, depth):
        self.peaks, self.depth, self.asked = peaks, depth, []

    def compile_candidate(self, spec, encoders, choice):
        self.asked.append(choice.label(self.depth))
        if choice.policy == "full" and 0 < choice.pairs(self.depth) < self.depth:  # linear in the pairs
            k = choice.pairs(self.depth)
            peak = self.peaks["none"] - k * (self.peaks["none"] - self.peaks["full"]) // self.depth + 60
        else:
            peak = self.peaks[choice.policy]
        return object(), memory.CompileInfo(0.0, peak, 0, 0, 0, None)


PEAKS = dict(none=1000, save_matmuls=800, save_qkv_proj=700, full=200)


@pytest.mark.parametrize("budget, want, asked", [
    (1000, "none", ["none"]),
    (None, "none", ["none"]),  # no memory limit known: no remat
    (750, "save_qkv_proj", ["none", "save_matmuls", "save_qkv_proj"]),
    # partial: k = ceil(8·(1000 − 450)/(1000 − 200)) = 6 pairs: 460 bytes, one pair more: 360
    (450, "full 7/8", ["none", "save_matmuls", "save_qkv_proj", "full", "full 6/8", "full 7/8"]),
    (300, "full", ["none", "save_matmuls", "save_qkv_proj", "full", "full 7/8"]),
    (100, "full", ["none", "save_matmuls", "save_qkv_proj", "full"]),  # nothing fits: full, refused later
])
def test_choose_remat_walks_the_ladder_and_places_partial_remat(budget, want, asked):
    step = _FakeStep(PEAKS, depth=8)
    choice, info, _, tried = memory.choose_remat(step, {}, None, 8, budget)
    assert choice.label(8) == want and step.asked == asked
    assert [c.label(8) for c, _ in tried] == asked
    assert info.peak_bytes == dict((c.label(8), peak) for c, peak in tried)[want]


@pytest.mark.parametrize("budget, want", [(1000, "none"), (750, "save_qkv_proj"), (450, "full 7/8"), (300, "full"),
                                          (100, "full")])
def test_choose_remat_in_parallel_picks_the_same(budget, want):
    """parallel: the fixed rungs compiled at once, then the partial ones at once — the same choice; every fixed
    rung compiled, and the partial ones only where the fixed ones leave a gap."""
    step = _FakeStep(PEAKS, depth=8)
    choice, info, _, tried = memory.choose_remat(step, {}, None, 8, budget, parallel=4)
    assert choice.label(8) == want
    fixed = ["none", "save_matmuls", "save_qkv_proj", "full"]
    assert step.asked[:4] == fixed and [c.label(8) for c, _ in tried] == step.asked
    assert step.asked[4:] == {450: ["full 6/8", "full 7/8"], 300: ["full 7/8"]}.get(budget, [])
