"""`Pipeline`: a jaxsora checkpoint + VAE + text encoder on a mesh → videos (Open-Sora 1.2's
`scripts/inference.py`, spec §2.4 and §8).

    pipe = Pipeline.load("outputs/run", step=None, ema=True, vae=None, text_encoder=None)
    videos = pipe.generate(["a red circle moving right"], SampleSettings(image_size=(32, 32), num_frames=8))

Weights only: the params (or the EMA) and the frozen variables — the checkpoint's `params/` (or
`ema/`) and `frozen/` items, or those arrays of an older checkpoint's single `state/` item — are
restored with orbax partial restore straight into their shards (`convert.sharded`) and checked
against its integrity.json; the optimizer state is never read (a copy without `opt_state/` works).

Seeding: the noise of a prompt depends on (seed, the prompt as given, how many times the same
prompt came before it in the list) only — not on its position, the batch size or the other
prompts: key = fold_in(fold_in(key(seed), crc32(prompt) & 0x7fffffff), occurrence); loop i uses
fold_in(key, i); the initial z is drawn from fold_in(·, 0) and the re-noising of edited frames from
fold_in(·, 1) (per sample, see `rflow._step_noise`). Open-Sora instead re-seeds 1024 before every
batch, so its noise depends on the batch.

Mesh: prompts are sharded over the batch axes (data × fsdp); each batch has
`rows = ceil(min(batch_size, #prompts) / dp) · dp` rows (the padding rows repeat the last prompt
and are dropped). With `sequence > 1` the model runs Ulysses sequence parallelism (the model's own
path, as in training). Every distinct (rows, latent shape, conditioned or not) compiles once.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import sys
import zlib
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxsora.errors import BadInput, MissingFile, WeightsError
from jaxsora.infer import options as opt
from jaxsora.infer.options import SampleSettings

CONVERTED_HINT = "pass --vae PATH|identity and --text-encoder PATH|tiny"


class PipelineError(BadInput):
    """A checkpoint / VAE / text encoder combination that cannot sample."""


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def find_step_dir(ckpt: str, step: Optional[int] = None) -> str:
    """A step folder (with weights: `params/`/`ema/`, or the older `state/`) from a run folder, its
    `checkpoints/`, one step folder, or a converter output. Without `step`: the newest step whose
    save finished (a new-format step without integrity.json is skipped with a note on stderr)."""
    from jaxsora.train.checkpoint import INTEGRITY_FILE, checkpoint_steps, has_weights, resolve_checkpoint

    root, chosen = resolve_checkpoint(ckpt, step)
    steps = [chosen] if chosen is not None else list(reversed(checkpoint_steps(root)))
    for s in steps:
        d = os.path.join(root, str(s))
        if not has_weights(d):
            if chosen is not None:
                raise MissingFile(f"{d} holds no weights: no params/ or state/ folder (not a jaxsora checkpoint)")
            continue
        if not os.path.exists(os.path.join(d, INTEGRITY_FILE)) and _checkpoint_format(d) is not None:
            if chosen is not None:
                raise PipelineError(f"{d}: the save did not finish (no {INTEGRITY_FILE})")
            print(f"[jaxsora.sample] skipping step {s}: the save did not finish (no {INTEGRITY_FILE})",
                  file=sys.stderr, flush=True)
            continue
        return d
    raise MissingFile(f"{root} holds no usable checkpoint (no <step>/params or <step>/state folder)")


def _checkpoint_format(step_dir: str):
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            return json.load(f).get("checkpoint_format")
    except (OSError, ValueError, AttributeError):
        return None


def _read_config(step_dir: str) -> dict:
    from jaxsora.convert import native

    cfg = native.read_config(step_dir)
    return cfg.get("config", cfg) if isinstance(cfg, dict) and "model" not in cfg else cfg


# --------------------------------------------------------------------------------------------
# component specs: --vae PATH|identity[:t,h,w]|JSON, --text-encoder PATH|tiny|JSON
# --------------------------------------------------------------------------------------------
def _json_spec(spec: str, flag: str) -> dict:
    try:
        d = json.loads(spec)
    except ValueError as e:
        raise BadInput(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or "kind" not in d:
        raise BadInput(f"{flag}: a JSON spec must be an object with a 'kind'")
    return d


def vae_spec(spec: Union[None, str, Mapping], run_cfg: Optional[Mapping]) -> dict:
    """The VAE config group: None = the run config's; "identity" = pixel space (the run config's
    identity settings when it has them, else no down-sampling), "identity:1,2,2" = with that
    down-sampling; a JSON object = a config group (`{"kind": "opensora", "path": ..., "config":
    "tiny"}` picks a VAE architecture preset); anything else = the OpenSora VAE v1.2 weights path."""
    own = dict(run_cfg.get("vae") or {}) if run_cfg else {}
    if spec is None:
        if not own:
            raise PipelineError(f"the checkpoint has no run config naming a VAE (converted from PyTorch?): "
                                f"{CONVERTED_HINT}")
        return own
    if isinstance(spec, Mapping):
        return dict(spec)
    spec = str(spec)
    if spec.startswith("{"):
        return _json_spec(spec, "--vae")
    if spec == "identity" or spec.startswith("identity:"):
        if spec == "identity":
            return own if own.get("kind") == "identity" else {"kind": "identity", "downsample": [1, 1, 1]}
        try:
            ds = [int(v) for v in spec.split(":", 1)[1].split(",")]
        except ValueError:
            ds = []
        if len(ds) != 3 or min(ds) < 1:
            raise BadInput(f"--vae {spec!r}: expected identity:T,H,W (down-sampling factors, e.g. identity:1,2,2)")
        return {"kind": "identity", "downsample": ds}
    if not os.path.exists(spec):
        raise MissingFile(f"--vae: no such file or folder {spec!r} (give the OpenSora VAE weights, identity or JSON)")
    return {"kind": "opensora", "path": spec, "dtype": own.get("dtype", "bfloat16") if own else "bfloat16"}


def text_encoder_spec(spec: Union[None, str, Mapping], run_cfg: Optional[Mapping], model_cfg) -> dict:
    """The text-encoder config group: None = the run config's; "tiny" = the random byte-level
    encoder (the run config's when it has one, else sized to the model: d_model = its
    caption_channels, model_max_length = its token count); JSON = a config group; anything else =
    a Hugging Face T5 folder."""
    own = dict(run_cfg.get("text_encoder") or {}) if run_cfg else {}
    if spec is None:
        if not own:
            raise PipelineError(f"the checkpoint has no run config naming a text encoder (converted from PyTorch?): "
                                f"{CONVERTED_HINT}")
        return own
    if isinstance(spec, Mapping):
        return dict(spec)
    spec = str(spec)
    if spec.startswith("{"):
        return _json_spec(spec, "--text-encoder")
    if spec == "tiny":
        if own.get("kind") == "tiny":
            return own
        return {"kind": "tiny", "d_model": int(model_cfg.caption_channels), "num_heads": 2, "num_layers": 2,
                "d_ff": 2 * int(model_cfg.caption_channels), "model_max_length": int(model_cfg.model_max_length),
                "seed": 0}
    if not os.path.isdir(spec):
        raise MissingFile(f"--text-encoder: no such folder {spec!r} (give a T5 folder, tiny or JSON)")
    return {"kind": "t5", "path": spec, "model_max_length": int(model_cfg.model_max_length)}


def build_vae(cfg: Mapping):
    """IdentityVAE or OpenSoraVAE from a config group; `config` (a preset name) picks the
    OpenSora VAE architecture (default the real one)."""
    from jaxsora.models import vae as vae_lib
    from jaxsora.train.build import build_vae_from_config

    cfg = dict(cfg)
    try:
        if cfg.get("kind") == "opensora" and cfg.get("config"):
            if not cfg.get("path"):
                raise ValueError("vae kind 'opensora' needs 'path' (the OpenSora-VAE-v1.2 weights)")
            return vae_lib.load_opensora_vae(cfg["path"], dtype=cfg.get("dtype", "float32"), config=cfg["config"])
        return build_vae_from_config(cfg)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise PipelineError(f"VAE {cfg}: {e}") from None


def _build_text_encoder(cfg: Mapping, mesh, rules):
    from jaxsora.train.build import build_text_encoder_from_config

    try:
        return build_text_encoder_from_config(cfg, mesh=mesh, rules=rules)
    except (ValueError, KeyError, FileNotFoundError, OSError) as e:
        raise PipelineError(f"text encoder {dict(cfg)}: {e}") from None


def vae_align(vae) -> int:
    """Latent frames of one VAE chunk: Open-Sora's align = 5 for its VAE (17 frames → 5), 1 for a
    VAE without temporal chunks (the pixel-space one)."""
    cfg = getattr(vae, "config", None)
    if cfg is not None and getattr(cfg, "micro_frame_size", None):
        return int(vae.get_latent_size((cfg.micro_frame_size, None, None))[0])
    return 1


def cond_pixel_frames(vae, latent_frames: int) -> int:
    """Pixel frames covered by `latent_frames` conditioning latents — what the reference's
    `dframe_to_frame` drops from each later loop (5 → 17 for the OpenSora VAE)."""
    cfg = getattr(vae, "config", None)
    if cfg is not None and getattr(cfg, "micro_frame_size", None):
        chunk = vae_align(vae)
        if latent_frames % chunk:
            raise BadInput(f"condition_frame_length must be a multiple of {chunk} latent frames with this VAE "
                           f"(one {cfg.micro_frame_size}-frame chunk), got {latent_frames}")
        return latent_frames // chunk * int(cfg.micro_frame_size)
    return latent_frames * int(getattr(vae, "downsample", (1,))[0])


# --------------------------------------------------------------------------------------------
# seeds
# --------------------------------------------------------------------------------------------
def prompt_hash(prompt: str) -> int:
    return zlib.crc32(prompt.encode("utf-8")) & 0x7FFFFFFF


def prompt_occurrences(prompts: Sequence[str]) -> list[int]:
    """For each prompt, how many times the same string came before it in the list."""
    seen: dict = collections.Counter()
    out = []
    for p in prompts:
        out.append(seen[p])
        seen[p] += 1
    return out


def prompt_key(seed: int, prompt: str, occurrence: int = 0) -> jax.Array:
    """The base key of one prompt (see the module docstring)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(int(seed)), prompt_hash(prompt)), int(occurrence))


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------
def read_reference(path: str, height: int, width: int) -> np.ndarray:
    """An image or video file → [3, T, H, W] float32 in [-1, 1], resized to cover (H, W) and center
    cropped (the reference's "resize_crop": bicubic for images, bilinear for video frames)."""
    from PIL import Image

    from jaxsora.data.video import channels_first, is_video, resize_crop, to_model_range, upright

    if not os.path.isfile(path):
        raise MissingFile(f"--reference-path: no such file {path!r}")
    if is_video(path):
        import av

        try:
            with av.open(path) as container:
                frames, rotation = [], 0.0
                for i, frame in enumerate(container.decode(container.streams.video[0])):
                    if i == 0:
                        rotation = float(getattr(frame, "rotation", 0) or 0)
                    frames.append(frame.to_ndarray(format="rgb24"))
        except Exception as e:  # noqa: BLE001 — av errors: corrupt, unsupported
            raise BadInput(f"--reference-path: cannot decode {path}: {e}") from None
        if not frames:
            raise BadInput(f"--reference-path: {path} has no frames")
        arr = resize_crop(upright(np.stack(frames), rotation), height, width)
    else:
        from PIL import ImageOps

        try:
            with Image.open(path) as im:
                arr = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))[None]
        except Exception as e:  # noqa: BLE001 — PIL errors
            raise BadInput(f"--reference-path: cannot read image {path}: {e}") from None
        arr = resize_crop(arr, height, width, Image.BICUBIC)
    return to_model_range(channels_first(arr))


# --------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------
def default_mesh(dp: Optional[int] = None, sp: int = 1) -> jax.sharding.Mesh:
    from jaxsora.parallel.mesh import make_mesh

    return make_mesh({"data": -1 if dp is None else int(dp), "fsdp": 1, "sequence": int(sp)})


def default_settings(run_config: Optional[Mapping] = None, **overrides) -> SampleSettings:
    """SampleSettings with the run config's `sample` section (height/width, num_frames, fps, and
    aes/flow when it names them) in place of Open-Sora's defaults, then `overrides`."""
    s = dict(((run_config or {}).get("sample") or {}))
    kw: dict[str, Any] = {}
    if s.get("height") and s.get("width"):
        kw["image_size"] = (int(s["height"]), int(s["width"]))
    for k in ("num_frames", "fps", "aes", "flow"):
        if k in s:
            kw[k] = s[k]
    kw.update(overrides)
    return SampleSettings(**kw)


def read_run_config(step_dir: str) -> Optional[dict]:
    """The run config stored with a checkpoint, or None for a converter output (model only)."""
    stored = _read_config(step_dir)
    return stored if isinstance(stored, dict) and ("vae" in stored or "text_encoder" in stored) else None


class Pipeline:
    """A loaded model with its VAE and text encoder, on a mesh. See the module docstring."""

    def __init__(self, model, vae, text_encoder, mesh, *, step: int, step_dir: str, run_config: Optional[dict],
                 weights: str, use_timestep_transform: bool = True, specs: Optional[dict] = None):
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
        self._denoise = jax.jit(self._denoise_impl, static_argnames=("latent_shape", "progress"))
        self._decode = jax.jit(self._decode_impl, static_argnames=("num_frames",))
        self._encode = jax.jit(self._encode_impl)
        self._to_uint8 = jax.jit(self._to_uint8_impl)
        self._last_denoise = None

    # ---- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, ckpt: str, *, step: Optional[int] = None, ema: bool = True, vae=None, text_encoder=None,
             mesh: Optional[jax.sharding.Mesh] = None, dtype: Optional[str] = None) -> "Pipeline":
        """ckpt: a run folder, its checkpoints/, a step folder or a `convert from-torch` output.
        ema: use the EMA weights when the checkpoint has them (else the params, said on stderr).
        vae / text_encoder: None (the run config's) or a spec (see `vae_spec`, `text_encoder_spec`).
        mesh: default all devices on the data axis. dtype: the model's compute dtype (default the
        checkpoint's; "bfloat16"/"float32"; "bf16"/"fp32" accepted)."""
        from jaxsora.convert import sharded
        from jaxsora.models.stdit3 import STDiT3, STDiT3Config
        from jaxsora.parallel.mesh import check_sequence_parallel, logical_rules, sequence_parallel_size
        from jaxsora.parallel.sharding import tree_shardings

        step_dir = find_step_dir(ckpt, step)
        stored = _read_config(step_dir)
        if not isinstance(stored, dict) or "model" not in stored:
            raise PipelineError(f"{step_dir}/config has no 'model' entry (not a jaxsora checkpoint)")
        run_cfg = stored if ("vae" in stored or "text_encoder" in stored) else None
        fields = STDiT3Config.__dataclass_fields__
        mcfg = STDiT3Config(**{k: v for k, v in stored["model"].items() if k in fields})
        mcfg = dataclasses.replace(mcfg, remat="none")
        if dtype is not None:
            dt = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
            if dt not in ("bfloat16", "float32", "float16"):
                raise BadInput(f"--dtype must be bf16, fp32 or fp16, got {dtype!r}")
            mcfg = dataclasses.replace(mcfg, compute_dtype=dt)
        mesh = mesh if mesh is not None else default_mesh()
        rules = logical_rules(mesh)
        check_sequence_parallel(mcfg.num_heads, mesh)
        mcfg = dataclasses.replace(mcfg, sequence_parallel_axis="sequence" if sequence_parallel_size(mesh) > 1
                                   else None)

        # Components first (cheap checks before the weights are read).
        vcfg = vae_spec(vae, run_cfg)
        tcfg = text_encoder_spec(text_encoder, run_cfg, mcfg)
        vae_obj = build_vae(vcfg)
        if int(vae_obj.out_channels) != int(mcfg.in_channels):
            raise PipelineError(f"the VAE gives {vae_obj.out_channels} latent channels but the model takes "
                                f"{mcfg.in_channels} (--vae {vcfg.get('kind')}); use the VAE the model was trained "
                                "with")
        te = _build_text_encoder(tcfg, mesh, rules)
        if te.caption_channels != mcfg.caption_channels or te.model_max_length != mcfg.model_max_length:
            raise PipelineError(f"the text encoder gives {te.model_max_length}×{te.caption_channels} states, the model "
                                f"takes {mcfg.model_max_length}×{mcfg.caption_channels} (--text-encoder)")

        # The model's structure and each variable's sharding, from a trace of its initialization
        # (as train.state.plan_state; nothing is allocated).
        box: dict = {}
        from jaxsora.models import lora

        # A LoRA run's checkpoint: the base (frozen) and the adapters (params / ema) of the same layers.
        lora_spec = lora.LoRASpec.from_config((run_cfg or {}).get("lora"))

        def init():
            m = STDiT3(mcfg, rngs=nnx.Rngs(0))
            if lora_spec is not None:
                lora.apply_lora(m, lora_spec)
            box["graphdef"], st = nnx.split(m)
            box["shardings"] = tree_shardings(st, mesh, rules)
            return st

        with jax.set_mesh(mesh):
            traced = jax.jit(init).trace()
        graphdef, shardings = box["graphdef"], box["shardings"]
        abs_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), traced.out_info)
        flat_abs = nnx.to_flat_state(abs_state)
        flat_sh = dict(nnx.to_flat_state(shardings))
        targets = {}
        for path, v in flat_abs:
            value = v.get_value()
            sh = flat_sh[path]
            sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
            targets[tuple(path)] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sh)
        weights = "ema" if ema else "params"
        from jaxsora.train.orbax_errors import quiet_orbax

        with quiet_orbax(logging.ERROR):  # e.g. no _CHECKPOINT_METADATA in a converter output
            try:
                loaded = sharded.read_native_weights(step_dir, targets, ema=ema)
            except WeightsError as e:
                if not (ema and "no 'ema' entry" in str(e)):
                    raise
                print(f"[jaxsora.sample] {step_dir} has no EMA weights; using the params", file=sys.stderr, flush=True)
                loaded, weights = sharded.read_native_weights(step_dir, targets, ema=False), "params"
        state = nnx.from_flat_state([(path, v.replace(loaded[tuple(path)])) for path, v in flat_abs])
        model = nnx.merge(graphdef, state)
        sched = (run_cfg or {}).get("scheduler") or {}
        step_n = int(os.path.basename(step_dir)) if os.path.basename(step_dir).isdigit() else 0
        return cls(model, vae_obj, te, mesh, step=step_n, step_dir=step_dir, run_config=run_cfg, weights=weights,
                   use_timestep_transform=bool(sched.get("use_timestep_transform", True)),
                   specs={"vae": vcfg, "text_encoder": tcfg})

    # ---- settings ----------------------------------------------------------------------------
    @property
    def extra_resolutions(self) -> Optional[dict]:
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

    # ---- jitted pieces -----------------------------------------------------------------------
    def _batch(self, ndim: int) -> NamedSharding:
        from jaxsora.parallel.sharding import batch_sharding

        return batch_sharding(self.mesh, ndim)

    def _put(self, x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, self._batch(x.ndim), lambda idx: x[idx])

    def _denoise_impl(self, state, key_data, loop_i, y, text_mask, fps, height, width, ts, mask, x_cond, cfg_scale, *,
                      latent_shape, progress):
        from jaxsora.diffusion import rflow

        self.trace_counts["denoise"] += 1
        model = nnx.merge(self.graphdef, state)
        keys = jax.vmap(lambda k: jax.random.fold_in(jax.random.wrap_key_data(k), loop_i))(key_data)
        z = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, 0), latent_shape, jnp.float32))(keys)
        z = jax.lax.with_sharding_constraint(z, self._batch(z.ndim))
        renoise = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        b = z.shape[0]
        ts = jnp.broadcast_to(ts[:, None], (ts.shape[0], b))
        null_y = model.y_embedder.y_embedding[...]
        cond = dict(y=y, mask=text_mask, fps=fps, height=height, width=width)
        return rflow.denoise(model, z, cond, null_y, ts, key=renoise, cfg_scale=cfg_scale, mask=mask, x_cond=x_cond,
                             progress=progress)

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
    def generate(self, prompts: Sequence[str], settings: Optional[SampleSettings] = None, progress: bool = True
                 ) -> list[np.ndarray]:
        """One video [T, H, W, 3] uint8 per prompt (T = num_frames, or more with loops; H, W the
        requested size — with the OpenSora VAE rounded down to a multiple of 8, as the reference)."""
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
        ts = np.asarray(rflow.sampling_timesteps(int(settings.num_sampling_steps), H, W, T,
                                                 self.use_timestep_transform))[:, 0]
        rows = self.rows(settings.batch_size, n)
        bs = int(settings.batch_size)
        ref_cache: dict = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, unit="prompt", desc="prompts")
        step_bar = rflow._HostProgress(int(settings.num_sampling_steps)) if progress else None
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
                    mask, x_cond = build_condition(sample_ms, sample_refs, loop_i, latent_shape, align)
                    args = (self.state, keys_dev, jnp.int32(loop_i), self._put(y), self._put(tmask.astype(np.int32)),
                            fps_dev, h_dev, w_dev, ts_dev, None if mask is None else self._put(mask),
                            None if x_cond is None else self._put(x_cond), cfg_dev)
                    static = dict(latent_shape=latent_shape, progress=step_bar)
                    self._last_denoise = (args, static)
                    z = self._denoise(*args, **static)
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
        args, static = self._last_denoise
        with jax.set_mesh(self.mesh):
            return self._denoise.lower(*args, **static).compile().as_text()

    def _reference(self, path: str, height: int, width: int, cache: dict) -> np.ndarray:
        """Latents [C, t, h, w] of one reference file (encoded once per generate call)."""
        key = (path, height, width)
        if key not in cache:
            video = read_reference(path, height, width)
            cache[key] = self.encode_video(video[None])[0]
        return cache[key]


def build_condition(strategies: Sequence[str], refs: Sequence[Sequence[np.ndarray]], loop_i: int,
                    latent_shape: tuple, align: Optional[int]) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """The edit mask [B, T] (1 = generate, 0 = keep, between = edit strength) and the reference
    latents x_cond [B, C, T, h, w] of one loop, as `apply_mask_strategy`; (None, None) when every
    frame is generated (plain text-to-video: the model then gets no x_mask, which equals all True)."""
    c, t, h, w = latent_shape
    b = len(strategies)
    mask = np.ones((b, t), np.float32)
    x_cond = np.zeros((b, c, t, h, w), np.float32)
    for r, ms in enumerate(strategies):
        for g in opt.parse_mask_strategy(ms):
            if g.loop_id != loop_i:
                continue
            ref = refs[r][g.ref_id]
            if tuple(ref.shape[2:]) != (h, w):
                raise BadInput(f"reference {g.ref_id} has latent size {ref.shape[2:]}, the sample {(h, w)}")
            rs, ts, length = opt.place_group(g, ref.shape[1], t, align)
            x_cond[r, :, ts:ts + length] = ref[:, rs:rs + length]
            mask[r, ts:ts + length] = g.edit_ratio
    if np.all(mask == 1):
        return None, None
    return mask, x_cond


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
def sample_name(index: int, *, prefix: str = "sample", num_sample: int = 1, k: int = 0, prompt: Optional[str] = None
                ) -> str:
    """Open-Sora's get_save_path_name: "sample_0003" (or "<prefix>_0003"), "-k" with num_sample > 1;
    with prompt (prompt_as_path) the prompt itself (made file-safe)."""
    if prompt is not None:
        import re

        base = re.sub(r"[^\w\-. ]+", "_", prompt).strip()[:200] or "sample"
        name = f"{prefix if prefix != 'sample' else ''}{base}"
    else:
        name = f"{prefix}_{index:04d}"
    return f"{name}-{k}" if num_sample != 1 else name


def write_samples(videos: Sequence[np.ndarray], prompts: Sequence[str], settings: SampleSettings, save_dir: str,
                  meta: Optional[dict] = None, *, start_index: int = 0, prefix: str = "sample", num_sample: int = 1,
                  prompt_as_path: bool = False) -> list[str]:
    """Write each video (an mp4 at settings.save_fps or fps; one frame: a png) and a JSON sidecar
    beside it (prompt as given and as fed, seed and noise derivation, every setting, the size
    written, plus `meta`: checkpoint path and step, ...). Returns the media paths.
    With num_sample > 1, prompts are taken as num_sample consecutive copies of each prompt (the
    names get "-k")."""
    from PIL import Image

    from jaxsora.data.video import write_mp4

    if len(videos) != len(prompts):
        raise ValueError(f"write_samples: {len(videos)} videos for {len(prompts)} prompts")
    os.makedirs(save_dir, exist_ok=True)
    try:
        res = settings.validate(None)
    except BadInput:  # a run's custom resolution name: the sidecar still has the size written
        res = None
    fps = float(settings.save_fps if settings.save_fps is not None else settings.fps)
    occ = prompt_occurrences(prompts)
    written = []
    for i, (video, prompt) in enumerate(zip(videos, prompts)):
        video = np.asarray(video)
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise ValueError(f"write_samples: video {i} must be [T, H, W, 3] uint8, got {video.shape} {video.dtype}")
        text, _ = opt.extract_json(prompt)
        k = i % num_sample
        idx = start_index + i // num_sample
        name = sample_name(idx, prefix=prefix, num_sample=num_sample, k=k,
                           prompt=text if prompt_as_path else None)
        base = os.path.join(save_dir, name)
        if video.shape[0] == 1:
            path = base + ".png"
            Image.fromarray(video[0]).save(path)
        else:
            path = write_mp4(video, base + ".mp4", fps)
        record = {
            "media": os.path.basename(path),
            "prompt": prompt,
            "prompt_fed": opt.prepare_prompt(text, settings.aes, settings.flow, settings.camera_motion),
            "seed": int(settings.seed),
            "noise": {"scheme": "fold_in(fold_in(key(seed), crc32(prompt) & 0x7fffffff), occurrence)",
                      "prompt_crc32": prompt_hash(prompt), "occurrence": occ[i]},
            "frames": int(video.shape[0]), "height": int(video.shape[1]), "width": int(video.shape[2]),
            "fps": fps,
            "settings": settings.to_dict(),
            **({"requested": {"num_frames": res.num_frames, "height": res.height, "width": res.width}} if res else {}),
            **(meta or {}),
        }
        with open(base + ".json", "w") as f:
            json.dump(record, f, indent=1, default=_json_default)
        written.append(path)
    return written


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    return str(o)

