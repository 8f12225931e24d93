"""The training loop behind `python -m jaxsora.train` (see `jaxsora/train/__main__.py`).

A run: validate the config → build the mesh, encoders, state plan and jitted step
(`train.setup`) → the loader → compile the step for every bucket of the plan and refuse buckets
that do not fit the device (`train.memory`) → the initial state for the resume mode, created in
its shards → steps. Everything from the state's creation to the last save runs under the mesh
(`jax.set_mesh`), and the step itself is bound to it (`train.step.TrainStep`).

The step loop never waits for the device: metrics stay on the device and are fetched once per
`train.log_every` steps (and at saves), at most `MAX_IN_FLIGHT` steps are queued ahead, and the
loader's workers already turned captions into token ids or cached text states. Each step's time is
taken when the loop waits for it anyway (the step `MAX_IN_FLIGHT` back, and the rest at a fetch):
completion minus the later of the previous step's completion and the start of its own iteration.

With `eval.table` set, the validation loss (`train.eval`) runs every `eval.every` steps (after that
step's log line, before its checkpoint), optionally before the first step (`eval.at_start`, a run
starting at step 0) and after the last one (`eval.at_end`); its time is left out of the train
throughput figures.

The run folder: `train.run_folder` (`--run-dir`, the loaded run's, or a new numbered one).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable

import jax

from jaxsora.checkpoint import Checkpointer, restore
from jaxsora.errors import UserError
from jaxsora.parallel import peers
from jaxsora.train import memory, run_folder
from jaxsora.train.contracts import Loader
from jaxsora.train.memory import EmptyPlanError  # noqa: F401  (re-exported)
from jaxsora.train.run_folder import new_run_folder as _new_run_folder  # noqa: F401  (tests import it here)
from jaxsora.train.setup import default_loader, fresh_state, plain, setup_run, weights_only_state
from jaxsora.train.step import batch_key, global_batch
from jaxsora.train.supervise import RunLock, StopRequested, Watchdog, register_stack_dump, write_heartbeat

# Steps dispatched ahead of the device. Waiting for step k-2 before dispatching step k never
# idles the device (k-1 is queued) and bounds the batches held on it.
MAX_IN_FLIGHT = 2


class NonFiniteError(RuntimeError):
    """Training stopped after `train.max_nonfinite_steps` rejected steps in a row."""


@dataclasses.dataclass
class RunOptions:
    data_path: str | None = None
    load: str | None = None  # a run / checkpoints / step folder, or an experiment number (656)
    step: int | None = None  # with load: that checkpoint step (default: the newest intact one)
    ckpt_path: str | None = None
    start_from_scratch: bool = False
    outputs: str | None = None
    run_dir: str | None = None  # exactly this run folder (default: the loaded run's, or a new numbered one)
    dry_run: bool = False
    profile: str | None = None  # "START:STOP": a jax.profiler trace of those steps


def _is_main() -> bool:
    return jax.process_index() == 0


def _version():
    from jaxsora import __version__

    return __version__


def _profile_range(spec: str | None) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        from jaxsora.errors import ConfigError

        raise ConfigError(f"--profile expects START:STOP step numbers with START < STOP, got {spec!r}")
    return a, b


def train(config, opts: RunOptions, *, loader_factory: Callable[..., Loader] | None = None,
          eval_data_factory=None) -> dict:
    """Run training (or the dry run); returns a summary dict. `loader_factory(config, dp, text_inputs)`
    and `eval_data_factory(config, setup, outdir)` replace the video loader and the eval data."""
    from jaxsora.train.validate import validate_config

    if opts.data_path:
        config.data.table = opts.data_path
    if opts.outputs:
        config.train.outputs = opts.outputs
    opts = run_folder.resolve_load_number(config, opts)
    validate_config(config, opts)
    if eval_data_factory is None:
        from jaxsora.train import eval as eval_lib

        eval_lib.check_config(config)  # the eval table, buckets and text states, before any work
    profile = _profile_range(opts.profile)
    tcfg = config.train
    outdir = run_folder.given_run_folder(opts)  # None: a new numbered folder, made once the table checked out
    # The persistent compilation cache: shared by every experiment under the outputs folder, unless
    # one is already set (JAX_COMPILATION_CACHE_DIR).
    if tcfg.get("compilation_cache", True) and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.abspath(tcfg.outputs), "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    if opts.dry_run:
        import tempfile

        from jaxsora.train.dry_run import dry_run

        with tempfile.TemporaryDirectory(prefix="jaxsora-dry-run-") as scratch:
            indexes = outdir
            if outdir is None:  # a dry run claims no number: its table indexes go to temporary folders
                outdir, indexes = run_folder.next_run_folder(config), scratch
                if _is_main():
                    print(f"[jaxsora] dry run: a new run would be written to {outdir}")
            elif not config.data.get("index_dir"):
                config.data.index_dir = os.path.join(outdir, "table_index")
            setup = setup_run(config, abstract_encoders=True)
            loader = (loader_factory or default_loader)(config, setup.data_parallel_size, setup.encoders.text_inputs)
            return dry_run(setup, loader, outdir, evaluator=_evaluator(setup, indexes, eval_data_factory))

    if loader_factory is None and not config.data.get("features"):  # the table's columns and rows, before the
        # run takes its folder (a features run reads no table: the cache holds its rows)
        from jaxsora.data.tables import check_table

        check_table(config.data.table)
    new = outdir is None
    # taken back if the run is refused before step 0 (memory, checkpoint, features, eval): nothing left behind
    claim = run_folder.Claim.begin(config, outdir)
    if new:
        outdir = run_folder.new_run_folder(config)
    claim.taken(outdir)
    started = False
    if not config.data.get("index_dir"):  # the table index lives with the run and is reused on resume
        config.data.index_dir = os.path.join(outdir, "table_index")
    if _is_main():
        how = ["new"] if new else ["--run-dir"] if opts.run_dir else []
        how += [f"resuming {opts.load}"] if opts.load else []
        print(f"[jaxsora] run folder: {outdir} ({', '.join(how)})", flush=True)
    # One owner per run folder (process 0 holds the lock for all processes of the run).
    lock = RunLock(outdir).acquire() if _is_main() else None
    refused = False
    try:
        if not new:  # after the lock: a folder that a live run owns is refused naming that run
            run_folder.refuse_another_run(outdir, opts)
        if _is_main():
            from jaxsora.runs import record_invocation

            record_invocation(outdir, processes=jax.process_count(), jaxsora=_version(), load=opts.load,
                              ckpt_path=opts.ckpt_path)
        # `python -m jaxsora.cluster dump` (or kill -USR2) → every thread's stack in <run>/stacks/;
        # the heartbeat gives `cluster status` this process's pid while it compiles.
        register_stack_dump(outdir, jax.process_index())
        if jax.process_count() > 1:
            peers.on_lost(_lost_peer_handler(outdir))
        write_heartbeat(outdir, jax.process_index(), None, phase="starting")
        setup = setup_run(config)
        loader = (loader_factory or default_loader)(config, setup.data_parallel_size, setup.encoders.text_inputs)
        evaluator = _evaluator(setup, outdir, eval_data_factory)
        try:
            with jax.set_mesh(setup.mesh):
                write_heartbeat(outdir, jax.process_index(), None, phase="compiling")
                buckets = memory.compile_plan(setup, loader)
                if evaluator is not None:
                    evaluator.compile(limit=memory.device_memory_limit(config), threads=memory.compile_threads(config),
                                      check=bool(config.train.get("check_memory", True)), progress=_is_main())
                write_heartbeat(outdir, jax.process_index(), None, phase="restoring" if opts.load else "initializing")
                state, wandb_id = _initial_state(setup, loader, opts)
                started = True
                result = _run(setup, loader, state, wandb_id, outdir, opts, profile, buckets, evaluator)
        except BaseException as e:  # the last heartbeat says how the run ended (`jaxsora.runs`, `cluster status`)
            peers.await_verdict(e)  # a collective failed because a peer is gone: the peer watch ends the process
            if not (isinstance(e, UserError) and not started):  # a refusal leaves no heartbeat (undone below)
                write_heartbeat(outdir, jax.process_index(), None,
                                phase="non-finite" if isinstance(e, NonFiniteError) else "failed")
            raise
        write_heartbeat(outdir, jax.process_index(), result["steps"],
                        phase="stopped" if result["stopped_by_signal"] else "done")
        return result
    except UserError:
        if not started:
            refused = True
        raise
    finally:
        if lock is not None:
            lock.release()
        if refused:
            claim.undo()


# The newest step dispatched by `_run` (what a lost-peer exit reports).
_progress = {"step": None}


def _lost_peer_handler(outdir: str):
    """What a surviving process says and writes when another process of the run is lost
    (`jaxsora.parallel.peers`): one line naming it, the step, and the checkpoint to resume from; the
    heartbeat's phase "lost-peer"; exit code EXIT_PEER_LOST."""
    import sys

    from jaxsora.checkpoint import INTEGRITY_FILE, checkpoint_steps
    from jaxsora.errors import EXIT_PEER_LOST

    def handler(lost: list, why: str) -> None:
        step = _progress["step"]
        root = os.path.join(outdir, "checkpoints")
        intact = [s for s in checkpoint_steps(root) if os.path.isfile(os.path.join(root, str(s), INTEGRITY_FILE))]
        newest = max(intact) if intact else None
        write_heartbeat(outdir, jax.process_index(), step, phase="lost-peer", lost=list(lost),
                        newest_checkpoint=newest)
        resume = (f"resume every process with --load {outdir} (newest intact checkpoint: step {newest})"
                  if newest is not None else "no checkpoint was written yet: start the run again")
        who = ", ".join(str(i) for i in lost)
        print(f"[jaxsora] lost process {who} of {jax.process_count()} ({why}) at step {step}: process "
              f"{jax.process_index()} stops (exit code {EXIT_PEER_LOST}); {resume}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    return handler


def _evaluator(setup, outdir, factory=None):
    """The run's `train.eval.Evaluator`, or None when `eval.table` is not set."""
    from jaxsora.train import eval as eval_lib

    if not eval_lib.enabled(setup.config):
        return None
    data = factory(setup.config, setup, outdir) if factory is not None else None
    return eval_lib.build_evaluator(setup.config, setup, outdir, data=data)


def _bucket_name(bucket) -> str:
    """(res, T, H, W) → "<res>_<T>x<H>x<W>" (the `time/<bucket>` metric names)."""
    res, *size = bucket
    return f"{res}_{'x'.join(str(int(v)) for v in size)}" if res else "x".join(str(int(v)) for v in size)


def _initial_state(setup, loader, opts: RunOptions):
    """(state, wandb run id) for the resume mode; every array is created in its shards."""
    if opts.load:
        restored = restore(opts.load, setup.plan.abstract_sharded, step=opts.step)
        loader.restore(restored["data"], reset=opts.start_from_scratch)
        if _is_main():
            print(f"[jaxsora] resumed {opts.load} at step {restored['step']}"
                  f"{' (data order restarted)' if opts.start_from_scratch else ''}")
        return restored["state"], restored["meta"].get("wandb_id")
    if opts.ckpt_path:
        return weights_only_state(setup, opts.ckpt_path), None
    return fresh_state(setup), None


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


def _run(setup, loader, state, wandb_id, outdir, opts, profile, buckets, evaluator=None) -> dict:
    from jaxsora.models.lora import LoRASpec

    _progress["step"] = None
    from jaxsora.train.logging import MetricLogger
    from jaxsora.train.mfu import peak_flops, train_flops_per_sample

    config, mesh = setup.config, setup.mesh
    tcfg = config.train
    run_config = plain(config)
    run_config["model"] = {**run_config.get("model", {}), **setup.model_config.to_dict()}
    ckpt = Checkpointer(os.path.join(outdir, "checkpoints"), keep=int(tcfg.get("keep_ckpts", 3)),
                        async_save=bool(tcfg.get("async_checkpoint", True)))
    max_steps, epochs = planned_steps(config, loader)
    logger = MetricLogger(config, outdir, resume_id=wandb_id, enabled=_is_main(), peak_flops=peak_flops(config),
                          num_devices=jax.device_count(), total_steps=max_steps, epochs=epochs or None)
    stop = StopRequested(multi_process=jax.process_count() > 1)
    watchdog = Watchdog(float(tcfg.watchdog_factor), float(tcfg.watchdog_min_seconds))  # defaults: configs/base.py
    ckpt_every = int(tcfg.ckpt_every)
    log_every, max_bad = int(tcfg.get("log_every", 10)), int(tcfg.get("max_nonfinite_steps", 5))
    ecfg = config.get("eval") or {}
    eval_every = int(ecfg.get("every", 0) or 0) if evaluator is not None else 0
    enc = setup.encoders.weights
    counts = dict(bad_in_row=0, nonfinite=0)
    # good_ckpt: the newest checkpoint saved before the current streak of rejected steps began.
    last = dict(loss=None, good_ckpt=None, streak_ckpt=None, interval_start=time.monotonic(), done=None,
                eval_step=None, eval=None)
    pending: list = []  # (device metrics, host facts) of the steps since the last fetch
    in_flight: collections.deque = collections.deque()  # (loss, host facts, iteration start) of queued steps
    step = int(jax.device_get(state.step))
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
        meta = dict(wandb_id=logger.run_id, jaxsora=_version(), mesh=dict(mesh.shape),
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
                _progress["step"] = step
                pending.append((metrics, facts))
                # train.epochs: the last batch of the last epoch was dispatched
                data_done = bool(epochs) and int(host.get("epoch", 0)) >= epochs - 1 and \
                    int(host.get("index", 0)) >= last_epoch_len
                if tracing and step >= profile[1]:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    tracing = False
                    if _is_main():
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


