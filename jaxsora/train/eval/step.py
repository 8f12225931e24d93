"""The eval's pure function and its jitted step: fixed timesteps, noise and VAE keys that depend on
`eval.seed`, the bucket and the row only (see `train.eval.loss`), the rectified-flow loss summed per
timestep; `EvalStep` compiles it for the run's mesh like `train.step.train_step.TrainStep`."""
from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsora.data.video import to_model_range
from jaxsora.diffusion import rflow
from jaxsora.parallel import compile_options
from jaxsora.parallel.constraints import logical_rules
from jaxsora.parallel.sharding import abstract_of, batch_sharding, host_to_global
from jaxsora.train.step.train_step import CompileInfo, batch_key, batch_spec, global_batch

# Open-Sora's eval config seeds with 42.
EVAL_SEED = 42
# Stream tags folded into the eval key: the VAE posterior sample and the diffusion noise.
_VAE_STREAM, _NOISE_STREAM = 0, 1


def bucket_code(name: str) -> int:
    """A bucket's stream id in the eval keys (crc32 of its name, 31 bits)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _stream_key(seed: int, stream: int):
    return jax.random.fold_in(jax.random.key(int(seed)), stream)


def noise_key(seed: int, code, row, t_index):
    """The key of one row's noise at one timestep index (see `train.eval.loss`'s docstring)."""
    k = _stream_key(seed, _NOISE_STREAM)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(k, code), row), t_index)


def vae_key(seed: int, code, batch_index):
    """The key of the VAE's posterior sample of one eval batch."""
    return jax.random.fold_in(jax.random.fold_in(_stream_key(seed, _VAE_STREAM), code), batch_index)


def eval_noise(seed: int, code, rows, t_index, shape) -> jax.Array:
    """[B, *shape] float32: each row's own noise at timestep index `t_index`."""
    return jax.vmap(lambda r: jax.random.normal(noise_key(seed, code, r, t_index), tuple(shape), jnp.float32))(
        jnp.asarray(rows))


def make_eval_fn(graphdef, *, encode_video: Callable, encode_text: Callable,
                 num_timesteps: int = rflow.NUM_EVAL_TIMESTEPS, seed: int = EVAL_SEED):
    """Returns `eval_fn(weights, frozen, batch, encoders, ids) -> {"loss_sum": [n], "count": []}`, a
    pure function (to be jitted by the caller): for each of the n fixed timesteps, Σ_rows weight ·
    per-sample loss; and Σ weight.

    batch: the train step's batch (video uint8 [B, 3, T, H, W], ids, text_mask, fps, height, width,
    num_frames) plus row [B] int32 (table rows: the noise streams) and weight [B] float32 (0 for
    padding and rows that failed to decode). ids: uint32 [2] = (bucket code, batch index in the
    bucket), replicated. No frame masks, no caption dropout, no state.
    """
    ts = rflow.eval_timesteps(num_timesteps)

    def eval_fn(weights, frozen, batch, encoders, ids):
        code, index = ids[0], ids[1]
        video = batch["video"]
        if video.dtype == jnp.uint8:
            video = to_model_range(video)
        x0 = encode_video(encoders, video, vae_key(seed, code, index)).astype(jnp.float32)
        y = encode_text(encoders, batch["ids"], batch["text_mask"])[:, None]
        cond = dict(y=y, mask=batch["text_mask"], fps=batch["fps"], height=batch["height"], width=batch["width"])
        model = nnx.merge(graphdef, weights, frozen)
        b = x0.shape[0]

        def one(i):
            noise = eval_noise(seed, code, batch["row"], i, x0.shape[1:])
            t = jnp.full((b,), jnp.asarray(ts)[i])
            return rflow.training_loss_explicit(model, x0, cond, noise, t)

        losses = jax.lax.map(one, jnp.arange(num_timesteps))  # [n, B]
        w = batch["weight"].astype(jnp.float32)
        return dict(loss_sum=jnp.sum(losses * w[None], axis=1), count=jnp.sum(w))

    return eval_fn


class EvalStep:
    """The eval function jitted for the run's mesh, like `train.step.train_step.TrainStep`: traced, compiled and
    called under `jax.set_mesh(mesh)` and the logical-axis rules; one executable per batch shape;
    outputs replicated; nothing donated. `use_ema`: evaluate the EMA instead of the params."""

    def __init__(self, eval_fn: Callable, plan, *, use_ema: bool = False):
        self.eval_fn, self.plan, self.use_ema = eval_fn, plan, bool(use_ema)
        self.mesh, self.rules = plan.mesh, plan.rules
        self._jit = jax.jit(self._traced, out_shardings=plan.replicated,
                            compiler_options=compile_options.of_mesh(self.mesh))
        self.executables: dict = {}
        self.info: dict = {}
        self._lock = threading.Lock()

    def _traced(self, weights, frozen, batch, encoders, ids):
        with logical_rules(self.rules):
            return self.eval_fn(weights, frozen, batch, encoders, ids)

    def weights(self, state):
        return (state.ema if self.use_ema else state.params), state.frozen

    def ids(self, code: int, index: int) -> jax.Array:
        value = np.array([code, index], np.uint32)
        return jax.make_array_from_callback((2,), self.plan.replicated, lambda idx: value[idx])

    def _abstract_ids(self):
        return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.plan.replicated)

    def lower(self, spec: dict, encoders):
        abstract = self.plan.abstract_sharded
        with jax.set_mesh(self.mesh):
            return self._jit.lower(abstract.ema if self.use_ema else abstract.params, abstract.frozen, spec,
                                   encoders, self._abstract_ids())

    def compile(self, spec: dict, encoders, lowered=None) -> CompileInfo:
        """Compile (once) the executable for this batch shape; thread-safe."""
        key = batch_key(spec)
        if key in self.info:
            return self.info[key]
        t0 = time.perf_counter()
        compiled = (lowered if lowered is not None else self.lower(spec, encoders)).compile()
        info = CompileInfo.of(compiled, time.perf_counter() - t0)
        with self._lock:
            self.executables.setdefault(key, compiled)
            self.info.setdefault(key, info)
        return self.info[key]

    def __call__(self, state, batch: dict, encoders, ids) -> dict:
        key = batch_key(batch)
        if key not in self.executables:
            self.compile(abstract_of(batch), encoders)
        weights, frozen = self.weights(state)
        with jax.set_mesh(self.mesh):
            return self.executables[key](weights, frozen, batch, encoders, ids)


def eval_batch_spec(size: tuple, batch: int, text_spec: dict, mesh) -> dict:
    """The eval function's abstract batch: the train step's plus row and weight."""
    spec = batch_spec(size, batch, text_spec, mesh)
    for name, dtype in (("row", jnp.int32), ("weight", jnp.float32)):
        spec[name] = jax.ShapeDtypeStruct((batch,), dtype, sharding=batch_sharding(mesh, 1))
    return spec


def eval_global_batch(host: dict, mesh) -> dict:
    """A host eval batch → the eval function's global arrays."""
    out = global_batch(host, mesh)
    out.update(host_to_global(dict(row=np.asarray(host["row"], np.int32),
                                   weight=np.asarray(host["weight"], np.float32)), mesh))
    return out
