"""The training run behind `python -m jaxsora.train` (see `jaxsora/train/__main__.py`).

A run: validate the config → build the mesh, encoders, state plan and jitted step
(`train.run.setup`) → the loader → compile the step for every bucket of the plan and refuse buckets
that do not fit the device (`train.plan.memory`) → the initial state for the resume mode, created in
its shards → the steps (`train.run.steps`). Everything from the state's creation to the last save
runs under the mesh (`jax.set_mesh`), and the step itself is bound to it
(`train.step.train_step.TrainStep`). A run refused before step 0 leaves nothing behind.

The run folder: `train.run.folder` (`--run-dir`, the loaded run's, or a new numbered one).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from jaxsora.checkpoint import restore
from jaxsora.errors import UserError
from jaxsora.parallel import peers
from jaxsora.train.contracts import Loader
from jaxsora.train.plan import memory
from jaxsora.train.plan.memory import EmptyPlanError  # noqa: F401  (re-exported)
from jaxsora.train.run import agent, steps
from jaxsora.train.run import folder as run_folder
from jaxsora.train.run.folder import new_run_folder as _new_run_folder  # noqa: F401  (tests import it here)
from jaxsora.train.run.setup import default_loader, fresh_state, setup_run, weights_only_state
from jaxsora.train.run.steps import NonFiniteError, is_main, run_steps, version  # noqa: F401  (NonFiniteError: re-exported)
from jaxsora.train.run.supervise import RunLock, register_stack_dump, write_heartbeat


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


def train(config, opts: RunOptions, *, loader_factory: Callable[..., Loader] | None = None,
          eval_data_factory=None) -> dict:
    """Run training (or the dry run); returns a summary dict. `loader_factory(config, dp, text_inputs)`
    and `eval_data_factory(config, setup, outdir)` replace the video loader and the eval data."""
    from jaxsora.train.plan.validate import profile_range, validate_config

    if opts.data_path:
        config.data.table = opts.data_path
    if opts.outputs:
        config.train.outputs = opts.outputs
    opts = run_folder.resolve_load_number(config, opts)
    validate_config(config, opts)
    if eval_data_factory is None:
        from jaxsora.train.eval import loss as eval_lib

        eval_lib.check_config(config)  # the eval table, buckets and text states, before any work
    profile = profile_range(opts.profile)
    tcfg = config.train
    outdir = run_folder.given_run_folder(opts)  # None: a new numbered folder, made once the table checked out
    # The persistent compilation cache: shared by every experiment under the outputs folder, unless
    # one is already set (JAX_COMPILATION_CACHE_DIR).
    if tcfg.get("compilation_cache", True) and not jax.config.jax_compilation_cache_dir:
        from jaxsora.runs import COMPILATION_CACHE

        jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.abspath(tcfg.outputs), COMPILATION_CACHE))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    if opts.dry_run:
        import tempfile

        from jaxsora.train.plan.dry_run import dry_run

        with tempfile.TemporaryDirectory(prefix="jaxsora-dry-run-") as scratch:
            indexes = outdir
            if outdir is None:  # a dry run claims no number: its table indexes go to temporary folders
                outdir, indexes = run_folder.next_run_folder(config), scratch
                if is_main():
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
    if is_main():
        how = ["new"] if new else ["--run-dir"] if opts.run_dir else []
        how += [f"resuming {opts.load}"] if opts.load else []
        print(f"[jaxsora] run folder: {outdir} ({', '.join(how)})", flush=True)
    # One owner per run folder (process 0 holds the lock for all processes of the run).
    lock = RunLock(outdir).acquire() if is_main() else None
    refused = False
    try:
        if not new:  # after the lock: a folder that a live run owns is refused naming that run
            run_folder.refuse_another_run(outdir, opts)
        if is_main():
            from jaxsora.runs import record_invocation

            record_invocation(outdir, processes=jax.process_count(), jaxsora=version(), load=opts.load,
                              ckpt_path=opts.ckpt_path)
        # `python -m jaxsora.cluster dump` (or kill -USR2) → every thread's stack in <run>/stacks/;
        # the heartbeat gives `cluster status` this process's pid while it compiles.
        register_stack_dump(outdir, jax.process_index())
        steps.progress["step"] = None
        if jax.process_count() > 1:
            peers.on_lost(_lost_peer_handler(outdir))
            agent.note_run(outdir)  # for the line of this host's trainer parent, if jaxlib ends this process
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
                                      check=bool(config.train.get("check_memory", True)), progress=is_main())
                write_heartbeat(outdir, jax.process_index(), None, phase="restoring" if opts.load else "initializing")
                state, wandb_id = _initial_state(setup, loader, opts)
                started = True
                result = run_steps(setup, loader, state, wandb_id, outdir, opts, profile, buckets, evaluator)
        except BaseException as e:  # the last heartbeat says how the run ended (`jaxsora.runs`, `cluster status`)
            # a collective failed, or a peer is suspect: the peer watch names the lost process and ends this one
            peers.await_verdict(e)
            peers.failing()  # else the error is this process's own: its peers stop too, naming it
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


def _lost_peer_handler(outdir: str):
    """What a surviving process says and writes when another process of the run is lost
    (`jaxsora.parallel.peers`): one line naming it, the step, and the checkpoint to resume from; the
    heartbeat's phase "lost-peer"; exit code EXIT_PEER_LOST — through `os._exit`, so that nothing else runs
    on the way out (jax's exit-time `distributed.shutdown()` would wait for the lost peer and abort)."""
    import sys

    from jaxsora.errors import EXIT_PEER_LOST

    def handler(lost: list, why: str) -> None:
        step = steps.progress["step"]
        newest = peers.newest_intact(outdir)
        write_heartbeat(outdir, jax.process_index(), step, phase="lost-peer", lost=list(lost),
                        newest_checkpoint=newest)
        tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
        cut = "\n" if tqdm is not None and getattr(tqdm, "_instances", None) else ""  # a progress bar's line is open
        print(cut + peers.lost_line(lost, jax.process_count(), jax.process_index(), why, step, outdir, newest),
              file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

    return handler


def _evaluator(setup, outdir, factory=None):
    """The run's `train.eval.loss.Evaluator`, or None when `eval.table` is not set."""
    from jaxsora.train.eval import loss as eval_lib

    if not eval_lib.enabled(setup.config):
        return None
    data = factory(setup.config, setup, outdir) if factory is not None else None
    return eval_lib.build_evaluator(setup.config, setup, outdir, data=data)


def _initial_state(setup, loader, opts: RunOptions):
    """(state, wandb run id) for the resume mode; every array is created in its shards."""
    if opts.load:
        restored = restore(opts.load, setup.plan.abstract_sharded, step=opts.step)
        loader.restore(restored["data"], reset=opts.start_from_scratch)
        if is_main():
            print(f"[jaxsora] resumed {opts.load} at step {restored['step']}"
                  f"{' (data order restarted)' if opts.start_from_scratch else ''}")
        return restored["state"], restored["meta"].get("wandb_id")
    if opts.ckpt_path:
        return weights_only_state(setup, opts.ckpt_path), None
    return fresh_state(setup), None
