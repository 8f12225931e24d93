"""Everything a run needs before its first step, built from the config in one place: the mesh
and its rules, the frozen encoders, the STDiT3 config, the train-state plan (shapes and
shardings, nothing allocated), the jitted step and the data loader; and the initial state for
each resume mode, every array created directly in its shard.

Resume modes (the flags of Open-Sora 1.2's `scripts/train.py`):
- `--load DIR`: everything (params, EMA, optimizer, step, data position, RNG, wandb run) — an exact
  continuation; the loader refuses a changed table, bucket config, seed or data-parallel size
  unless `--start-from-scratch` (then the data order restarts, the rest continues).
- `--ckpt-path P`: weights only (a jaxsora checkpoint or an Open-Sora/PixArt-Σ .pth/.safetensors);
  fresh optimizer, schedule and data order.

LoRA (`lora.rank` > 0, `jaxsora.models.lora`): the plan's model carries adapters and only they are
trained. `--ckpt-path` then loads the base model as without LoRA (same paths) and initializes the
adapters — unless P is a LoRA run's checkpoint with the same rank, alpha and targets, whose adapters
are loaded too; a LoRA checkpoint is refused for any other run (its params are adapters only: merge
them first with `python -m jaxsora.tools.lora merge`). The base's source is recorded as `lora.base`
in the run config. Checkpoints hold the base in their `frozen/` item, so `--load` needs nothing else.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from jaxsora.errors import ConfigError
from jaxsora.models import lora as lora_lib
from jaxsora.models.config import STDiT3Config
from jaxsora.models.layers import resolve_attention_impl
from jaxsora.parallel import compile_options, targets
from jaxsora.parallel import mesh as mesh_lib
from jaxsora.train import build
from jaxsora.train.contracts import Loader
from jaxsora.train.step.optim import AdamW
from jaxsora.train.step.state import (
    StatePlan,
    TrainState,
    init_state_sharded,
    init_variables_sharded,
    model_variables,
    plan_state,
    state_from_weights,
    with_variables,
)
from jaxsora.train.step.train_step import TrainStep, batch_spec, make_train_step


def plain(cfg) -> dict:
    return json.loads(cfg.to_json_best_effort()) if hasattr(cfg, "to_json_best_effort") else dict(cfg)


@dataclasses.dataclass
class RunSetup:
    config: Any
    mesh: jax.sharding.Mesh
    rules: tuple
    encoders: build.Encoders
    model_config: STDiT3Config
    plan: StatePlan
    step: TrainStep

    @property
    def data_parallel_size(self) -> int:
        return mesh_lib.data_parallel_size(self.mesh)

    def batch_spec(self, size: tuple, global_batch: int) -> dict:
        """The step's abstract batch for a bucket of pixel size (T, H, W)."""
        return batch_spec(size, global_batch, self.encoders.text_spec(global_batch), self.mesh,
                          self.encoders.video_spec(global_batch, size))

    def tokens_per_sample(self, size: tuple) -> int:
        """Image tokens STDiT3 sees for a clip of pixel size (T, H, W)."""
        lt, lh, lw = self.encoders.latent_size(tuple(size))
        pt, ph, pw = self.model_config.patch_size
        return (-(-lt // pt)) * (-(-lh // ph)) * (-(-lw // pw))


# The fields of a run config that `setup_run` builds from: the mesh, the encoders, the STDiT3 config, the
# optimizer and schedule, the state plan and the step. The rest (outputs, lengths, logging, checkpointing, data
# order and loading, eval, wandb, sampling) never reaches the step; None: the whole section. The device memory
# and its share for remat are here too: with model.remat="auto" a step's executables are the remat the compile
# plan chose under them, which a run with another budget must not reuse.
STEP_FIELDS = {"mesh": None, "model": None, "optim": None, "scheduler": None, "mask_ratios": None, "lora": None,
               "vae": None, "text_encoder": None,
               "train": ("seed", "max_param_norm_growth", "device_memory_gib", "remat_memory_fraction", "target"),
               "data": ("features", "text_cache")}


def step_config(config) -> ml_collections.ConfigDict:
    """The `STEP_FIELDS` of `config`, as a locked config of their own. `setup_run` reads nothing else —
    reading any other field from it fails — so they are all a reused step depends on."""
    out = ml_collections.ConfigDict()
    for section, fields in STEP_FIELDS.items():
        if section not in config or config[section] is None:
            continue
        value = config[section]
        if fields is None:
            out[section] = ml_collections.ConfigDict(value.to_dict()) if hasattr(value, "to_dict") else value
        else:
            out[section] = ml_collections.ConfigDict({f: value[f] for f in fields if f in value})
    out.lock()
    return out


# Plans and steps built in this process, by `_step_key`: a second run in one process with the same step
# config, mesh and encoders (a notebook, a sweep, the test suite) reuses the traced plan and the compiled
# step instead of tracing, lowering and loading them again — seconds a run even for a tiny model. The
# newest few are kept.
_STEPS: collections.OrderedDict = collections.OrderedDict()
_STEPS_KEPT = 4


def _step_key(sc, mesh: jax.sharding.Mesh, rules, encoders: build.Encoders, abstract: bool) -> str | None:
    """What a plan and step are built from: the step config, the mesh's devices and axes, the logical rules,
    the encoders' shapes, and the jax options that tracing reads. None (never reused) when an encoder's
    architecture comes from files (a T5 folder, the OpenSora VAE), which the config does not describe."""
    vae_from_files = sc.vae.get("kind") != "identity"
    t5_from_files = not sc.data.get("text_cache") and sc.text_encoder.get("kind") != "tiny"
    if not sc.data.get("features") and (vae_from_files or t5_from_files):  # features: neither is built
        return None
    weights = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
               for p, x in jax.tree_util.tree_leaves_with_path(encoders.weights)]
    options = {name: str(getattr(jax.config, name, None)) for name in (
        "jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl", "jax_threefry_partitionable")}
    # the XLA options the step is jitted with ($JAXSORA_CPU_MATMUL, $JAXSORA_GPU_XLA): read when it is built
    options["compiler_options"] = repr(sorted((compile_options.of_mesh(mesh) or {}).items()))
    return json.dumps(dict(config=json.loads(sc.to_json_best_effort(sort_keys=True)), abstract=abstract,
                           devices=[int(d.id) for d in mesh.devices.flat], axes=list(mesh.axis_names),
                           shape=list(mesh.devices.shape), rules=repr(rules), weights=weights, options=options,
                           encoders=[encoders.in_channels, encoders.caption_channels, encoders.model_max_length,
                                     encoders.text_from_cache, encoders.latents_dtype]), sort_keys=True)


def with_platform_attention(mcfg: STDiT3Config, platform: str) -> STDiT3Config:
    """`attention_impl="auto"` resolved for the platform the step is compiled for (the mesh's: a `train.target`'s
    chips, not this machine's), by the layers' own rule (`resolve_attention_impl`): cuDNN for a GPU in bf16, XLA
    on a CPU. The config the run saves keeps "auto"."""
    if mcfg.attention_impl != "auto":
        return mcfg
    impl = resolve_attention_impl("auto", mcfg.compute_dtype, mcfg.head_dim, platform=platform)
    return mcfg.replace(attention_impl=impl or "xla")


def setup_run(config, *, abstract_encoders: bool = False) -> RunSetup:
    """Mesh → encoders → model config → state plan → jitted step. `abstract_encoders`: no encoder
    weights are read (the dry run and the batch-size search compile with their shapes). Everything is
    built from `step_config(config)`; the plan and step of an earlier run of this process with the same
    key (`_step_key`) are reused."""
    sc = step_config(config)
    target = sc.train.get("target") or ""
    if target and not abstract_encoders:
        raise ConfigError(f"train.target={target!r} plans for other chips: only a dry run or the batch-size search "
                          "compiles for it (--dry-run); unset it to train on this machine's devices")
    mesh = mesh_lib.make_mesh(sc.mesh, targets.devices(targets.parse(target)) if target else None)
    rules = mesh_lib.logical_rules(mesh)
    encoders = build.build_encoders(sc, mesh, rules, abstract=abstract_encoders)
    mcfg = build.build_model_config(sc.model, in_channels=encoders.in_channels,
                                    caption_channels=encoders.caption_channels,
                                    model_max_length=encoders.model_max_length)
    mcfg = with_platform_attention(mcfg, targets.platform_of(mesh))
    mesh_lib.check_sequence_parallel(mcfg.num_heads, mesh)
    if mesh_lib.sequence_parallel_size(mesh) > 1:
        mcfg = mcfg.replace(sequence_parallel_axis="sequence")
    lora = lora_lib.LoRASpec.from_config(sc.get("lora"))
    key = _step_key(sc, mesh, rules, encoders, abstract_encoders)
    if key is not None and key in _STEPS:
        _STEPS.move_to_end(key)
        plan, step = _STEPS[key]
    else:
        optimizer = AdamW.from_config(sc.optim)
        plan = plan_state(mcfg, optimizer.tx(), int(sc.train.seed), mesh, rules, lora=lora)
        step_fn = make_train_step(plan.graphdef, optimizer, encode_video=encoders.encode_video,
                                  encode_text=encoders.encode_text, scheduler_cfg=plain(sc.scheduler),
                                  mask_ratios=plain(sc.mask_ratios) or None, ema_decay=float(sc.optim.ema_decay),
                                  max_norm_growth=float(sc.train.max_param_norm_growth))
        step = TrainStep(step_fn, plan)
        if key is not None:
            _STEPS[key] = (plan, step)
            while len(_STEPS) > _STEPS_KEPT:
                _STEPS.popitem(last=False)
    if lora is not None and jax.process_index() == 0:
        n = sum(int(x.size) for x in jax.tree.leaves(plan.abstract.params))
        print(f"[jaxsora] LoRA rank {lora.rank} (scale {lora.scale:g}) on {len(lora_lib.check_targets(lora, mcfg))} "
              f"Linear layers: {n:,} trainable numbers; the base model is frozen", flush=True)
    return RunSetup(config, mesh, rules, encoders, mcfg, plan, step)


def default_loader(config, dp: int, text_inputs) -> Loader:
    """The grain video loader of `config.data` (see `jaxsora.data.loader`)."""
    from jaxsora.data.buckets import normalize_bucket_config
    from jaxsora.data.loader import VideoLoader

    dcfg = config.data
    buckets = normalize_bucket_config(plain(dcfg.bucket_config))
    if int(dcfg.batch_size_override) > 0:
        bs = int(dcfg.batch_size_override)
        buckets = {r: {f: (p, None if b is None else bs) for f, (p, b) in fr.items()} for r, fr in buckets.items()}
    # Every knob read as the config schema (configs/base.py) sets it: no second default here.
    common = dict(seed=int(dcfg.seed), data_parallel_size=dp, process_index=jax.process_index(),
                  process_count=jax.process_count(), num_workers=int(dcfg.num_workers),
                  decode_threads=int(dcfg.decode_threads), prefetch=int(dcfg.prefetch),
                  extra_resolutions=plain(dcfg.resolutions) or None)
    if dcfg.features:
        from jaxsora.data.features import FeatureLoader

        return FeatureLoader(dcfg.features, buckets, **common)
    return VideoLoader(dcfg.table, buckets, codec_threads=int(dcfg.codec_threads), index_dir=dcfg.index_dir or None,
                       frame_interval=int(dcfg.frame_interval), text_inputs=text_inputs, **common)


# --------------------------------------------------------------------------------------------
# the initial state
# --------------------------------------------------------------------------------------------
def weights_only_state(setup: RunSetup, path: str) -> TrainState:
    """`--ckpt-path`: weights read shard by shard into a fresh state (step 0, new optimizer, EMA =
    the weights). Open-Sora/PixArt files may lack parameters: only those are initialized."""
    from jaxsora.convert import sharded

    plan = setup.plan
    targets = model_variables(plan.abstract_sharded)
    wanted = targets
    if _lora_weights_source(setup, path) is None:  # LoRA adapters start fresh (none in the file)
        wanted = {p: t for p, t in targets.items() if not lora_lib.is_adapter_path(p)}
    if os.path.isdir(path):
        loaded = sharded.read_native_weights(path, wanted)
        print(f"[jaxsora] --ckpt-path: loaded weights from {path}")
    else:
        loaded, report = sharded.read_torch_weights(path, wanted, setup.model_config.model_max_length)
        print(f"[jaxsora] --ckpt-path {path}: {report.summary()}")
    values = {**init_variables_sharded(plan, set(targets) - set(loaded)), **loaded}
    return state_from_weights(plan, *with_variables(plan, values))


def _lora_weights_source(setup: RunSetup, path: str) -> lora_lib.LoRASpec | None:
    """The LoRA spec of a `--ckpt-path` jaxsora checkpoint whose adapters this run continues (same
    rank, alpha and adapted layers), else None. Refuses a LoRA checkpoint the run cannot take
    (its params are adapters, its base model is in frozen/: read plainly, the adapters would be
    dropped without a word). With LoRA on, records the source as `lora.base` in the run config."""
    run = setup.plan.lora
    source = None
    if os.path.isdir(path):
        from jaxsora.checkpoint.layout import read_config, resolve_step_dir

        source = lora_lib.LoRASpec.from_config(read_config(resolve_step_dir(path)).get("lora"))
    if run is not None and "lora" in setup.config:
        with setup.config.unlocked():
            setup.config.lora.base = os.path.abspath(path)
    if source is None:
        return None
    mcfg = setup.model_config
    same = (run is not None and (run.rank, run.alpha) == (source.rank, source.alpha)
            and lora_lib.check_targets(run, mcfg) == lora_lib.check_targets(source, mcfg))
    if not same:
        have = f"rank {source.rank}, alpha {source.alpha:g}, targets {','.join(source.targets)}"
        want = "no LoRA" if run is None else f"rank {run.rank}, alpha {run.alpha:g}, targets {','.join(run.targets)}"
        raise lora_lib.LoRAError(
            f"--ckpt-path {path} is a LoRA checkpoint ({have}) and this run has {want}: merge its adapters into "
            f"the base first (python -m jaxsora.tools.lora merge --ckpt-path {path} --output DIR) and start from "
            f"DIR, or use the same lora settings to go on training these adapters")
    return source


def fresh_state(setup: RunSetup) -> TrainState:
    """A newly initialized state, computed in its shards."""
    return init_state_sharded(setup.plan)
