"""STDiT3 (Open-Sora 1.2's spatial-temporal diffusion transformer) in Flax NNX.

Computes what `opensora/models/stdit/stdit3.py` computes at the reference tag (v1.2.0):
PatchEmbed3D → + 2D sin/cos pos-emb → `depth` × (spatial block, temporal block) → T2IFinalLayer
→ unpatchify. The module tree mirrors the PyTorch one (see `jaxsora.convert`).

Layout inside: tokens are kept as [B, T, S, C] (S = H·W patches, row-major), so spatial attention
runs over rows (B·T, S) and temporal attention over rows (B·S, T) with no packing. The public call
takes and returns the reference layouts.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from flax import nnx

from jaxsora.models import _flax  # noqa: F401 — the Flax settings, before any variable
from jaxsora.models import layers as L
from jaxsora.models.config import REMAT_POLICIES, REMAT_SAVED_NAMES, RematChoice, STDiT3Config  # noqa: F401
from jaxsora.parallel.constraints import constrain

# Open-Sora 1.2 inference default fps (configs/opensora-v1-2/inference/sample.py), used when the
# caller passes none; the VAE's 8× spatial factor gives the default pixel height/width.
DEFAULT_FPS = 24.0
VAE_SPATIAL_FACTOR = 8


class CaptionEmbedder(nnx.Module):
    """y_proj (timm Mlp, GELU-tanh) over T5 states, with the learned null caption `y_embedding`.

    Caption dropout (CFG training) replaces a sample's whole caption by `y_embedding` but keeps
    its text mask, as the reference does (`CaptionEmbedder.token_drop`). Captions may be shorter than
    `model_max_length` (cut to the batch's valid tokens); the null caption is cut with them.
    """

    def __init__(self, cfg: STDiT3Config, *, rngs, dtype):
        c, cc = cfg.hidden_size, cfg.caption_channels
        self.y_proj = L.Mlp(cc, c, c, ("caption", "embed"), ("embed", None), rngs=rngs, dtype=dtype)
        # Reference: randn(token_num, in_channels) / sqrt(in_channels), a persistent buffer.
        y0 = jax.random.normal(rngs.params(), (cfg.model_max_length, cc), jnp.float32) / math.sqrt(cc)
        self.y_embedding = L.Buffer(y0)
        self.uncond_prob = cfg.class_dropout_prob
        self.dtype = dtype

    def __call__(self, caption, *, dropout_key=None, force_drop_ids=None):
        """caption: [B, 1, L, Cc] → [B, L, C]."""
        caption = caption.astype(self.dtype)
        drop = None
        if force_drop_ids is not None:
            drop = jnp.asarray(force_drop_ids) == 1
        elif dropout_key is not None and self.uncond_prob > 0:
            drop = jax.random.uniform(dropout_key, (caption.shape[0],)) < self.uncond_prob
        if drop is not None:
            null = self.y_embedding[...].astype(self.dtype)
            n = caption.shape[2]
            if n > null.shape[0] or caption.shape[3] != null.shape[1]:
                raise ValueError(
                    f"caption dropout needs captions of shape [B, 1, ≤{null.shape[0]}, {null.shape[1]}] "
                    f"(at most model_max_length tokens), got {tuple(caption.shape)}"
                )
            # A caption cut to its batch's valid tokens (`jaxsora.data.text_length`) keeps the null
            # caption's first n tokens: the text mask lets the model see only those.
            caption = jnp.where(drop[:, None, None, None], null[None, None, :n], caption)
        return self.y_proj(caption[:, 0])


class STDiT3Block(nnx.Module):
    """One spatial or temporal block with adaLN-single modulation (`STDiT3Block`)."""

    def __init__(self, cfg: STDiT3Config, *, temporal: bool, rngs, dtype, attn_impl):
        c = cfg.hidden_size
        self.temporal = temporal
        self.dtype = dtype
        # Reference: randn(6, C) / sqrt(C).
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (6, c), jnp.float32) / math.sqrt(c),
            out_sharding=(None, "embed"),
        )
        self.attn = L.Attention(
            c, cfg.num_heads, qk_norm=cfg.qk_norm, use_rope=temporal, rngs=rngs, dtype=dtype, attn_impl=attn_impl,
            sequence_axis=None if temporal else cfg.sequence_parallel_axis,
        )
        self.cross_attn = L.MultiHeadCrossAttention(c, cfg.num_heads, rngs=rngs, dtype=dtype, attn_impl=attn_impl)
        hidden = int(c * cfg.mlp_ratio)
        self.mlp = L.Mlp(c, hidden, c, ("embed", "mlp"), ("mlp", "embed"), rngs=rngs, dtype=dtype)
        if temporal:  # initialize_weights: each temporal block starts as the identity
            for lin in (self.attn.proj, self.cross_attn.proj, self.mlp.fc2):
                lin.kernel[...] = jnp.zeros_like(lin.kernel[...])

    def __call__(self, x, y, y_lens, t_mlp, t0_mlp, x_mask, spatial_len=None):
        """x: [B, T, S, C]; y: [B, L, C]; y_lens: [B] | None; t_mlp/t0_mlp: [B, 6C]; x_mask: [B, T] | None;
        spatial_len: the real token count when S carries sequence-parallel padding (spatial attention masks the
        rest), else None."""
        b, t, s, c = x.shape
        table = self.scale_shift_table[...].astype(self.dtype)[None]
        mod = (table + t_mlp.reshape(b, 6, c))[:, :, None, None, :]  # [B, 6, 1, 1, C]
        if x_mask is not None:
            # Selecting the modulation vectors per frame equals the reference's t_mask_select of
            # the modulated/gated outputs: the elementwise ops are the same on every element.
            mod0 = (table + t0_mlp.reshape(b, 6, c))[:, :, None, None, :]
            mod = jnp.where(x_mask[:, None, :, None, None], mod, mod0)  # [B, 6, T, 1, C]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (mod[:, i] for i in range(6))

        h = L.modulate(L.layer_norm(x), shift_msa, scale_msa)
        if self.temporal:
            h = rearrange(h, "B T S C -> (B S) T C")
            h = rearrange(self.attn(h), "(B S) T C -> B T S C", B=b)
        else:
            h = self.attn(h.reshape(b * t, s, c), kv_len=spatial_len).reshape(b, t, s, c)
        x = x + gate_msa * h

        x = x + self.cross_attn(x.reshape(b, t * s, c), y, y_lens).reshape(b, t, s, c)

        h = L.modulate(L.layer_norm(x), shift_mlp, scale_mlp)
        x = x + gate_mlp * self.mlp(h)
        return constrain(x, ("batch", "frames", "seq", "embed"))


class T2IFinalLayer(nnx.Module):
    """LayerNorm → modulation with the *raw* t (not t_block) → Linear to patch·out_channels."""

    def __init__(self, cfg: STDiT3Config, *, rngs, dtype):
        c = cfg.hidden_size
        self.scale_shift_table = nnx.Param(
            jax.random.normal(rngs.params(), (2, c), jnp.float32) / math.sqrt(c), out_sharding=(None, "embed")
        )
        self.linear = L.dense(c, int(np.prod(cfg.patch_size)) * cfg.out_channels, ("embed", None),
                              rngs=rngs, dtype=dtype)
        self.fix_double_mod = cfg.fix_final_layer_double_mod
        self.dtype = dtype

    def __call__(self, x, t, x_mask, t0):
        """x: [B, T, S, C]; t/t0: [B, C] → [B, T, S, patch·out]."""
        table = self.scale_shift_table[...].astype(self.dtype)[None]
        shift, scale = (table + t[:, None])[:, :, None, None, :].swapaxes(0, 1)  # each [B, 1, 1, C]
        h = L.modulate(L.layer_norm(x), shift, scale)
        if x_mask is not None:
            shift0, scale0 = (table + t0[:, None])[:, :, None, None, :].swapaxes(0, 1)
            # Reference bug (T2IFinalLayer): the t0 branch re-normalizes the already modulated h.
            base = x if self.fix_double_mod else h
            h0 = L.modulate(L.layer_norm(base), shift0, scale0)
            h = jnp.where(x_mask[:, :, None, None], h, h0)
        return self.linear(h)


def remat_policy(name: str):
    """The `jax.checkpoint` policy of a `remat` setting (None = save nothing, recompute all)."""
    cp = jax.checkpoint_policies
    if name in REMAT_SAVED_NAMES:  # the layers' checkpoint_name'd matmul outputs (models/config.py)
        return cp.save_only_these_names(*REMAT_SAVED_NAMES[name])
    return {"full": None, "dots_saveable": cp.dots_saveable,
            "dots_with_no_batch_dims": cp.dots_with_no_batch_dims_saveable,
            # saved weight-matmul outputs go to pinned host memory and come back for the backward
            "offload": cp.offload_dot_with_no_batch_dims("device", "pinned_host")}[name]


# The remat of the blocks in the current trace when it is not the config's own: the train step traces each
# bucket with the choice its compile plan made for `model.remat="auto"` (jaxsora.train.step.train_step).
_REMAT_OVERRIDE: contextvars.ContextVar[RematChoice | None] = contextvars.ContextVar("jaxsora_remat", default=None)


@contextlib.contextmanager
def remat_override(choice: RematChoice | None):
    """Trace the blocks with `choice` instead of the config's remat/remat_blocks (None: the config's)."""
    token = _REMAT_OVERRIDE.set(choice)
    try:
        yield
    finally:
        _REMAT_OVERRIDE.reset(token)


def effective_remat(cfg: STDiT3Config) -> RematChoice:
    """The remat the blocks are traced with: the override of `remat_override` if one is set, else the
    config's; an unresolved "auto" (a model traced outside the train step's compile plan) runs "full"."""
    choice = _REMAT_OVERRIDE.get()
    if choice is not None:
        return choice
    return RematChoice("full" if cfg.remat == "auto" else cfg.remat, cfg.remat_blocks)


def _pair(spatial, temporal, h, *args):
    """One (spatial, temporal) block pair: x [B, T, S, C] → [B, T, S, C]."""
    return temporal(spatial(h, *args), *args)


@functools.cache
def _traced_block_builder(cfg: STDiT3Config, temporal: bool, dtype_name: str, attn_impl):
    """A jitted block constructor. Inside a trace (eval_shape, a jitted init) each block is then
    built in a trace of its own: flax's Variable updates look up tracer provenance, which costs
    time proportional to the enclosing trace — building 56 blocks in one trace is quadratic
    (15 s for XL/2, 0.3 s this way)."""
    @nnx.jit
    def build(key):
        return STDiT3Block(cfg, temporal=temporal, rngs=nnx.Rngs(params=key), dtype=jnp.dtype(dtype_name),
                           attn_impl=attn_impl)

    return build


def _build_block(cfg, temporal: bool, rngs: nnx.Rngs, dtype, attn_impl) -> STDiT3Block:
    key = rngs.params()  # one key per block, so traced and eager builds draw the same numbers
    if isinstance(key, jax.core.Tracer):
        return _traced_block_builder(cfg, temporal, jnp.dtype(dtype).name, attn_impl)(key)
    return STDiT3Block(cfg, temporal=temporal, rngs=nnx.Rngs(params=key), dtype=dtype, attn_impl=attn_impl)


def sequence_parallel_size(axis: str | None) -> int:
    """Size of the Ulysses mesh axis in the current `jax.set_mesh` context (1 outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh is None or mesh.empty or axis not in mesh.axis_names:
        return 1
    return int(mesh.shape[axis])


class STDiT3(nnx.Module):
    """Open-Sora 1.2 STDiT3. See `__call__` for the inputs (the reference's layouts)."""

    def __init__(self, config: STDiT3Config, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        dt = jnp.dtype(cfg.compute_dtype)
        self.dtype = dt
        attn_impl = L.resolve_attention_impl(cfg.attention_impl, dt, cfg.head_dim)
        c = cfg.hidden_size

        self.rope = L.RotaryEmbedding(cfg.head_dim)
        self.x_embedder = L.PatchEmbed3D(cfg.patch_size, cfg.in_channels, c, rngs=rngs, dtype=dt)
        self.t_embedder = L.TimestepEmbedder(c, rngs=rngs, dtype=dt)
        # initialize_weights: fps_embedder mlp.0 ~ N(0, 0.02), mlp.2 = 0 (fps contributes 0 at init).
        self.fps_embedder = L.TimestepEmbedder(
            c, rngs=rngs, dtype=dt, init_first=L.scaled_normal(0.02), init_last=L.zeros
        )
        self.t_block = nnx.List([L.SiLU(), L.dense(c, 6 * c, ("embed", "adaln"), rngs=rngs, dtype=dt)])
        self.y_embedder = CaptionEmbedder(cfg, rngs=rngs, dtype=dt)
        self.spatial_blocks = nnx.List([_build_block(cfg, False, rngs, dt, attn_impl) for _ in range(cfg.depth)])
        self.temporal_blocks = nnx.List([_build_block(cfg, True, rngs, dt, attn_impl) for _ in range(cfg.depth)])
        self.final_layer = T2IFinalLayer(cfg, rngs=rngs, dtype=dt)

    def _t_block(self, t):
        for layer in self.t_block:
            t = layer(t)
        return t

    def __call__(
        self,
        x: jax.Array,
        timestep: jax.Array,
        y: jax.Array,
        mask: jax.Array | None = None,
        x_mask: jax.Array | None = None,
        fps: jax.Array | None = None,
        height: jax.Array | None = None,
        width: jax.Array | None = None,
        *,
        dropout_key: jax.Array | None = None,
        force_drop_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Predict the velocity (and the unused sigma channels).

        x: [B, C_in, T, H, W] latent; timestep: [B] on 0..1000 (1000 = pure noise);
        y: [B, 1, L, caption_channels] text states; mask: [B, L] 0/1 text mask (valid tokens
        first, as T5 gives), None = all valid; x_mask: [B, T] bool, False = clean condition frame
        (modulated with timestep 0); fps: [B] (default 24); height/width: [B] pixel size (default
        8× the latent size; only sample 0's is used, as in the reference).
        dropout_key: a PRNG key enables caption dropout with `class_dropout_prob` (training);
        force_drop_ids: [B] 1 = use the null caption.
        Returns [B, out_channels, T, H, W] float32.
        """
        cfg = self.config
        dt = self.dtype
        b, _, tx, hx, wx = x.shape
        pt, ph, pw = cfg.patch_size
        t_, h_, w_ = -(-tx // pt), -(-hx // ph), -(-wx // pw)
        s = h_ * w_
        base_size = round(s**0.5)

        if fps is None:
            fps = jnp.full((b,), DEFAULT_FPS, jnp.float32)
        if height is None:
            height = jnp.full((b,), hx * VAE_SPATIAL_FACTOR, jnp.float32)
        if width is None:
            width = jnp.full((b,), wx * VAE_SPATIAL_FACTOR, jnp.float32)
        # Reference: scale = sqrt(height[0]·width[0]) / input_sq_size, from the first sample only.
        scale = jnp.sqrt(jnp.asarray(height[0], jnp.float32) * jnp.asarray(width[0], jnp.float32)) / cfg.input_sq_size
        pos = L.pos_embed_2d(cfg.hidden_size, h_, w_, scale, base_size).astype(dt)  # [1, S, C]

        # The reference casts the timestep (and, via its booster, fps) to the parameter dtype.
        timestep = jnp.asarray(timestep).astype(dt)
        fps_emb = self.fps_embedder(jnp.asarray(fps).astype(dt))
        t = self.t_embedder(timestep) + fps_emb  # [B, C]
        t_mlp = self._t_block(t)  # [B, 6C]
        t0 = t0_mlp = None
        if x_mask is not None:
            x_mask = jnp.asarray(x_mask).astype(bool)
            t0 = self.t_embedder(jnp.zeros_like(timestep)) + fps_emb
            t0_mlp = self._t_block(t0)

        y_emb = self.y_embedder(y, dropout_key=dropout_key, force_drop_ids=force_drop_ids)  # [B, L, C]
        y_lens = L.text_lengths(mask)

        h = self.x_embedder(x.astype(dt))  # [B, T, H, W, C]
        h = h.reshape(b, t_, s, cfg.hidden_size) + pos[:, None]
        # Sequence parallelism splits the S image tokens over the mesh's sequence axis. When S does
        # not divide it (240p: 15×27 = 405 patches), the tokens are zero-padded to a multiple and
        # spatial attention ignores the padding keys; every other layer is per token (or, for
        # temporal attention, per spatial position), so padded tokens never reach real ones.
        sp = sequence_parallel_size(cfg.sequence_parallel_axis)
        s_pad = -(-s // sp) * sp
        if s_pad != s:
            h = jnp.pad(h, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))
        h = constrain(h, ("batch", "frames", "seq", "embed"))

        args = (y_emb, y_lens, t_mlp, t0_mlp, x_mask, s if s_pad != s else None)
        h = self._blocks(h, args)
        h = h[:, :, :s]

        h = self.final_layer(h, t, x_mask, t0)  # [B, T, S, pt·ph·pw·C_out]
        out = rearrange(
            h, "B T (H W) (pt ph pw C) -> B C (T pt) (H ph) (W pw)",
            H=h_, W=w_, pt=pt, ph=ph, pw=pw, C=cfg.out_channels,
        )
        return out[:, :, :tx, :hx, :wx].astype(jnp.float32)

    def _blocks(self, h, args):
        """The `depth` (spatial, temporal) pairs, the first `remat_blocks` rematerialized with the
        configured policy; unrolled, or as one `lax.scan` per remat group (`scan_blocks`)."""
        cfg = self.config
        choice = effective_remat(cfg)
        n_remat = choice.pairs(cfg.depth)
        pairs = list(zip(self.spatial_blocks, self.temporal_blocks))
        groups = [(pairs[:n_remat], True), (pairs[n_remat:], False)]
        for group, remat in groups:
            if not group:
                continue
            if cfg.scan_blocks:
                h = self._scan(group, h, args, remat and choice.policy)
                continue
            run = nnx.remat(_pair, policy=remat_policy(choice.policy)) if remat else _pair
            for spatial, temporal in group:
                h = run(spatial, temporal, h, *args)
        return h

    def _scan(self, pairs, h, args, remat):
        """`lax.scan` over block pairs whose parameters are stacked on the fly (in the compute
        dtype: every block parameter is cast to it where it is used, so the values are the same)."""
        dt = self.dtype
        graphdefs, stacked = [], []
        for i in range(2):
            parts = [nnx.split(pair[i]) for pair in pairs]
            graphdefs.append(parts[0][0])
            stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs).astype(dt), *[p[1] for p in parts]))

        def body(h, states):
            spatial, temporal = (nnx.merge(g, st) for g, st in zip(graphdefs, states))
            return _pair(spatial, temporal, h, *args), None

        if remat:  # the policy's name, or False
            body = jax.checkpoint(body, policy=remat_policy(remat), prevent_cse=False)
        h, _ = jax.lax.scan(body, h, tuple(stacked))
        return h


def param_count(model_or_config) -> int:
    """Number of numbers in the model's state dict (params + buffers), like the reference's."""
    if isinstance(model_or_config, STDiT3Config):
        model = nnx.eval_shape(lambda: STDiT3(model_or_config, rngs=nnx.Rngs(0)))
    else:
        model = model_or_config
    return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Variable)))


def trainable_filter(config: STDiT3Config):
    """nnx filter of the parameters the optimizer updates: every nnx.Param, minus
    `y_embedder.y_proj` when `freeze_y_embedder` (the reference's `STDiT3.__init__` turns off
    `requires_grad` there). Buffers are never trained."""
    if not config.freeze_y_embedder:
        return nnx.Param
    return nnx.All(nnx.Param, nnx.Not(nnx.PathContains("y_proj")))
