"""The step loop of a run (`train.run.loop.train` sets the run up and calls `run_steps`).

The loop never waits for the device: metrics stay on the device and are fetched once per
`train.log_every` steps (and at saves), at most `MAX_IN_FLIGHT` steps are queued ahead, and the
loader's workers already turned captions into token ids or cached text states. Each step's time is
taken when the loop waits for it anyway (the step `MAX_IN_FLIGHT` back, and the rest at a fetch):
completion minus the later of the previous step's completion and the start of its own iteration.

With `eval.table` set, the validation loss (`train.eval.loss`) runs every `eval.every` steps (after
that step's log line, before its checkpoint), optionally before the first step (`eval.at_start`, a
run starting at step 0) and after the last one (`eval.at_end`); its time is left out of the train
throughput figures.
"""
from __future__ import annotations

import collections
import os
import time

import jax

from jaxsora.checkpoint import Checkpointer
from jaxsora.data import text_length
from jaxsora.parallel import agree
from jaxsora.train.plan import memory
from jaxsora.train.run import agent
from jaxsora.train.run.setup import plain
from jaxsora.train.run.supervise import StopRequested, Watchdog, write_heartbeat
from jaxsora.train.step.train_step import batch_key, global_batch


def is_main() -> bool:
    return jax.process_index() == 0


def version() -> str:
    from jaxsora import __version__

    return __version__


# Steps dispatched ahead of the device. Waiting for step k-2 before dispatching step k never
# idles the device (k-1 is queued) and bounds the batches held on it.
MAX_IN_FLIGHT = 2


class NonFiniteError(RuntimeError):
    """Training stopped after `train.max_nonfinite_steps` rejected steps in a row."""


# The newest step dispatched by `run_steps`, or the step its state started at (what a lost-peer exit reports).
progress = {"step": None}


def _bucket_name(bucket) -> str:
    """(res, T, H, W) → "<res>_<T>x<H>x<W>" (the `time/<bucket>` metric names)."""
    res, *size = bucket
    return f"{res}_{'x'.join(str(int(v)) for v in size)}" if res else "x".join(str(int(v)) for v in size)


def planned_steps(config, loader) -> tuple[int, int]:
    """(steps of the run, epochs). `train.epochs` > 0 (Open-Sora's `epochs`): the steps of epochs
    0..epochs−1 (each epoch's plan has its own length), capped by `train.max_steps`; otherwise
    `train.max_steps`."""
    max_steps = int(config.train.max_steps)
    epochs = int(config.train.get("epochs", 0) or 0)
    if epochs <= 0:
        return max_steps, 0
    total = 0
    for e in range(epochs):
        total += int(loader.steps_per_epoch(e))
        if total >= max_steps:
            return max_steps, epochs
    return total, epochs


def _skip_counts(loader) -> dict:
    """{reason: samples skipped so far} of the loader (a total under "skipped" for loaders that
    only count)."""
    counts = getattr(loader, "skip_counts", None)
    if counts is not None:
        return {str(k): int(v) for k, v in dict(counts).items()}
    n = int(getattr(loader, "num_skipped", 0))
    return {"unreadable": n} if n else {}


def text_fitter(config, max_length: int):
    """host batch, step id → the batch with its text cut to the shortest `data.text_lengths` entry that
    holds its longest caption (the same length on every process), or as it is when none is set."""
    lengths = text_length.check_lengths(config.data.get("text_lengths", ()))
    if not lengths or min(lengths) >= max_length:
        return lambda host, _: host

    def fit(host: dict, step_id: int) -> dict:
        tag = f"text/{step_id}"
        valid = agree.agree_max(tag, text_length.valid_length(host["text_mask"]))
        agree.forget(f"text/{step_id - 2}")  # every process has read it: each has given step_id − 1's
        return text_length.cut(host, text_length.fitted_length(valid, lengths, max_length))

    return fit


def run_steps(setup, loader, state, wandb_id, outdir, opts, profile, buckets, evaluator=None) -> dict:
    """The steps of a run whose state is on the mesh: dispatch, log, evaluate, save; the summary dict
    `train()` returns."""
    from jaxsora.models.lora import LoRASpec
    from jaxsora.train.plan.mfu import peak_flops, train_flops_per_sample
    from jaxsora.train.run.logging import MetricLogger

    config, mesh = setup.config, setup.mesh
    tcfg = config.train
    run_config = plain(config)
    run_config["model"] = {**run_config.get("model", {}), **setup.model_config.to_dict()}
    ckpt = Checkpointer(os.path.join(outdir, "checkpoints"), keep=int(tcfg.get("keep_ckpts", 3)),
                        async_save=bool(tcfg.get("async_checkpoint", True)))
    max_steps, epochs = planned_steps(config, loader)
    logger = MetricLogger(config, outdir, resume_id=wandb_id, enabled=is_main(), peak_flops=peak_flops(config),
                          num_devices=jax.device_count(), total_steps=max_steps, epochs=epochs or None)
    stop = StopRequested(multi_process=jax.process_count() > 1)
    watchdog = Watchdog(float(tcfg.watchdog_factor), float(tcfg.watchdog_min_seconds))  # defaults: configs/base.py
    ckpt_every = int(tcfg.ckpt_every)
    log_every, max_bad = int(tcfg.get("log_every", 10)), int(tcfg.get("max_nonfinite_steps", 5))
    ecfg = config.get("eval") or {}
    eval_every = int(ecfg.get("every", 0) or 0) if evaluator is not None else 0
    enc = setup.encoders.weights
    fit_text = text_fitter(config, setup.encoders.model_max_length)
    counts = dict(bad_in_row=0, nonfinite=0)
    # good_ckpt: the newest checkpoint saved before the current streak of rejected steps began.
    last = dict(loss=None, good_ckpt=None, streak_ckpt=None, interval_start=time.monotonic(), done=None,
                eval_step=None, eval=None)
    pending: list = []  # (device metrics, host facts) of the steps since the last fetch
    in_flight: collections.deque = collections.deque()  # (loss, host facts, iteration start) of queued steps
    step = int(jax.device_get(state.step))
    progress["step"] = step  # the state's step until the next one is dispatched
    agent.note_step(step)
    flops_cache: dict = {}
    frozen_base = LoRASpec.from_config(config.get("lora")) is not None  # LoRA: no weight gradients of the base

    def flops_of(size: tuple, gb: int) -> float:
        """Model FLOPs (forward + backward) of a global batch of pixel size (T, H, W)."""
        if size not in flops_cache:
            flops_cache[size] = train_flops_per_sample(setup.model_config, setup.encoders.latent_size(size),
                                                       frozen_base=frozen_base)
        return flops_cache[size] * gb

    def complete(entry) -> None:
        """Wait for a queued step (the loop waits for it anyway) and note its step time."""
        loss, facts, began = entry
        loss.block_until_ready()
        now = time.monotonic()
        facts["step_time"] = now - (began if last["done"] is None else max(last["done"], began))
        last["done"] = now

    def drain() -> None:
        while in_flight:
            complete(in_flight.popleft())

    def save(force=False):
        s = int(jax.device_get(state.step))
        meta = dict(wandb_id=logger.run_id, jaxsora=version(), mesh=dict(mesh.shape),
                    processes=jax.process_count(), time=time.time())
        if ckpt.save(s, state, config=run_config, data=loader.state(), meta=meta, force=force):
            # Rejected steps leave the state untouched, so a save during a streak holds the state
            # from before its first bad step — still good.
            last["good_ckpt"] = os.path.join(ckpt.directory, str(s))

    def fetch_and_log() -> int:
        """Fetch the pending steps' metrics in one transfer; log them; count non-finite steps.
        Returns the number of optimizer steps applied so far."""
        if not pending:
            return step
        drain()  # the transfer below waits for these steps anyway: note their times first
        fetched = jax.device_get([m for m, _ in pending])
        rows = []
        for m, (_, host) in zip(fetched, pending):
            # The metrics are replicated global arrays: every process reads the same values and
            # takes the same decision at the same step.
            if int(m["nonfinite"]):
                counts["bad_in_row"] += 1
                counts["nonfinite"] += 1
                if counts["bad_in_row"] >= max_bad:
                    raise NonFiniteError(
                        f"{counts['bad_in_row']} rejected steps in a row (loss {float(m['loss'])}, grad norm "
                        f"{float(m['grad_norm'])}, update norm growth {float(m.get('norm_growth', 1.0)):.3g}); "
                        f"stopping at step {int(m['step'])}, no bad update applied. Last good checkpoint: "
                        f"{last['good_ckpt']}")
            else:
                counts["bad_in_row"] = 0
                last["loss"] = float(m["loss"])
            rows.append(dict(m, **host, nonfinite_total=counts["nonfinite"]))
        now = time.monotonic()
        logger.log(rows, now - last["interval_start"])
        last["interval_start"] = now
        pending.clear()
        return int(rows[-1]["step"])

    def run_eval() -> None:
        """The validation loss of the current weights (one transfer at its end), logged; its time
        is taken out of the current log interval."""
        drain()
        t0 = time.monotonic()
        result = evaluator.evaluate(state)
        logger.log_eval(result)
        last["eval_step"], last["eval"] = result["step"], result
        last["interval_start"] += time.monotonic() - t0

    if not opts.load:
        save(force=True)  # the Lambda fork's "save at start"
    if evaluator is not None and ecfg.get("at_start", False) and step == 0:
        run_eval()
    it = iter(loader)
    tracing = False
    dispatched = 0  # steps dispatched by this run: the same on every host (the preemption sync's step id)
    data_done = False
    last_epoch_len = int(loader.steps_per_epoch(epochs - 1)) if epochs else 0
    try:
        while True:
            while step < max_steps and not data_done and not stop.should_stop(dispatched):
                if profile and step == profile[0] and not tracing:
                    jax.profiler.start_trace(os.path.join(outdir, "profile"))
                    tracing = True
                watchdog.phase("data")
                t0 = time.monotonic()
                host = next(it)
                t_data = time.monotonic() - t0
                watchdog.phase(None)
                host = fit_text(host, dispatched)
                batch = global_batch(host, mesh)
                if batch_key(batch) not in setup.step.executables:
                    memory.compile_late(setup, batch, host)
                watchdog.phase("step")
                state, metrics = setup.step(state, batch, enc)
                gb = batch["fps"].shape[0]
                bucket = tuple(host["bucket"]) if "bucket" in host else ("", *batch["video"].shape[2:])
                size = tuple(int(v) for v in bucket[1:])
                facts = dict(data_time=t_data, samples=gb, tokens=gb * setup.tokens_per_sample(size),
                             flops=flops_of(size, gb), epoch=host.get("epoch", 0), bucket=str(bucket),
                             bucket_name=_bucket_name(bucket), skipped=_skip_counts(loader))
                in_flight.append((metrics["loss"], facts, t0))
                if len(in_flight) > MAX_IN_FLIGHT:
                    complete(in_flight.popleft())
                watchdog.phase(None)
                step += 1
                dispatched += 1
                progress["step"] = step
                agent.note_step(step)
                pending.append((metrics, facts))
                # train.epochs: the last batch of the last epoch was dispatched
                data_done = bool(epochs) and int(host.get("epoch", 0)) >= epochs - 1 and \
                    int(host.get("index", 0)) >= last_epoch_len
                if tracing and step >= profile[1]:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    tracing = False
                    if is_main():
                        print(f"[jaxsora] profile of steps {profile[0]}..{profile[1]} → {outdir}/profile")
                if step % log_every == 0:
                    step = fetch_and_log()
                    write_heartbeat(outdir, jax.process_index(), step)
                if eval_every and step % eval_every == 0 and step != last["eval_step"]:
                    run_eval()
                if step % ckpt_every == 0:
                    save()
            step = fetch_and_log()  # the true count: rejected steps were not applied
            if step >= max_steps or data_done or stop.flag:
                break
        save(force=True)  # the end (or a signal)
        if (evaluator is not None and ecfg.get("at_end", True) and not stop.flag and (step >= max_steps or data_done)
                and step != last["eval_step"]):
            run_eval()
    finally:
        if tracing:
            jax.profiler.stop_trace()
        watchdog.stop()
        stop.restore()
        ckpt.close()
        logger.close()
    return dict(steps=step, last_loss=last["loss"], checkpoints=ckpt.directory, outputs=outdir,
                # a signal that came when the run was already done does not ask for a requeue
                stopped_by_signal=bool(stop.flag) and step < max_steps and not data_done,
                nonfinite=counts["nonfinite"], buckets=buckets,
                eval=last["eval"])
