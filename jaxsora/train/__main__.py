"""`python -m jaxsora.train --config configs/stage1.py [--config.key=value ...] [flags]`

Flags (the reference's names): --data-path X.csv, --load DIR (resume everything),
--ckpt-path PATH (weights only: a jaxsora checkpoint or an Open-Sora/PixArt-Σ .pth/.safetensors),
--start-from-scratch (with --load: keep optimizer and schedule, restart the data order),
--outputs DIR, --dry-run (validate config, table and bucket plan; compile the step per bucket and print
the plan and per-device memory; train nothing), --profile START:STOP (a jax.profiler trace).
Multi-host: see BUILD.md (jax.distributed from SLURM / JAX_* variables / --coordinator flags).
"""
import os
import sys


def _config_root_on_path(argv):
    """Config files import `configs.base`: put the folder holding `configs/` on sys.path. A config
    file that does not exist is a one-line error (exit 2), not ml_collections' traceback."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        else:
            path = None
        if path:
            if not os.path.isfile(path.split(":")[0]):
                print(f"config error: no such config file: {path.split(':')[0]}", file=sys.stderr)
                sys.exit(2)
            root = os.path.dirname(os.path.dirname(os.path.abspath(path.split(":")[0])))
            if root not in sys.path:
                sys.path.insert(0, root)


def main():
    _config_root_on_path(sys.argv)
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "config file (get_config() → ConfigDict)", lock_config=True)
    flags.DEFINE_string("data_path", None, "dataset table (CSV/parquet); overrides data.table")
    flags.DEFINE_string("load", None, "resume everything from this checkpoint folder")
    flags.DEFINE_string("ckpt_path", None, "initial weights only (jaxsora checkpoint or PyTorch file)")
    flags.DEFINE_bool("start_from_scratch", False, "with --load: restart the data order, keep the optimizer")
    flags.DEFINE_string("outputs", None, "outputs folder; overrides train.outputs")
    flags.DEFINE_bool("dry_run", False, "validate, compile every bucket and print the plan and memory; no training")
    flags.DEFINE_string("profile", None, "START:STOP — write a jax.profiler trace of those steps to <run>/profile")
    flags.DEFINE_string("coordinator", None, "multi-host: coordinator address host:port")
    flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
    flags.DEFINE_integer("process_id", None, "multi-host: this process's id")
    # The reference spells these with dashes.
    argv = [a.replace("--data-path", "--data_path").replace("--ckpt-path", "--ckpt_path")
            .replace("--start-from-scratch", "--start_from_scratch").replace("--dry-run", "--dry_run")
            .replace("--num-processes", "--num_processes").replace("--process-id", "--process_id")
            for a in sys.argv]

    def run(_):
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO
        FLAGS = flags.FLAGS
        if FLAGS.config is None:
            raise app.UsageError("--config is required, e.g. --config configs/stage1.py")
        from jaxsora.parallel.distributed import initialize

        initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
        from jaxsora.config import ConfigError
        from jaxsora.parallel.mesh import MeshError
        from jaxsora.train.loop import RunOptions, train
        from jaxsora.train.memory import MemoryPlanError

        opts = RunOptions(data_path=FLAGS.data_path, load=FLAGS.load, ckpt_path=FLAGS.ckpt_path,
                          start_from_scratch=FLAGS.start_from_scratch, outputs=FLAGS.outputs, dry_run=FLAGS.dry_run,
                          profile=FLAGS.profile)
        try:
            summary = train(FLAGS.config, opts)
        except (ConfigError, MeshError) as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        except MemoryPlanError as e:
            print(f"memory: {e}", file=sys.stderr)
            return 2
        if not opts.dry_run:
            print(f"[jaxsora] done: {summary['steps']} steps, checkpoints in {summary['checkpoints']}")
        return 0

    app.run(lambda a: sys.exit(run(a)), argv=argv)


if __name__ == "__main__":
    main()
