"""`Pipeline`: a jaxsora checkpoint + VAE + text encoder on a mesh → videos (Open-Sora 1.2's
`scripts/inference.py`).

    pipe = Pipeline.load("outputs/run", step=None, ema=True, vae=None, text_encoder=None)
    videos = pipe.generate(["a red circle moving right"], SampleSettings(image_size=(32, 32), num_frames=8))

Loading (weights only, never the optimizer state): `jaxsora.infer.loading`. Seeding (per prompt,
independent of batching), references and edit masks: `jaxsora.infer.conditioning`. Writing the
videos and their sidecars: `jaxsora.infer.writing`. Their public names are importable from here too.

Mesh: prompts are sharded over the batch axes (data × fsdp); each batch has
`rows = ceil(min(batch_size, #prompts) / dp) · dp` rows (the padding rows repeat the last prompt
and are dropped). With `sequence > 1` the model runs Ulysses sequence parallelism (the model's own
path, as in training). Every distinct (rows, latent shape, conditioned or not) compiles once.
"""
from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxsora.data import text_length
from jaxsora.errors import BadInput
from jaxsora.infer import options as opt
from jaxsora.infer.conditioning import (
    build_condition,
    cond_pixel_frames,
    prompt_hash,
    prompt_key,
    prompt_occurrences,
    read_reference,
    vae_align,
)
from jaxsora.infer.loading import build_components, build_vae, model_config, restore_model
from jaxsora.infer.locate import (
    CONVERTED_HINT,
    PipelineError,
    find_step_dir,
    read_run_config,
    read_stored_config,
    text_encoder_spec,
    vae_spec,
)
from jaxsora.infer.options import SampleSettings, default_settings
from jaxsora.infer.writing import sample_name, write_samples
from jaxsora.parallel import compile_options

__all__ = ["Pipeline", "PipelineError", "CONVERTED_HINT", "default_mesh", "default_settings", "find_step_dir",
           "read_run_config", "vae_spec", "text_encoder_spec", "build_vae", "vae_align", "cond_pixel_frames",
           "prompt_hash", "prompt_occurrences", "prompt_key", "read_reference", "build_condition", "sample_name",
           "write_samples"]


# --------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------
def default_mesh(dp: int | None = None, sp: int = 1) -> jax.sharding.Mesh:
    from jaxsora.parallel.mesh import make_mesh

    return make_mesh({"data": -1 if dp is None else int(dp), "fsdp": 1, "sequence": int(sp)})


class Pipeline:
    """A loaded model with its VAE and text encoder, on a mesh. See the module docstring."""

    def __init__(self, model, vae, text_encoder, mesh, *, step: int, step_dir: str, run_config: dict | None,
                 weights: str, use_timestep_transform: bool = True, specs: dict | None = None):
        from jaxsora.parallel.mesh import data_parallel_size, logical_rules

        self.mesh = mesh
        self.rules = logical_rules(mesh)
        self.dp = data_parallel_size(mesh)
        self.model_config = model.config
        self.graphdef, self.state = nnx.split(model)
        self.vae = vae
        if isinstance(vae, nnx.Module):
            self._vae_graphdef, self.vae_state = nnx.split(vae)
            self.vae_state = jax.device_put(self.vae_state, NamedSharding(mesh, PartitionSpec()))
        else:
            self._vae_graphdef, self.vae_state = None, None
        self.text_encoder = text_encoder
        self.step = int(step)
        self.step_dir = step_dir
        self.run_config = run_config
        self.weights = weights
        self.use_timestep_transform = bool(use_timestep_transform)
        self.specs = dict(specs or {})
        self.align = vae_align(vae)
        # How many times each jitted function was traced (a second batch of one shape adds nothing).
        self.trace_counts: collections.Counter = collections.Counter()
        opts = compile_options.of_mesh(mesh)
        self._denoise_init = jax.jit(self._denoise_init_impl, static_argnames=("latent_shape",),
                                     compiler_options=opts)
        self._denoise = jax.jit(self._denoise_impl, compiler_options=opts)
        self._decode = jax.jit(self._decode_impl, static_argnames=("num_frames",), compiler_options=opts)
        self._encode = jax.jit(self._encode_impl, compiler_options=opts)
        self._to_uint8 = jax.jit(self._to_uint8_impl)
        self._last_denoise = None

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, ckpt: str, *, step: int | None = None, ema: bool = True, vae=None, text_encoder=None,
             mesh: jax.sharding.Mesh | None = None, dtype: str | None = None) -> Pipeline:
        """ckpt: a run folder, its checkpoints/, a step folder or a `convert from-torch` output.
        ema: use the EMA weights when the checkpoint has them (else the params, said on stderr).
        vae / text_encoder: None (the run config's) or a spec (see `vae_spec`, `text_encoder_spec`).
        mesh: default all devices on the data axis. dtype: the model's compute dtype (default the
        checkpoint's; "bfloat16"/"float32"; "bf16"/"fp32" accepted)."""
        from jaxsora.parallel.mesh import check_sequence_parallel, logical_rules, sequence_parallel_size

        step_dir = find_step_dir(ckpt, step)
        stored = read_stored_config(step_dir)
        if not isinstance(stored, dict) or "model" not in stored:
            raise PipelineError(f"{step_dir}/config has no 'model' entry (not a jaxsora checkpoint)")
        run_cfg = stored if ("vae" in stored or "text_encoder" in stored) else None
        mcfg = model_config(stored["model"], dtype)
        mesh = mesh if mesh is not None else default_mesh()
        rules = logical_rules(mesh)
        check_sequence_parallel(mcfg.num_heads, mesh)
        mcfg = dataclasses.replace(mcfg, sequence_parallel_axis="sequence" if sequence_parallel_size(mesh) > 1
                                   else None)

        # Components first (cheap checks before the weights are read).
        vcfg, tcfg, vae_obj, te = build_components(vae, text_encoder, run_cfg, mcfg, mesh, rules)
        model, weights = restore_model(step_dir, mcfg, run_cfg, mesh, rules, ema=ema)
        sched = (run_cfg or {}).get("scheduler") or {}
        step_n = int(os.path.basename(step_dir)) if os.path.basename(step_dir).isdigit() else 0
        return cls(model, vae_obj, te, mesh, step=step_n, step_dir=step_dir, run_config=run_cfg, weights=weights,
                   use_timestep_transform=bool(sched.get("use_timestep_transform", True)),
                   specs={"vae": vcfg, "text_encoder": tcfg})

    # ---- settings ----------------------------------------------------------------------------
    @property
    def extra_resolutions(self) -> dict | None:
        data = (self.run_config or {}).get("data") or {}
        return data.get("resolutions") or None

    def default_settings(self, **overrides) -> SampleSettings:
        """`default_settings(self.run_config, **overrides)`."""
        return default_settings(self.run_config, **overrides)

    def meta(self) -> dict:
        """What the sidecars record about the model."""
        return {"checkpoint": self.step_dir, "step": self.step, "weights": self.weights, "vae": self.specs.get("vae"),
                "text_encoder": self.specs.get("text_encoder"), "model": self.model_config.to_dict(),
                "use_timestep_transform": self.use_timestep_transform, "mesh": dict(self.mesh.shape)}

    def rows(self, batch_size: int, n: int) -> int:
        """Rows of each batch: min(batch_size, n) rounded up to a multiple of the data-parallel size."""
        return -(-max(1, min(int(batch_size), int(n))) // self.dp) * self.dp

    def _cut_text(self, y: np.ndarray, text_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """y [B, 1, L, D], text_mask [B, L] cut to the shortest of the run's `data.text_lengths` that
        holds the prompts (as training cuts its batches; every process holds all prompts, so all cut alike)."""
        lengths = ((self.run_config or {}).get("data") or {}).get("text_lengths", text_length.DEFAULT_LENGTHS)
        n = text_length.length_for(text_mask, lengths)
        return y[:, :, :n], text_mask[:, :n]

    # ---- jitted pieces -----------------------------------------------------------------------
    def _batch(self, ndim: int) -> NamedSharding:
        from jaxsora.parallel.sharding import batch_sharding

        return batch_sharding(self.mesh, ndim)

    def _put(self, x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, self._batch(x.ndim), lambda idx: x[idx])

    def _denoise_init_impl(self, state, key_data, loop_i, y, text_mask, fps, height, width, mask, x_cond, *,
                           latent_shape):
        """→ (carry, cond2, renoise keys): the sampler's state before step 0 (`rflow.sample_init`),
        the initial noise drawn from each prompt's key."""
        from jaxsora.diffusion import rflow

        model = nnx.merge(self.graphdef, state)
        keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), loop_i))(key_data)
        z = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 0), latent_shape, jnp.float32))(keys)
        z = jax.lax.with_sharding_constraint(z, self._batch(z.ndim))
        renoise = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        null_y = model.y_embedder.y_embedding[...][: y.shape[-2]]  # the prompts' tokens may be cut (_cut_text)
        cond = dict(y=y, mask=text_mask, fps=fps, height=height, width=width)
        carry, cond2 = rflow.sample_init(z, cond, null_y, mask=mask, x_cond=x_cond)
        return carry, cond2, renoise

    def _denoise_impl(self, state, carry, cond2, renoise, ts, mask, cfg_scale, start, stop):
        """Sampling steps start..stop−1 (`rflow.sample_steps`; start/stop are traced, so one program
        serves the whole loop and the step-by-step loop of the progress bar)."""
        from jaxsora.diffusion import rflow

        self.trace_counts["denoise"] += 1
        model = nnx.merge(self.graphdef, state)
        ts = jnp.broadcast_to(ts[:, None], (ts.shape[0], carry[0].shape[0]))
        return rflow.sample_steps(model, carry, cond2, renoise, ts, mask=mask, cfg_scale=cfg_scale, start=start,
                                  stop=stop)

    def _vae(self, vae_state):
        return nnx.merge(self._vae_graphdef, vae_state) if self._vae_graphdef is not None else self.vae

    def _decode_impl(self, vae_state, z, *, num_frames):
        self.trace_counts["decode"] += 1
        return self._vae(vae_state).decode(z, num_frames)

    def _encode_impl(self, vae_state, video):
        self.trace_counts["encode"] += 1
        return self._vae(vae_state).encode_mean(video)

    def _to_uint8_impl(self, video):
        """[B, 3, T, H, W] in [-1, 1] → [B, T, H, W, 3] uint8 as the reference's save_sample:
        clamp, (x + 1)/2, ·255 + 0.5, truncate."""
        v = (jnp.clip(video.astype(jnp.float32), -1, 1) + 1) / 2
        return jnp.clip(jnp.floor(v * 255 + 0.5), 0, 255).astype(jnp.uint8).transpose(0, 2, 3, 4, 1)

    def _fetch(self, x) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def encode_video(self, video: np.ndarray) -> np.ndarray:
        """[B, 3, T, H, W] in [-1, 1] → latents [B, C, t, h, w] (the posterior mean)."""
        with jax.set_mesh(self.mesh):
            return self._fetch(self._encode(self.vae_state, jnp.asarray(video, jnp.float32)))

    # ---- sampling ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str], settings: SampleSettings | None = None, progress: bool = True
                 ) -> list[np.ndarray]:
        """One video [T, H, W, 3] uint8 per prompt (T = num_frames, or more with loops; H, W the
        requested size — with the OpenSora VAE rounded down to a multiple of 8, as the reference)."""
        from tqdm.auto import tqdm

        from jaxsora.diffusion import rflow

        settings = settings if settings is not None else SampleSettings()
        if isinstance(prompts, str):
            raise BadInput("generate: prompts must be a list of strings, got one string")
        prompts = [str(p) for p in prompts]
        res = settings.validate(self.extra_resolutions)
        n = len(prompts)
        if n == 0:
            return []
        texts, refs, strategies = [], [], []
        ref_all = opt.per_prompt(settings.reference_path, n, "reference_path")
        ms_all = opt.per_prompt(settings.mask_strategy, n, "mask_strategy")
        for i, p in enumerate(prompts):
            text, info = opt.extract_json(p)
            texts.append(text)
            refs.append(str(info.get("reference_path", ref_all[i]) or ""))
            strategies.append(str(info.get("mask_strategy", ms_all[i]) or ""))
            opt.check_references(strategies[-1], refs[-1], settings.loop, where=f" (prompt {i})")
            opt.split_prompt(text)
        fed = [opt.prepare_prompt(t, settings.aes, settings.flow, settings.camera_motion) for t in texts]
        occ = prompt_occurrences(prompts)
        base_keys = np.stack([np.asarray(jax.random.key_data(prompt_key(settings.seed, p, k)))
                              for p, k in zip(prompts, occ)])

        H, W, T = res.height, res.width, res.num_frames
        lt, lh, lw = self.vae.get_latent_size((T, H, W))
        latent_shape = (int(self.vae.out_channels), int(lt), int(lh), int(lw))
        align = settings.align if settings.align is not None else self.align
        loop, cfl = int(settings.loop), int(settings.condition_frame_length)
        drop = cond_pixel_frames(self.vae, cfl) if loop > 1 else 0
        fps_model = float(opt.IMG_FPS if T == 1 else settings.fps)
        steps = int(settings.num_sampling_steps)
        ts = np.asarray(rflow.sampling_timesteps(steps, H, W, T, self.use_timestep_transform))[:, 0]
        rows = self.rows(settings.batch_size, n)
        bs = int(settings.batch_size)
        ref_cache: dict = {}
        # Multi-host: the bars show on process 0 only; the others run the same calls (a disabled bar).
        shown = jax.process_index() == 0
        bar = tqdm(total=n, unit="prompt", desc="prompts") if progress and shown else None
        out: list = [None] * n
        with jax.set_mesh(self.mesh):
            rep = NamedSharding(self.mesh, PartitionSpec())
            ts_dev = jax.device_put(jnp.asarray(ts, jnp.float32), rep)
            cfg_dev = jax.device_put(jnp.asarray(float(settings.cfg_scale), jnp.float32), rep)
            full = lambda v: self._put(np.full((rows,), v, np.float32))  # noqa: E731
            fps_dev, h_dev, w_dev = full(fps_model), full(H), full(W)
            for start in range(0, n, bs):
                chunk = list(range(start, min(start + bs, n)))  # len(chunk) ≤ rows
                padded = chunk + [chunk[-1]] * (rows - len(chunk))
                sample_refs = [[self._reference(p, H, W, ref_cache) for p in refs[j].split(";")] if refs[j] else []
                               for j in padded]
                sample_ms = [strategies[j] for j in padded]
                keys_dev = self._put(base_keys[padded])
                clips = []
                for loop_i in range(loop):
                    if loop_i > 0:  # the previous clip's last latent frames condition this one (append_generated)
                        prev = self._fetch(self._encode(self.vae_state, clips[-1]))
                        for r in range(rows):
                            sample_refs[r].append(prev[r])
                            sample_ms[r] = (sample_ms[r] + ";" if sample_ms[r] else "") + (
                                f"{loop_i},{len(sample_refs[r]) - 1},-{cfl},0,{cfl},{settings.condition_frame_edit}")
                    y, tmask = self.text_encoder.encode([opt.extract_prompt_loop(fed[j], loop_i) for j in padded])
                    y, tmask = self._cut_text(np.asarray(y), np.asarray(tmask))
                    mask, x_cond = build_condition(sample_ms, sample_refs, loop_i, latent_shape, align)
                    mask_dev = None if mask is None else self._put(mask)
                    carry, cond2, renoise = self._denoise_init(
                        self.state, keys_dev, jnp.int32(loop_i), self._put(y), self._put(tmask.astype(np.int32)),
                        fps_dev, h_dev, w_dev, mask_dev, None if x_cond is None else self._put(x_cond),
                        latent_shape=latent_shape)
                    step_args = (cond2, renoise, ts_dev, mask_dev, cfg_dev)
                    self._last_denoise = (self.state, carry) + step_args
                    step_bar = tqdm(total=steps, desc="sampling", leave=False, disable=not shown) if progress else None
                    z, _ = rflow.run_steps(lambda c, a, b: self._denoise(self.state, c, *step_args, a, b),  # noqa: B023
                                           carry, steps, step_bar)
                    if step_bar is not None:
                        step_bar.close()
                    clips.append(self._decode(self.vae_state, z, num_frames=T))
                frames = [self._fetch(self._to_uint8(c)) for c in clips]
                video = np.concatenate([f if i == 0 else f[:, drop:] for i, f in enumerate(frames)], axis=1)
                video = video[:, :, :H, :W]
                for r, j in enumerate(chunk):
                    out[j] = np.ascontiguousarray(video[r])
                if bar is not None:
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return out

    def last_denoise_hlo(self) -> str:
        """The compiled HLO of the last sampling call (to check what runs: e.g. the all-to-alls of
        sequence parallelism). Traces once more."""
        with jax.set_mesh(self.mesh):
            return self._denoise.lower(*self._last_denoise, 0, 1).compile().as_text()

    def _reference(self, path: str, height: int, width: int, cache: dict) -> np.ndarray:
        """Latents [C, t, h, w] of one reference file (encoded once per generate call)."""
        key = (path, height, width)
        if key not in cache:
            video = read_reference(path, height, width)
            cache[key] = self.encode_video(video[None])[0]
        return cache[key]
