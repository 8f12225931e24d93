"""Checks a run config before any work starts, naming what is wrong.

`ml_collections` already refuses unknown keys and wrong types in `--config.a.b=value` overrides
(the config is locked); this adds the checks that need to look outside the config: files that
must exist, mesh sizes, schedules, mask ratios and the bucket table.
"""
from __future__ import annotations

import os
import sys

from jaxsora.data import text_length
from jaxsora.errors import ConfigError
from jaxsora.parallel import compile_options, targets
from jaxsora.train.plan.ranges import check_ranges


def _need_file(path, what):
    if not path:
        raise ConfigError(f"{what} is not set")
    if not os.path.exists(path):
        raise ConfigError(f"{what}: no such file or folder: {path}")


def need_table(table, what):
    """A table file, folder, glob of shards or fsspec URL with at least one table file."""
    if not table:
        raise ConfigError(f"{what} is not set")
    from jaxsora.data.tables import TableError, table_files

    try:
        table_files(str(table))
    except TableError as e:
        raise ConfigError(f"{what}: {e}") from None


def profile_range(spec: str | None) -> tuple[int, int] | None:
    """--profile START:STOP → (START, STOP); None when not given."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        raise ConfigError(f"--profile expects START:STOP step numbers with START < STOP, got {spec!r}")
    return a, b


def _check_wandb_mode(config) -> None:
    wcfg = config.get("wandb") or {}
    if wcfg.get("enabled", False) and wcfg.get("mode", "online") not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode must be online, offline or disabled, got {wcfg.get('mode')!r}")


def _check_paths_exist(config, opts) -> None:
    """--load and --ckpt-path name something on disk, or --load an experiment number of the outputs folder."""
    for flag, path in (("--load", opts.load), ("--ckpt-path", opts.ckpt_path)):
        if not path or os.path.exists(path):
            continue
        if flag != "--load" or not str(path).isdigit():
            raise ConfigError(f"{flag}: no such file or folder: {path}")
        from jaxsora.runs import find_run

        find_run(path, getattr(opts, "outputs", None) or config.train.outputs, what="--load")  # or its error


def check_before_jax(config, opts) -> None:
    """What the config, the flags and the table files alone show wrong: ranges, contradicting flags, --profile,
    the wandb mode, the --load/--ckpt-path paths, the table's files, columns and rows (not in a dry run: it reports
    an empty plan). The trainer's command line runs them before importing jax (an answer in about a second);
    `train()` runs them again (`validate_config`; `check_table` remembers a table it has read)."""
    check_ranges(config)
    check_run_flags(opts)
    _check_local_folder("train.outputs", config.train.outputs)
    check_target(config, opts)
    compile_options.check_env()  # $JAXSORA_CPU_MATMUL, $JAXSORA_GPU_XLA
    profile_range(opts.profile)
    _check_wandb_mode(config)
    _check_paths_exist(config, opts)
    if not config.data.get("features"):
        table = opts.data_path or config.data.get("table")
        need_table(table, "data.table (--data-path)")
        if not opts.dry_run:
            from jaxsora.data.tables import check_table

            check_table(table)


def check_target(config, opts=None):
    """`train.target` (--target): a known target (`jaxsora.parallel.targets.parse`), and only for a dry run (nothing
    runs on a target's devices). The target, or None."""
    spec = config.train.get("target") or ""
    if not spec:
        return None
    target = targets.parse(spec)
    if opts is not None and not opts.dry_run:
        raise ConfigError(f"--target {spec} compiles for chips this machine does not have: add --dry-run (the plan of "
                          "every bucket), or use python -m jaxsora.tools.search_bs --target (the batch sizes)")
    return target


def check_run_flags(opts) -> None:
    """The run flags that contradict each other (`RunOptions`, or the command line's flags: no file is read)."""
    if getattr(opts, "step", None) is not None and not opts.load:
        raise ConfigError("--step N picks the checkpoint step of --load DIR; give --load too")
    if opts.load and opts.ckpt_path:
        raise ConfigError("give either --load (resume everything) or --ckpt-path (weights only), not both")
    if opts.start_from_scratch and not opts.load:
        raise ConfigError("--start-from-scratch only makes sense with --load DIR")
    _check_local_folder("--run-dir", getattr(opts, "run_dir", None))
    _check_local_folder("--outputs", getattr(opts, "outputs", None))


def _check_local_folder(what: str, path) -> None:
    """The run folder is written with plain file calls (metrics, heartbeats, checkpoints' index): a URL such as
    gs://bucket/runs would become a local folder named `gs:` under the working directory. One line instead."""
    path = str(path or "")
    if "://" in path and not path.startswith("file://"):
        raise ConfigError(f"{what} {path}: the run folder must be on a mounted filesystem, not a URL (mount the "
                          f"bucket, e.g. with gcsfuse or s3fs, and give its local path)")


def _check_features(config) -> None:
    """`data.features`: a finished feature cache, and no setting that needs the raw videos."""
    from jaxsora.data.features import FeatureStore

    _need_file(config.data.features, "data.features")
    if config.data.get("text_cache"):
        raise ConfigError("data.features already holds the text states: unset data.text_cache")
    if "eval" in config and config.eval.get("table"):
        raise ConfigError("eval.table is raw video, which a data.features run cannot encode (it loads no VAE or T5): "
                          "unset eval.table, or evaluate the checkpoints in a run without data.features")
    FeatureStore(config.data.features)  # complete and readable (FeatureCacheError names what is not)


def validate_config(config, opts=None) -> None:
    """Raise ConfigError naming the first problem."""
    for group in ("model", "vae", "text_encoder", "data", "scheduler", "optim", "mesh", "train"):
        if group not in config:
            raise ConfigError(f"config has no '{group}' group")
    check_ranges(config)
    try:
        text_length.check_lengths(config.data.get("text_lengths", ()))
    except ValueError as e:
        raise ConfigError(str(e)) from None

    features = config.data.get("features")
    if features:
        _check_features(config)
    else:
        need_table(config.data.get("table"), "data.table (--data-path)")
    dry = bool(opts is not None and opts.dry_run)
    for group, kind in (("vae", "opensora"), ("text_encoder", "t5")):
        if config[group].get("kind") == kind and not features:  # a features run loads neither
            try:
                _need_file(config[group].get("path"), f"{group}.path")
            except ConfigError as e:
                if not dry:
                    raise
                print(f"[jaxsora] dry run: {e} (needed to train)", file=sys.stderr)
    if opts is not None:
        check_run_flags(opts)
        _check_paths_exist(config, opts)
        _check_sources(opts)

    for axis in ("data", "fsdp", "sequence"):
        v = config.mesh.get(axis, 1)
        if not isinstance(v, int) or (v < 1 and v != -1):
            raise ConfigError(f"mesh.{axis} must be a positive int or -1, got {v!r}")
    import jax

    from jaxsora.parallel.mesh import MeshError, mesh_shape

    target = check_target(config, opts)
    try:
        mesh_shape(config.mesh, target.num_devices if target else jax.device_count())
    except MeshError as e:
        raise ConfigError(str(e)) from e

    from jaxsora.train.step.optim import lr_schedule

    try:
        lr_schedule(config.optim)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"optim: {e}") from e

    betas = tuple(config.optim.get("betas", (0.9, 0.999)))
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {betas!r}")
    _check_wandb_mode(config)
    wcfg = config.get("wandb")
    if wcfg is not None and wcfg.get("enabled", False):
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            from jaxsora.errors import MissingDependency

            raise MissingDependency("wandb.enabled is set but wandb is not installed: pip install 'jaxsora[wandb]' "
                                    "(or --config.wandb.enabled=False)") from e

    from jaxsora.diffusion.masks import MaskGenerator

    ratios = config.get("mask_ratios")
    if ratios:
        try:
            MaskGenerator(dict(ratios))
        except ValueError as e:
            raise ConfigError(f"mask_ratios: {e}") from e
    method = config.scheduler.get("sample_method", "logit-normal")
    if method not in ("uniform", "logit-normal"):
        raise ConfigError(f"scheduler.sample_method must be uniform or logit-normal, got {method!r}")

    from jaxsora.models.presets import available

    if config.model.get("name") not in available():
        raise ConfigError(f"model.name {config.model.get('name')!r} is not a preset; available: {available()}")
    from jaxsora.train.build import build_model_config

    try:  # every model field (remat policy, remat_blocks, ...); the encoders fix the channel counts later
        build_model_config(config.model, in_channels=4, caption_channels=64, model_max_length=8)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model: {e}") from e

    _check_model_shape(config, opts)
    _check_lora(config, opts)
    load_bucket_config_file(config)
    from jaxsora.data import buckets

    try:
        extra = config.data.get("resolutions") or None
        extra = extra.to_dict() if hasattr(extra, "to_dict") else extra
        buckets.validate_bucket_config(config.data.bucket_config, extra)
    except ValueError as e:
        raise ConfigError(f"data.bucket_config: {e}") from e


def _check_lora(config, opts=None) -> None:
    """The `lora` group: an integer rank, dropout < 1, and targets that select Linear layers of the
    configured model (checked on its abstract module tree; nothing is allocated). With --load: the
    same adapters as the checkpoint's (rank, alpha, adapted layers), and its `lora.base` record."""
    group = config.get("lora")
    rank = group.get("rank", 0) if group is not None else 0
    if rank and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ConfigError(f"lora.rank must be an integer, got {rank!r}")
    from jaxsora.models import lora
    from jaxsora.train.build import build_model_config

    mcfg = build_model_config(config.model, in_channels=4, caption_channels=64, model_max_length=8)
    try:
        spec = lora.LoRASpec.from_config(group)
        if spec is not None:
            lora.check_targets(spec, mcfg)
    except lora.LoRAError as e:
        raise ConfigError(str(e)) from None
    if opts is None or not getattr(opts, "load", None):
        return
    saved = _checkpoint_config(opts.load, getattr(opts, "step", None))
    if saved is None:
        return
    saved = dict(saved.get("lora") or {})
    old = None
    try:
        old = lora.LoRASpec.from_config(saved)
        same = (spec is None) == (old is None) and (spec is None or (
            (spec.rank, spec.alpha) == (old.rank, old.alpha)
            and lora.check_targets(spec, mcfg) == lora.check_targets(old, mcfg)))
    except lora.LoRAError:
        same = False
    if not same:
        def show(s):
            return "no LoRA" if s is None else f"lora rank {s.rank}, alpha {s.alpha:g}, targets {','.join(s.targets)}"
        raise ConfigError(f"--load {opts.load}: the checkpoint was trained with {show(old)} but the config has "
                          f"{show(spec)}; resume with the checkpoint's lora settings")
    if spec is not None and "base" in group and not group.base and saved.get("base"):
        group.base = saved["base"]  # keep the record of where the base came from across resumes


def _checkpoint_config(load, step) -> dict | None:
    """The run config stored with the step --load resumes from (the newest one with a config item, or
    `step`); None when it cannot be read (restore reports that)."""
    import json

    from jaxsora.checkpoint import CheckpointError, checkpoint_steps, resolve_checkpoint

    try:
        root, named = resolve_checkpoint(load, step)
    except CheckpointError:
        return None
    for s in ([named] if named is not None else checkpoint_steps(root)[::-1]):
        try:
            with open(os.path.join(root, str(s), "config", "metadata")) as f:
                stored = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(stored, dict):
            return stored
    return None


# The STDiT3 fields that shape the parameters (the channel counts follow the encoders, checked apart).
_SHAPE_FIELDS = ("depth", "hidden_size", "num_heads", "mlp_ratio", "patch_size")


def _check_model_shape(config, opts=None) -> None:
    """--load: the config's model has the checkpoint's shape. A changed `model.name` or
    `--config.model.depth` would otherwise meet the checkpoint only at restore, after the compile, where
    every step reads as unreadable."""
    if opts is None or not getattr(opts, "load", None):
        return
    saved = _checkpoint_config(opts.load, getattr(opts, "step", None))
    model = (saved or {}).get("model")
    if not isinstance(model, dict):
        return
    from jaxsora.train.build import build_model_config

    mcfg = build_model_config(config.model, in_channels=4, caption_channels=64, model_max_length=8)

    def plain(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    changed = [f"{k}: {plain(model[k])} in the checkpoint, {plain(getattr(mcfg, k))} in the config"
               for k in _SHAPE_FIELDS if k in model and plain(model[k]) != plain(getattr(mcfg, k))]
    if changed:
        raise ConfigError(f"--load {opts.load}: the checkpoint's model has another shape than the config's "
                          f"({'; '.join(changed)}); resume with the checkpoint's model settings")


def _check_sources(opts) -> None:
    """--load / --ckpt-path point at something of the right kind (before anything compiles)."""
    if opts.load:
        from jaxsora.checkpoint import check_resumable

        check_resumable(opts.load, getattr(opts, "step", None))  # resolves the path; no opt_state → one line
    if opts.ckpt_path and os.path.isfile(opts.ckpt_path):
        from jaxsora.io.weights import WEIGHT_EXTS

        if not opts.ckpt_path.endswith(WEIGHT_EXTS):
            raise ConfigError(f"--ckpt-path {opts.ckpt_path}: unknown weights format (expected a jaxsora checkpoint "
                              f"folder or one of {', '.join(WEIGHT_EXTS)})")
    elif opts.ckpt_path:
        from jaxsora.checkpoint.layout import resolve_step_dir

        resolve_step_dir(opts.ckpt_path)


def load_bucket_config_file(config) -> None:
    """`data.bucket_config_file` (a JSON file, e.g. from `python -m jaxsora.tools.search_bs`)
    replaces `data.bucket_config`."""
    path = config.data.get("bucket_config_file")
    if not path:
        return
    import json

    import ml_collections

    _need_file(path, "data.bucket_config_file")
    try:
        with open(path) as f:
            loaded = json.load(f)
    except ValueError as e:
        raise ConfigError(f"data.bucket_config_file {path}: not JSON ({e})") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"data.bucket_config_file {path}: expected {{resolution: {{frames: [keep_prob, batch]}}}}")
    with config.unlocked():
        config.data.bucket_config = ml_collections.ConfigDict(loaded)
