"""The jitted train step.

One step (Open-Sora 1.2 `scripts/train.py`): encode the video with the frozen VAE and the
captions with the frozen text encoder → draw the frame-conditioning masks → rectified-flow loss
of STDiT3 (caption dropout inside) → gradients of the trainable parameters → global-norm clip →
AdamW → EMA. A step is rejected — the state left unchanged, counted in the metrics (`nonfinite`)
and by the loop — when its loss or gradient norm is not finite, or when its update would make
the parameter norm non-finite or grow it past `max_norm_growth` times (a blow-up with a finite
loss: parameters at 1e30 after one step).

The state is donated; every distinct bucket shape compiles once (the persistent compilation
cache keeps the executables across runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src import config as jax_config  # enable_compilation_cache as a context (no public spelling in 0.10)

from jaxsora.data.video import to_model_range
from jaxsora.diffusion import rflow
from jaxsora.diffusion.masks import MaskGenerator
from jaxsora.models.config import RematChoice
from jaxsora.models.lora import dropout_rng as lora_dropout_rng
from jaxsora.models.stdit3 import remat_override
from jaxsora.parallel import compile_options, targets
from jaxsora.parallel.constraints import logical_rules
from jaxsora.parallel.sharding import abstract_of, batch_sharding, host_to_global
from jaxsora.train.step.optim import AdamW
from jaxsora.train.step.state import StatePlan, TrainState

# Batch entries that replace the step's own random draws (see `make_train_step`).
EXPLICIT_DRAWS = ("t", "noise", "x_mask", "drop_ids")


def make_train_step(
    graphdef,
    optimizer: AdamW,
    *,
    encode_video: Callable[[jax.Array, jax.Array], jax.Array],
    encode_text: Callable[[jax.Array, jax.Array], jax.Array],
    scheduler_cfg: dict,
    mask_ratios: dict | None,
    ema_decay: float,
    max_norm_growth: float = 0.0,
):
    """Returns `step(state, batch, encoders) -> (state, metrics)`, to be jitted by the caller.

    batch: video [B, 3, T, H, W] uint8 (mapped to [-1, 1] here) or f32 in [-1, 1] — or, from a feature
    cache, latents [B, C, T', H', W'] in place of video (no VAE call); ids/text_mask
    [B, L] int32; fps/height/width [B] f32 (pixels); num_frames [B] f32 (pixel frames).
    encoders: the frozen encoders' weights (any pytree), passed as jit *arguments* so that large
    VAE/T5 weights are not baked into the executable as constants.
    encode_video(encoders, video, key) → latents [B, C, T', H', W'] (no gradient);
    encode_text(encoders, ids, text_mask) → [B, L, D] text states (no gradient).
    optimizer: the recipe's clipping and AdamW (`AdamW.update`; the state's opt_state is `optimizer.tx()`'s).
    max_norm_growth: > 0 rejects an update with ‖params'‖ > max_norm_growth · ‖params‖ (0: off).

    The step's random draws come from the state's key. A batch may instead carry them (`EXPLICIT_DRAWS`):
    t [B] (already shifted) with noise [B, C, T', H', W'], x_mask [B, T'] bool, drop_ids [B] (1 = null
    caption) — how tests/train/test_train_curve.py replays Open-Sora's own draws step for step.
    """
    mask_gen = MaskGenerator(dict(mask_ratios)) if mask_ratios else None
    sched = dict(scheduler_cfg or {})

    def loss_and_grads(state: TrainState, batch: dict, encoders=None):
        """The step's loss and the gradients of the trainable params (no update)."""
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        k_vae, k_mask, k_loss, k_drop = jax.random.split(key, 4)
        if "latents" in batch:  # a feature cache's latents (data.features): no VAE in the step
            x0 = batch["latents"].astype(jnp.float32)
        else:
            video = batch["video"]
            if video.dtype == jnp.uint8:
                video = to_model_range(video)
            x0 = jax.lax.stop_gradient(encode_video(encoders, video, k_vae).astype(jnp.float32))
        y = jax.lax.stop_gradient(encode_text(encoders, batch["ids"], batch["text_mask"]))[:, None]
        b, t = x0.shape[0], x0.shape[2]
        if "x_mask" in batch:
            x_mask = batch["x_mask"].astype(bool)
        else:
            x_mask = mask_gen.get_masks(k_mask, b, t) if mask_gen is not None else None
        cond = dict(y=y, mask=batch["text_mask"], fps=batch["fps"], height=batch["height"], width=batch["width"])
        drop = dict(force_drop_ids=batch["drop_ids"]) if "drop_ids" in batch else dict(dropout_key=k_drop)

        def loss_fn(params):
            model = nnx.merge(graphdef, params, state.frozen)

            def model_fn(x_t, t_, **c):
                with lora_dropout_rng(jax.random.fold_in(k_drop, 1)):  # LoRA adapters' dropout, if any
                    return model(x_t, t_, **drop, **c)

            if "t" in batch:
                per_sample = rflow.training_loss_explicit(model_fn, x0, cond, batch["noise"], batch["t"], x_mask=x_mask)
            else:
                per_sample = rflow.training_loss(
                    model_fn, x0, cond, k_loss, x_mask=x_mask, height=batch["height"], width=batch["width"],
                    num_frames=batch["num_frames"], **sched,
                )
            return jnp.mean(per_sample)

        return jax.value_and_grad(loss_fn)(state.params)

    def step(state: TrainState, batch: dict, encoders=None):
        loss, grads = loss_and_grads(state, batch, encoders)
        grad_norm = optax.tree.norm(grads)
        # A rejected step leaves the state as it was: every array picks its old value by the scalar verdict, from
        # one computed update (AdamW.update). Measured against a lax.cond whose branch recomputed the update (the
        # compiled XLA:CPU step at bench/step.py's shapes): the select needs as much scratch memory as no guard at
        # all at `realistic` and `240p` (0.696 and 1.095 GiB, the cond 0.761 and 1.347) and less at `wide` (1.144,
        # the cond 1.325), and runs 3-4% faster; the outputs still reuse the donated state's buffers. The two
        # differ in rounding only; the demo judged over two data/init seeds: colour 92/96, motion 90/96 with
        # the select, 95/96 and 88/96 with the cond (measured 2026-11-26).
        params, opt_state, ema, norm, growth, ok = optimizer.update(
            grads, grad_norm, state.opt_state, state.params, state.ema, ema_decay=ema_decay,
            accept=jnp.isfinite(loss) & jnp.isfinite(grad_norm), max_norm_growth=max_norm_growth)
        new_state = state.replace(step=jnp.where(ok, state.step + 1, state.step), params=params,
                                  opt_state=opt_state, ema=ema)
        metrics = dict(loss=loss, grad_norm=grad_norm, weight_norm=norm,
                       lr=optimizer.lr(state.step), nonfinite=(~ok).astype(jnp.int32), step=new_state.step,
                       norm_growth=growth)
        return new_state, metrics

    step.loss_and_grads = loss_and_grads
    return step


# --------------------------------------------------------------------------------------------
# the step's inputs
# --------------------------------------------------------------------------------------------
def batch_spec(size: tuple, batch: int, text_spec: dict, mesh: jax.sharding.Mesh,
               video_spec: dict | None = None) -> dict:
    """The step's batch as ShapeDtypeStructs (sharded over the batch axes) for a bucket of pixel
    size (T, H, W) and `batch` global rows — what `global_batch` makes of a loader batch.
    text_spec: {"ids": (shape, dtype), "text_mask": (shape, dtype)} (`Encoders.text_spec`);
    video_spec: the same for the video or latents (`Encoders.video_spec`; default uint8 video)."""
    t, h, w = size
    f32 = jnp.float32
    video_spec = video_spec if video_spec is not None else dict(video=((batch, 3, t, h, w), jnp.uint8))
    shapes = dict(**video_spec, **text_spec, fps=((batch,), f32), height=((batch,), f32),
                  width=((batch,), f32), num_frames=((batch,), f32))
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))
            for k, (shape, dtype) in shapes.items()}


def global_batch(host: dict, mesh: jax.sharding.Mesh) -> dict:
    """A loader's host batch (this host's rows; text already turned into `ids`/`text_mask` by the
    loader's workers; uint8 `video`, or a feature cache's `latents`) → the step's global arrays."""
    if "latents" in host:
        pixels = dict(latents=np.asarray(host["latents"]))
    else:
        pixels = dict(video=np.asarray(host["video"]))
        if pixels["video"].dtype != np.uint8:
            raise TypeError(f"the loader must give uint8 video (mapped to [-1, 1] in the step), got "
                            f"{pixels['video'].dtype}")
    local = dict(**pixels, ids=np.asarray(host["ids"]), text_mask=np.asarray(host["text_mask"], np.int32),
                 **{k: np.asarray(host[k], np.float32) for k in ("fps", "height", "width", "num_frames")})
    return host_to_global(local, mesh)


# --------------------------------------------------------------------------------------------
# the step on the mesh: ahead-of-time compiles per batch shape
# --------------------------------------------------------------------------------------------
def batch_key(batch: dict) -> tuple:
    """What an executable is specialized on: each input's name, shape and dtype."""
    return tuple(sorted((k, tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in batch.items()))


# Batch entries that change with the captions' cut length (`data.text_lengths`), not with the bucket
TEXT_ENTRIES = ("ids", "text_mask")


def bucket_key(batch: dict) -> tuple:
    """What a bucket is, for the remat the compile plan chose for it: the batch's entries except the text
    (a batch of the same bucket with shorter captions runs with that bucket's choice)."""
    return tuple(x for x in batch_key(batch) if x[0] not in TEXT_ENTRIES)


@dataclasses.dataclass
class CompileInfo:
    """What XLA says about one compiled step (per device: the program is SPMD-partitioned)."""

    seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated inputs (the train state)
    temp_bytes: int  # activations and other scratch
    flops: float | None  # XLA's cost analysis of the partitioned program
    matmul_flops: float | None = None  # counted from the optimized HLO (`train.plan.hlo`): a target's compiles
    bytes_accessed: float | None = None  # the compiler's count of the bytes its ops access, where it gives one

    @property
    def peak_bytes(self) -> int:
        """Device memory the step needs: inputs + outputs (less what is donated) + scratch."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @classmethod
    def of(cls, compiled, seconds: float, count_matmuls: bool = False) -> CompileInfo:
        m = compiled.memory_analysis()
        try:
            cost = compiled.cost_analysis()
        except Exception:  # noqa: BLE001 - XLA:GPU in jaxlib 0.10.2 has none
            cost = None
        cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
        flops = float(cost["flops"]) if isinstance(cost, dict) and cost.get("flops") else None
        accessed = float(cost["bytes accessed"]) if isinstance(cost, dict) and cost.get("bytes accessed") else None
        get = lambda name: int(getattr(m, name, 0) or 0) if m is not None else 0  # noqa: E731
        matmuls = None
        if count_matmuls:
            from jaxsora.train.plan.hlo import matmul_flops

            matmuls = matmul_flops(compiled.as_text())
        return cls(seconds, get("argument_size_in_bytes"), get("output_size_in_bytes"),
                   get("alias_size_in_bytes"), get("temp_size_in_bytes"), flops, matmuls, accessed)


class TrainStep:
    """The train step jitted for the run's mesh.

    Every trace, compile and call happens under `jax.set_mesh(mesh)` and the logical-axis rules:
    outside them the model's activation-sharding constraints and the Ulysses `shard_map` would do
    nothing at all — and compute the same numbers, so nothing else would notice. There is one
    executable per batch shape (bucket): `compile` builds it ahead of time from shapes alone (the
    memory check before step 0 reads `CompileInfo`), a call with a new shape compiles it first.
    The state argument is donated. With `model.remat="auto"` each bucket's executable is traced with the
    remat its compile plan chose (`remat`, `adopt`; `jaxsora.train.plan.memory.choose_remat`).
    """

    def __init__(self, step_fn: Callable, plan: StatePlan):
        self.step_fn, self.plan = step_fn, plan
        self.mesh, self.rules = plan.mesh, plan.rules
        self._jits: dict = {}  # RematChoice | None → its jax.jit (a trace of its own per choice)
        self._jit = self._jit_for(None)
        self.executables: dict = {}
        self.info: dict = {}
        # bucket_key → the RematChoice the compile plan made for `model.remat="auto"` (jaxsora.train.plan.memory)
        self.remat: dict = {}
        self._lock = threading.Lock()

    def _jit_for(self, remat: RematChoice | None):
        """The step jitted with the blocks' remat overridden by `remat` (None: the model config's). One jax.jit
        per choice: jit caches a trace by its function, so two choices must not share one."""
        if remat not in self._jits:
            def traced(state, batch, encoders):
                with logical_rules(self.rules), remat_override(remat):
                    return self.step_fn(state, batch, encoders)

            self._jits[remat] = jax.jit(traced, donate_argnums=(0,),
                                        out_shardings=(self.plan.shardings, self.plan.replicated),
                                        compiler_options=compile_options.of_mesh(self.mesh))
        return self._jits[remat]

    def remat_for(self, batch_spec: dict) -> RematChoice | None:
        """The remat chosen for this batch's bucket (None: none chosen, the model config's)."""
        return self.remat.get(bucket_key(batch_spec))

    def lower(self, batch_spec: dict, encoders, remat: RematChoice | None = None):
        """Trace for abstract (or real) inputs; the state is the plan's abstract sharded state. remat: the
        blocks' remat for this trace (None: the one chosen for this bucket, else the model config's)."""
        remat = remat if remat is not None else self.remat_for(batch_spec)
        with jax.set_mesh(self.mesh):
            return self._jit_for(remat).lower(self.plan.abstract_sharded, batch_spec, encoders)

    def compiled(self, batch_spec: dict) -> bool:
        """Whether the executable for this batch shape exists already."""
        return batch_key(batch_spec) in self.info

    def compile(self, batch_spec: dict, encoders, lowered=None, keep: bool = True,
                remat: RematChoice | None = None) -> CompileInfo:
        """Compile (once) the executable for this batch shape; thread-safe, so that several
        buckets compile side by side (XLA releases the GIL). keep=False: only measure it.
        remat: as `lower` (a `lowered` given must have been traced with it)."""
        key = batch_key(batch_spec)
        if key in self.info:
            return self.info[key]
        compiled, info = self.compile_candidate(batch_spec, encoders, remat, lowered)
        if not keep:
            return info
        return self.adopt(batch_spec, compiled, info, remat)

    def compile_candidate(self, batch_spec: dict, encoders, remat: RematChoice | None = None, lowered=None):
        """(compiled executable, CompileInfo) of this batch shape with this remat, kept nowhere: the compile
        plan measures candidates with it and `adopt`s the one it picks. For a `train.target`'s devices, which can
        only compile: (None, CompileInfo), the numbers read back from the plan cache when this program was
        compiled for the target before (`train.plan.target_cache`)."""
        t0 = time.perf_counter()
        lowered = lowered if lowered is not None else self.lower(batch_spec, encoders, remat)
        target = targets.target_of(self.mesh)
        if target is None:
            compiled = lowered.compile()
            return compiled, CompileInfo.of(compiled, time.perf_counter() - t0)
        from jaxsora.train.plan import target_cache

        key = target_cache.key(lowered, target, compile_options.of_mesh(self.mesh))
        kept = target_cache.read(key)
        info = None
        if kept is not None:
            try:
                info = CompileInfo(**kept)
            except TypeError:  # an entry of an older CompileInfo: compile again
                info = None
        if info is None:
            # jax's persistent cache cannot read back an executable of compile-only devices: ours keeps the numbers
            no_cache = getattr(jax_config, "enable_compilation_cache", None)
            with no_cache(False) if no_cache is not None else contextlib.nullcontext():
                compiled = lowered.compile()
            info = CompileInfo.of(compiled, time.perf_counter() - t0, count_matmuls=True)
            target_cache.write(key, info)
        return None, info

    def adopt(self, batch_spec: dict, compiled, info: CompileInfo, remat: RematChoice | None = None) -> CompileInfo:
        """Keep `compiled` as this batch shape's executable (the first one kept wins), and `remat` as its
        bucket's choice: later shapes of the bucket (shorter captions) compile with it too."""
        key = batch_key(batch_spec)
        with self._lock:
            self.executables.setdefault(key, compiled)
            self.info.setdefault(key, info)
            if remat is not None:
                self.remat.setdefault(bucket_key(batch_spec), remat)
        return self.info[key]

    def loss_and_grads(self, state, batch: dict, encoders):
        """The step's loss and gradients, traced exactly as the step is (mesh, rules), not donated."""
        def traced(state, batch, encoders):
            with logical_rules(self.rules):
                return self.step_fn.loss_and_grads(state, batch, encoders)

        with jax.set_mesh(self.mesh):
            return jax.jit(traced, out_shardings=(self.plan.replicated, self.plan.shardings.params),
                           compiler_options=compile_options.of_mesh(self.mesh))(
                state, batch, encoders)

    def __call__(self, state, batch: dict, encoders):
        key = batch_key(batch)
        exe = self.executables.get(key)
        if exe is None:
            self.compile(abstract_of(batch), encoders)
            exe = self.executables[key]
        with jax.set_mesh(self.mesh):
            return exe(state, batch, encoders)
