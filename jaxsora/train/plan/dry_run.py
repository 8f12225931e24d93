"""`python -m jaxsora.train ... --dry-run`: validate the config, the table and the bucket plan, and
compile the real train step for every bucket of the plan — printing what each needs per device —
without reading encoder weights, allocating the train state or training. With `eval.table` set, the
eval plan too, and the eval function's memory per bucket shape. A bucket that does not fit ends it
as it ends the real start: the same one-line refusal (with the largest per-device batch that fits)
and exit code 2."""
from __future__ import annotations

import jax
import numpy as np

from jaxsora.parallel import targets
from jaxsora.parallel.sharding import bytes_per_device
from jaxsora.train.plan import memory, roofline


def _numbers(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def dry_run(setup, loader, outdir: str, evaluator=None) -> dict:
    config, mesh, plan = setup.config, setup.mesh, setup.plan
    n_train = _numbers(plan.abstract.params)
    n_params = n_train + _numbers(plan.abstract.frozen)
    state_bytes = bytes_per_device(plan.abstract_sharded)
    mcfg = setup.model_config
    target = targets.target_of(mesh)
    lines = [target.describe()] if target is not None else []
    lines += [f"model {config.model.get('name')}: {n_params:,} numbers ({n_train:,} trainable); "
              f"remat {mcfg.remat}"
              + (" (chosen per bucket, below)" if mcfg.remat == "auto" else "" if mcfg.remat == "none" else
                 f" ({'all' if mcfg.remat_blocks < 0 else mcfg.remat_blocks} block pairs)") + ", "
              f"scan_blocks {mcfg.scan_blocks}, compute {mcfg.compute_dtype}, attention {mcfg.attention_impl}"
              + (" (auto, for " + targets.platform_of(mesh) + ")" if config.model.get("attention_impl") == "auto"
                 else ""),
              f"mesh {dict(mesh.shape)} over {mesh.size} devices"
              + (f" of {target.name}" if target else f" ({jax.process_count()} processes)"),
             f"train state per device (params, frozen, EMA, Adam): {state_bytes / memory.GIB:.2f} GiB"]
    plan_rows = loader.describe_plan(0)
    total = 0
    lines.append(f"epoch 0 plan ({loader.num_rows} rows in the table):")
    lines.append(f"{'bucket (res, frames, H, W)':<32} {'rows':>7} {'batches/epoch':>14} {'global batch':>13}")
    for bucket, nb, gb, rows in plan_rows:
        lines.append(f"{str(bucket):<32} {rows:>7} {nb:>14} {gb:>13}")
        total += nb
    lines.append(f"steps per epoch: {total}")
    note = loader.left_out_note(0, plan_rows) if hasattr(loader, "left_out_note") else None
    if note:
        lines.append(f"note: {note}")
    if total == 0:
        lines.append("WARNING: no full batch this epoch: no row fits the bucket config at this data-parallel size "
                     "(too small, too short, or too few rows)")
    if jax.process_index() == 0:
        print("\n".join(lines), flush=True)
    limit = memory.device_memory_limit(config)
    budget = memory.remat_budget(config, limit)
    # every bucket the table's rows fall into, also those too small for a full batch in this epoch:
    # the table is for planning (a sample of the real data, a new machine, another mesh)
    shapes = [(b, gb) for b, nb, gb, rows in plan_rows if rows > 0]
    rows = memory.compile_buckets(setup, shapes, limit=limit, threads=memory.compile_threads(config),
                                  progress=jax.process_index() == 0, budget=budget)
    table = memory.format_table(rows)
    choices = memory.format_choices(rows, budget)
    speed = roofline.rows(setup, rows, target)
    if jax.process_index() == 0:
        print(f"per-device memory of the compiled train step ({len(rows)} bucket shapes):")
        print(table, flush=True)
        if choices:
            print(choices, flush=True)
        print(roofline.format_rows(speed, target), flush=True)
        for note in memory.backend_notes(setup.model_config, targets.platform_of(mesh)):
            print(f"note: {note}")
    eval_rows = None
    if evaluator is not None:
        eval_rows = evaluator.compile(limit=limit, check=False, progress=False,
                                      threads=memory.compile_threads(config))
        if jax.process_index() == 0:
            gib = memory.GIB
            plan = evaluator.data.describe()
            print(f"eval plan ({len(evaluator.data.plan)} batches × {evaluator.num_timesteps} timesteps): "
                  + ", ".join(f"{k} {r} rows in {n} batches" for k, (r, n) in plan.items()))
            for name, (_res, t, h, w), gb, info in eval_rows:
                fits = "?" if not limit else ("yes" if info.peak_bytes <= limit else "NO")
                print(f"  eval {name:<16} {t}×{h}×{w} global batch {gb:>4}: {info.peak_bytes / gib:8.2f} GiB per "
                      f"device, compiled in {info.seconds:.1f}s, fits {fits}")
    if config.train.get("check_memory", True):
        msg = memory.refusal(setup, rows)
        if msg:  # the real start's refusal, with its suggestion: a script or CI gate sees exit code 2
            raise memory.MemoryPlanError(msg)
    return dict(plan=plan_rows, steps_per_epoch=total, params=n_params, state_bytes=state_bytes, buckets=rows,
                outputs=outdir, eval=eval_rows, speed=speed)
