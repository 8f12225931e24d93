"""The training loop behind `python -m jaxsora.train` (see `jaxsora/train/__main__.py`).

Flow per run: build the mesh, the encoders, STDiT3 (initialized directly into its shardings), the
optimizer and the data loader → restore according to the resume mode → for each step: host
batch → global arrays → jitted step → metrics, checkpoints, safety checks.

Resume modes (the reference's flags, spec §6):
- `--load DIR`: everything (params, EMA, optimizer, step, data position, RNG, wandb run): an exact
  continuation. The data position is refused if the table, bucket config, seed or data-parallel
  size changed (the loader names what), unless `--start-from-scratch`.
- `--load DIR --start-from-scratch`: params, EMA, optimizer and schedule go on; data restarts.
- `--ckpt-path P`: weights only (a jaxsora checkpoint or an Open-Sora/PixArt-Σ .pth/.safetensors);
  fresh optimizer, schedule and data order.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxsora.models.stdit3 import STDiT3, param_count
from jaxsora.parallel.constraints import logical_rules, logical_to_spec
from jaxsora.train import build
from jaxsora.train.checkpoint import Checkpointer, restore
from jaxsora.train.optim import lr_schedule, make_optimizer
from jaxsora.train.step import TrainState, init_state, make_train_step

log = logging.getLogger("jaxsora.train")


class NonFiniteError(RuntimeError):
    pass


@dataclasses.dataclass
class RunOptions:
    data_path: Optional[str] = None
    load: Optional[str] = None
    ckpt_path: Optional[str] = None
    start_from_scratch: bool = False
    outputs: Optional[str] = None
    dry_run: bool = False


# ---------------------------------------------------------------------------------------------
# mesh and shardings
# ---------------------------------------------------------------------------------------------
MESH_AXES = ("data", "fsdp", "sequence")


def make_mesh(mesh_cfg) -> jax.sharding.Mesh:
    """Mesh (data, fsdp, sequence) from the config; one -1 entry takes the remaining devices.
    Without a -1 the mesh may use fewer devices than there are (the first ones)."""
    n = jax.device_count()
    shape = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
    if shape.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, shape))}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if n % known:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} does not divide {n} devices")
        shape[shape.index(-1)] = n // known
    if math.prod(shape) > n:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, there are {n}")
    devices = jax.devices()[: math.prod(shape)] if math.prod(shape) < n else None
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def logical_rules_for(mesh_cfg) -> tuple:
    """Logical → mesh axes. Batch over data×fsdp, parameters' `embed` dim FSDP-sharded (ZeRO-style:
    params, grads, EMA and Adam moments all sharded), image tokens over `sequence` (Ulysses)."""
    seq = "sequence" if int(mesh_cfg.get("sequence", 1)) != 1 else None
    return (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("seq", seq), ("frames", None), ("heads", None),
            ("mlp", None), ("adaln", None), ("caption", None), ("vocab", None))


def state_shardings(abstract_tree, mesh, rules):
    """NamedShardings for a tree of nnx Variables from their logical `out_sharding` names; a dim that
    does not divide its mesh axes stays replicated."""
    def one(x):
        names = None
        if isinstance(x, nnx.Variable):
            names = x.get_metadata().get("out_sharding")
            shape = x.shape if hasattr(x, "shape") else x[...].shape
        else:
            shape = x.shape
        if not names:
            return NamedSharding(mesh, PartitionSpec())
        spec = logical_to_spec(tuple(names), rules)
        fixed = []
        for dim, axes in zip(shape, spec):
            size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else (axes or ())))
            fixed.append(axes if axes is not None and dim % size == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*fixed))

    return jax.tree.map(one, abstract_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
class Watchdog:
    """Dumps every thread's stack (faulthandler) when a step takes far longer than usual — the
    reference's silent loader freezes. Never kills the run."""

    def __init__(self, factor: float, min_seconds: float):
        self.factor, self.min_seconds = factor, min_seconds
        self.times: list[float] = []
        self._deadline = None
        self._stop = threading.Event()
        self.dumps = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxsora-watchdog")
        self._thread.start()

    def begin(self):
        typical = float(np.median(self.times[-50:])) if len(self.times) >= 3 else None
        limit = max(self.min_seconds, self.factor * typical) if typical else None
        self._deadline = (time.monotonic() + limit) if limit else None
        self._start = time.monotonic()

    def end(self):
        self.times.append(time.monotonic() - self._start)
        self._deadline = None

    def _run(self):
        while not self._stop.wait(1.0):
            d = self._deadline
            if d is not None and time.monotonic() > d:
                self.dumps += 1
                print(f"[watchdog] step running for {time.monotonic() - self._start:.0f}s "
                      f"(median {np.median(self.times[-50:]):.2f}s); stacks of every thread:", file=sys.stderr)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self._deadline = None

    def stop(self):
        self._stop.set()


class StopRequested:
    """SIGTERM/SIGINT → finish the current step, checkpoint, exit cleanly."""

    def __init__(self):
        self.flag = False
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame):
        if self.flag:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.flag = True
        print(f"\n[jaxsora] got signal {signum}: saving a checkpoint after this step, then exiting",
              file=sys.stderr)

    def restore(self):
        for sig, h in self._old.items():
            signal.signal(sig, h)


def _plain(cfg) -> dict:
    return json.loads(cfg.to_json_best_effort()) if hasattr(cfg, "to_json_best_effort") else dict(cfg)


def _is_main() -> bool:
    return jax.process_index() == 0


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def train(config, opts: RunOptions, *, loader_factory=None) -> dict:
    """Run training; returns a summary dict (steps, last loss, checkpoint folder)."""
    from jaxsora.config import validate_config

    if opts.data_path:
        config.data.table = opts.data_path
    if opts.outputs:
        config.train.outputs = opts.outputs
    validate_config(config, opts)
    tcfg = config.train
    outdir = os.path.abspath(os.path.join(tcfg.outputs, tcfg.get("experiment", "run")))
    os.makedirs(outdir, exist_ok=True)
    # The persistent compilation cache: shared by every experiment under the outputs folder, unless
    # one is already set (JAX_COMPILATION_CACHE_DIR).
    if tcfg.get("compilation_cache", True) and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.abspath(tcfg.outputs), "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    mesh = make_mesh(config.mesh)
    rules = logical_rules_for(config.mesh)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]

    # Precomputed text states (python -m data_tools.precompute) replace running T5 in the step.
    text_cache = None
    if config.data.get("text_cache"):
        from jaxsora.data.cache import TextStateCache

        text_cache = TextStateCache(config.data.text_cache)
    if opts.dry_run:  # no encoder weights are loaded: their sizes come from the config
        text_encoder = vae = None
        in_ch, cap_ch, max_len = build.encoder_dims(config)
    else:
        vae = build.build_vae_from_config(config.vae)
        in_ch = vae.out_channels
        if text_cache is not None:
            text_encoder = None
            cap_ch, max_len = text_cache.caption_channels, text_cache.model_max_length
        else:
            text_encoder = build.build_text_encoder_from_config(config.text_encoder, mesh=mesh, rules=rules)
            cap_ch, max_len = text_encoder.caption_channels, text_encoder.model_max_length
    if text_cache is not None:
        cap_ch, max_len = text_cache.caption_channels, text_cache.model_max_length
    mcfg = build.build_model_config(config.model, in_channels=in_ch, caption_channels=cap_ch, model_max_length=max_len)
    if int(config.mesh.get("sequence", 1)) != 1:
        mcfg = mcfg.replace(sequence_parallel_axis="sequence")

    loader = (loader_factory or _default_loader)(config, dp)
    tx = make_optimizer(config.optim)
    lr_fn = lr_schedule(config.optim)

    # Abstract model → shardings → initialize directly into them (no full copy on one device).
    seed = int(tcfg.seed)
    abstract_model = nnx.eval_shape(lambda: STDiT3(mcfg, rngs=nnx.Rngs(seed)))
    if opts.dry_run:
        return _dry_run(config, mcfg, loader, abstract_model, mesh, outdir)
    graphdef = nnx.split(abstract_model, _trainable(mcfg), ...)[0]
    abstract_state = jax.eval_shape(lambda: init_state(STDiT3(mcfg, rngs=nnx.Rngs(seed)), tx, seed)[1])
    shardings = _train_state_shardings(abstract_model, abstract_state, tx, mesh, rules)

    def _init():
        return init_state(STDiT3(mcfg, rngs=nnx.Rngs(seed)), tx, seed)[1]

    with jax.set_mesh(mesh):
        state = jax.jit(_init, out_shardings=shardings)()

    ckpt = Checkpointer(os.path.join(outdir, "checkpoints"), keep=int(tcfg.get("keep_ckpts", 3)),
                        async_save=bool(tcfg.get("async_checkpoint", True)))
    wandb_id = None
    if opts.ckpt_path:
        state = _load_weights_only(state, opts.ckpt_path, mcfg, shardings, tx)
    if opts.load:
        restored = restore(opts.load, abstract_state, shardings)
        state = restored["state"]
        wandb_id = restored["meta"].get("wandb_id")
        if opts.start_from_scratch:
            loader.restore(restored["data"], reset=True)
        else:
            loader.restore(restored["data"])
        if _is_main():
            print(f"[jaxsora] resumed {opts.load} at step {restored['step']}"
                  f"{' (data order restarted)' if opts.start_from_scratch else ''}")

    encoders, encode_video, encode_text = _encoders(vae, text_encoder)
    step_fn = make_train_step(graphdef, tx, encode_video=encode_video, encode_text=encode_text,
                              scheduler_cfg=_plain(config.scheduler), mask_ratios=_plain(config.mask_ratios) or None,
                              ema_decay=float(config.optim.ema_decay), lr_fn=lr_fn)

    def _step(state, batch, encoders):
        with logical_rules(rules):
            return step_fn(state, batch, encoders)

    jit_step = jax.jit(_step, donate_argnums=(0,), out_shardings=(shardings, None))
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    from jaxsora.train.logging import MetricLogger

    run_config = _plain(config)
    run_config["model"] = {**run_config.get("model", {}), **mcfg.to_dict()}
    logger = MetricLogger(config, outdir, resume_id=wandb_id, enabled=_is_main())
    stop = StopRequested()
    watchdog = Watchdog(float(tcfg.get("watchdog_factor", 10.0)), float(tcfg.get("watchdog_min_seconds", 120.0)))
    max_steps = int(tcfg.max_steps)
    ckpt_every = int(tcfg.ckpt_every)
    max_bad = int(tcfg.get("max_nonfinite_steps", 5))
    bad_in_row = nonfinite_total = 0
    last_good_ckpt = None
    step = int(jax.device_get(state.step))
    last_loss = None

    def save(force=False):
        nonlocal last_good_ckpt
        meta = dict(wandb_id=logger.run_id, jaxsora=_version(), mesh=dict(mesh.shape),
                    processes=jax.process_count(), time=time.time())
        if ckpt.save(int(jax.device_get(state.step)), state, config=run_config, data=loader.state(), meta=meta,
                     force=force):
            last_good_ckpt = os.path.join(ckpt.directory, str(int(jax.device_get(state.step))))

    if not opts.load:
        save(force=True)  # the Lambda fork's "save at start"
    it = iter(loader)
    try:
        while step < max_steps and not stop.flag:
            t0 = time.monotonic()
            host = next(it)
            t_data = time.monotonic() - t0
            batch = _global_batch(host, text_encoder, batch_sharding, text_cache)
            watchdog.begin()
            state, metrics = jit_step(state, batch, encoders)
            metrics = jax.device_get(metrics)
            watchdog.end()
            dt = time.monotonic() - t0
            step = int(jax.device_get(state.step))
            if metrics["nonfinite"]:
                bad_in_row += 1
                nonfinite_total += 1
                if bad_in_row >= max_bad:
                    raise NonFiniteError(
                        f"{bad_in_row} non-finite steps in a row (loss {metrics['loss']}, grad norm "
                        f"{metrics['grad_norm']}); stopping. Last good checkpoint: {last_good_ckpt}")
            else:
                bad_in_row = 0
                last_loss = float(metrics["loss"])
            tokens = _tokens(batch["video"].shape, vae, mcfg)
            logger.log(step, dict(metrics, step_time=dt, data_time=t_data, samples_per_s=batch["video"].shape[0] / dt,
                                  tokens_per_s=tokens / dt, skipped=getattr(loader, "num_skipped", 0),
                                  nonfinite_total=nonfinite_total, epoch=host.get("epoch", 0),
                                  bucket=str(host.get("bucket", ""))))
            if step and step % ckpt_every == 0:
                save()
        save(force=True)  # the end (or a signal)
    finally:
        watchdog.stop()
        stop.restore()
        ckpt.close()
        logger.close()
    return dict(steps=step, last_loss=last_loss, checkpoints=ckpt.directory, outputs=outdir,
                stopped_by_signal=stop.flag, nonfinite=nonfinite_total)


def _version():
    from jaxsora import __version__

    return __version__


def _trainable(mcfg):
    from jaxsora.models.stdit3 import trainable_filter

    return trainable_filter(mcfg)


def _train_state_shardings(abstract_model, abstract_state: TrainState, tx, mesh, rules):
    _, params, frozen = nnx.split(abstract_model, _trainable(abstract_model.config), ...)
    p_sh = state_shardings(params, mesh, rules)
    f_sh = state_shardings(frozen, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Adam moments follow their parameter's sharding; counters are replicated.
    opt_sh = jax.tree.map(lambda _: replicated, abstract_state.opt_state)
    opt_sh = _match_param_shardings(abstract_state.opt_state, params, p_sh, opt_sh)
    return TrainState(step=replicated, params=p_sh, frozen=f_sh, opt_state=opt_sh, ema=p_sh, rng=replicated)


def _match_param_shardings(opt_state, params, p_sh, default):
    """Give every params-shaped subtree of the optimizer state the params' shardings."""
    p_struct = jax.tree.structure(params)

    def walk(node, dflt):
        if jax.tree.structure(node) == p_struct:
            return p_sh
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(n, d) for n, d in zip(node, dflt))
        if hasattr(node, "_fields"):  # namedtuple optax state
            return type(node)(*[walk(n, d) for n, d in zip(node, dflt)])
        return dflt

    return walk(opt_state, default)


def _encoders(vae, text_encoder):
    """(frozen weights pytree, encode_video, encode_text): the weights travel as jit arguments.
    Without a text encoder (a text-state cache), the batch's `ids` already are the states."""
    weights = {}
    if text_encoder is not None:
        te_graphdef = text_encoder.graphdef
        weights["t5"] = text_encoder.state
    if isinstance(vae, nnx.Module):
        vae_graphdef, weights["vae"] = nnx.split(vae)

        def encode_video(enc, video, key):
            return nnx.merge(vae_graphdef, enc["vae"]).encode(video, key)
    else:  # parameter-free (IdentityVAE)
        def encode_video(enc, video, key):
            return vae.encode(video, key)

    def encode_text(enc, ids, mask):
        if text_encoder is None:
            return ids.astype(jnp.float32)  # cached states [B, L, D]
        return nnx.merge(te_graphdef, enc["t5"])(ids, mask).astype(jnp.float32)

    return weights, encode_video, encode_text


def _tokens(video_shape, vae, mcfg) -> int:
    b, _, t, h, w = video_shape
    lt, lh, lw = vae.get_latent_size((t, h, w))
    pt, ph, pw = mcfg.patch_size
    return b * (-(-lt // pt)) * (-(-lh // ph)) * (-(-lw // pw))


def _global_batch(host: dict, text_encoder, sharding, text_cache=None) -> dict:
    """Host-local numpy batch → global jax Arrays sharded over the batch axes. Captions become token
    ids (the step runs T5), or with a text cache the cached states themselves."""
    texts = [str(t) for t in host["text"]]
    if text_cache is not None:
        y, tmask = text_cache.lookup(np.asarray(host["row"]), texts)  # checks each caption's hash
        ids = np.asarray(y, np.float32)[:, 0]
    else:
        ids, tmask = text_encoder.tokenize(texts)
        ids = ids.astype(np.int32)
    video = np.asarray(host["video"])  # uint8 from the loader: the step maps it to [-1, 1]
    local = dict(video=video if video.dtype == np.uint8 else video.astype(np.float32), ids=ids,
                 text_mask=tmask.astype(np.int32), fps=np.asarray(host["fps"], np.float32),
                 height=np.asarray(host["height"], np.float32), width=np.asarray(host["width"], np.float32),
                 num_frames=np.asarray(host["num_frames"], np.float32))
    out = {}
    for k, v in local.items():
        spec = PartitionSpec(*((sharding.spec[0],) + (None,) * (v.ndim - 1)))
        out[k] = jax.make_array_from_process_local_data(NamedSharding(sharding.mesh, spec), v)
    return out


def _default_loader(config, dp: int):
    from jaxsora.data.buckets import normalize_bucket_config
    from jaxsora.data.loader import VideoLoader

    dcfg = config.data
    buckets = normalize_bucket_config(_plain(dcfg.bucket_config))
    if int(dcfg.get("batch_size_override", 0) or 0) > 0:
        bs = int(dcfg.batch_size_override)
        buckets = {r: {f: (p, None if b is None else bs) for f, (p, b) in fr.items()} for r, fr in buckets.items()}
    return VideoLoader(dcfg.table, buckets, seed=int(dcfg.get("seed", config.train.seed)),
                       data_parallel_size=dp, process_index=jax.process_index(),
                       process_count=jax.process_count(), num_workers=int(dcfg.get("num_workers", 0)),
                       decode_threads=int(dcfg.get("decode_threads", 1)), prefetch=int(dcfg.get("prefetch", 2)),
                       index_dir=dcfg.get("index_dir") or None, frame_interval=int(dcfg.get("frame_interval", 1)),
                       extra_resolutions=_plain(dcfg.resolutions) if dcfg.get("resolutions") else None)


def _load_weights_only(state: TrainState, path: str, mcfg, shardings, tx) -> TrainState:
    """`--ckpt-path`: weights from a jaxsora checkpoint or a PyTorch file; fresh optimizer/EMA."""
    from jaxsora.convert import native
    from jaxsora.convert import torch as tconv

    model = STDiT3(mcfg, rngs=nnx.Rngs(0))
    if os.path.isdir(path):
        _, flat = native.load_weights(path, ema=False)
        native.apply_weights(model, flat, source=path)
        print(f"[jaxsora] --ckpt-path: loaded weights from {path}")
    else:
        report = tconv.load_torch_state_dict(model, tconv.read_state_dict(path))
        print(f"[jaxsora] --ckpt-path {path}: {report.summary()}")
    fresh = init_state(model, tx, 0)[1].replace(rng=state.rng)
    return jax.device_put(fresh, shardings)


def _dry_run(config, mcfg, loader, abstract_model, mesh, outdir) -> dict:
    """Validate and print the plan; train nothing."""
    n_params = param_count(abstract_model)
    n_train = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(abstract_model, _trainable(mcfg))))
    # fp32 params + fp32 EMA + 2 fp32 Adam moments for trainables, sharded over fsdp.
    fsdp = mesh.shape["fsdp"]
    per_device_gb = (n_params * 4 + n_train * 4 * 3) / fsdp / 1e9
    lines = [f"model {config.model.get('name')}: {n_params:,} numbers ({n_train:,} trainable)",
             f"mesh {dict(mesh.shape)} over {jax.device_count()} devices ({jax.process_count()} processes)",
             f"per-device memory for weights+EMA+Adam (fsdp={fsdp}): {per_device_gb:.2f} GB "
             f"(activations extra; remat={'on' if mcfg.remat else 'off'})"]
    plan = loader.describe_plan(0)
    total = 0
    lines.append(f"epoch 0 plan ({loader.num_rows} rows in the table):")
    lines.append(f"{'bucket (res, frames, H, W)':<32} {'rows':>7} {'batches/epoch':>14} {'global batch':>13}")
    for bucket, nb, gb, rows in plan:
        lines.append(f"{str(bucket):<32} {rows:>7} {nb:>14} {gb:>13}")
        total += nb
    lines.append(f"steps per epoch: {total}")
    if total == 0:
        lines.append("WARNING: no full batch this epoch: no row fits the bucket config at this data-parallel size "
                     "(too small, too short, or too few rows)")
    text = "\n".join(lines)
    if _is_main():
        print(text)
    return dict(plan=plan, steps_per_epoch=total, params=n_params, per_device_gb=per_device_gb, outputs=outdir)

