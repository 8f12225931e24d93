"""`python -m jaxsora.train --config configs/stage1.py [--config.key=value ...] [flags]`

The config is a jaxsora config file (`get_config()`) or an Open-Sora 1.2 train config as it is
(`python -m jaxsora.train configs/opensora-v1-2/train/stage1.py --data-path X.csv`: every key mapped,
the ones meaningless here reported once, an unknown one refused; see `jaxsora.opensora_config`).

Flags (the reference's names): --data-path X.csv, --load DIR (resume everything; DIR is a run
folder, its checkpoints/ folder, one step folder or an experiment number — `--load 656` is the
folder `<outputs>/656-*`; the run goes on writing into the loaded run's folder), --step N (with
--load: that step instead of the newest intact one), --ckpt-path PATH (weights only: a jaxsora
checkpoint or an Open-Sora/PixArt-Σ .pth/.safetensors), --start-from-scratch (with --load: keep
optimizer and schedule, restart the data order), --outputs DIR (a new run gets the folder
`<outputs>/<NNN>-<experiment>`, NNN the next free experiment number), --run-dir DIR (exactly this
run folder, unnumbered; refused if it holds a run already, unless --load resumes that run),
--dry-run (validate config, table and bucket plan; compile the step per bucket and print the plan
and per-device memory; train nothing), --target h100x8 (with --dry-run: the plan for other chips, compiled here by
their own compiler; `jaxsora.parallel.targets`), --profile START:STOP (a jax.profiler trace), --debug
(tracebacks for user errors too).
Multi-host: see docs/training/clusters.md (jax.distributed from SLURM / JAX_* variables / --coordinator flags).

A mistake in what was given (flag, config key or value, path, table, checkpoint, mesh, missing
optional dependency) is one line on stderr and exit code 2 (`jaxsora.errors`).
"""
import sys

from jaxsora.cli import config_app
from jaxsora.errors import EXIT_NONFINITE, EXIT_STOPPED

PROG = "jaxsora.train"
# Exit codes: 0 done, 1 an internal error (traceback), 2 a user error (one line), 3 and 75: see
# jaxsora.errors (EXIT_NONFINITE, EXIT_STOPPED).


def _define_flags():
    from absl import flags

    flags.DEFINE_string("data_path", None, "dataset table (CSV/parquet); overrides data.table")
    flags.DEFINE_string("load", None, "resume everything from this run / checkpoints / step folder, or an "
                        "experiment number (656: <outputs>/656-*)")
    flags.DEFINE_integer("step", None, "with --load: resume from this step (default: the newest intact one)")
    flags.DEFINE_string("ckpt_path", None, "initial weights only (jaxsora checkpoint or PyTorch file)")
    flags.DEFINE_bool("start_from_scratch", False, "with --load: restart the data order, keep the optimizer")
    flags.DEFINE_string("outputs", None, "outputs folder; overrides train.outputs")
    flags.DEFINE_string("run_dir", None, "exactly this run folder instead of a new <outputs>/<NNN>-<experiment>")
    flags.DEFINE_bool("dry_run", False, "validate, compile every bucket and print the plan and memory; no training")
    flags.DEFINE_string("target", None, "with --dry-run: plan for these chips, compiled here by their own compiler "
                        "(h100x8, h200x8, a100-80gx8, tpu-v5p:2x2x2, tpu-v5e:4x4, tpu-v6e:2x4); sets train.target")
    flags.DEFINE_string("profile", None, "START:STOP — write a jax.profiler trace of those steps to <run>/profile")
    flags.DEFINE_string("coordinator", None, "multi-host: coordinator address host:port")
    flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
    flags.DEFINE_integer("process_id", None, "multi-host: this process's id")


def _body() -> int:
    from absl import flags

    FLAGS = flags.FLAGS
    # The checks that need no jax (config, flags, paths, the table's files), first: such a mistake is answered
    # before jax is imported (train() runs them again with the rest of validate_config).
    from jaxsora.train.plan.validate import check_before_jax

    if FLAGS.target is not None:
        FLAGS.config.train.target = FLAGS.target
    if FLAGS.dry_run:  # what the run would be, before anything is checked (a user's first look at a config)
        from jaxsora.config import format_config

        print(f"resolved config:\n{format_config(FLAGS.config)}", flush=True)
    check_before_jax(FLAGS.config, FLAGS)
    from jaxsora.parallel.distributed import initialize
    from jaxsora.train.run import agent

    # a multi-process run's trainer gets a parent that reports its end, however it ends (the parent never returns)
    initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id, before_connect=agent.start)
    from jaxsora.train.run.loop import NonFiniteError, RunOptions, train

    opts = RunOptions(data_path=FLAGS.data_path, load=FLAGS.load, step=FLAGS.step, ckpt_path=FLAGS.ckpt_path,
                      start_from_scratch=FLAGS.start_from_scratch, outputs=FLAGS.outputs, run_dir=FLAGS.run_dir,
                      dry_run=FLAGS.dry_run, profile=FLAGS.profile)
    try:
        summary = train(FLAGS.config, opts)
    except NonFiniteError as e:  # the run's own verdict, not a bug: one line
        print(f"[jaxsora] stopped: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except BaseException as e:
        from jaxsora.errors import debug_requested
        from jaxsora.parallel import peers

        if peers.is_failing():  # this process's own error in a multi-process run: its peers stop, naming it
            peers.leave(PROG, e, debug=debug_requested(sys.argv))  # not through jax's exit-time shutdown
        raise
    if opts.dry_run:
        return 0
    if summary.get("stopped_by_signal"):
        print(f"[jaxsora] stopped by a signal at step {summary['steps']}; checkpoint in {summary['checkpoints']} "
              f"(continue with --load {summary['outputs']})", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    print(f"[jaxsora] done: {summary['steps']} steps, checkpoints in {summary['checkpoints']}")
    return 0


def main():
    config_app(PROG, _define_flags, _body, dashed=("--data-path", "--ckpt-path", "--start-from-scratch", "--dry-run",
                                                   "--run-dir", "--num-processes", "--process-id"))


if __name__ == "__main__":
    main()
