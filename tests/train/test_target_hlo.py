"""The step compiled for 8 H100s by XLA:GPU on this CPU machine (`--target h100x8`), read in its optimized HLO:
what no number on a CPU shows. STDiT3-XL/2's widths (1152 wide, 16 heads of 72) two block pairs deep, bf16, at
stage 1's 240p bucket (30×53 latents: 15×27 = 405 spatial tokens, 15 latent frames), FSDP over the 8 GPUs:

- attention is cuDNN's fused flash kernel, and no [N, N] score tensor of the spatial or temporal attention exists;
- a bf16 step runs no GEMM on f32 operands;
- full remat's recomputation is there (its matmul FLOPs exceed no remat's by the blocks' forward), and the
  HLO's FLOP count of the step agrees with plan/mfu.py's formula;
- the FSDP collectives are those the sharding implies: the gradients reduce-scattered (each device keeps 1/8),
  the parameters all-gathered, nothing parameter-sized all-reduced.

Needs the GPU compiler (`make plan-gpu`, part of `make install`); skipped, saying so, without it. Each program is
compiled once per machine: its HLO is kept beside the plan cache (`train.plan.target_cache`)."""
import os

import pytest

from jaxsora.parallel import compile_options, targets
from jaxsora.train.plan import hlo, mfu, target_cache
from jaxsora.train.run.setup import setup_run
from tests.train.common import small_config

TARGET = "h100x8"
PIXELS = (15, 240, 426)  # 15 frames at 240p 9:16; the identity VAE at 1×8×8: latents 15×30×53
GLOBAL_BATCH = 8

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(targets.compiler_dir("gpu"), "jax_plugins")),
    reason=f"the GPU compiler is not installed ({targets.compiler_dir('gpu')}): make plan-gpu")


def _setup(tmp, remat):
    c = small_config(tmp, mesh=(1, -1, 1))
    c.model.update(dict(name="STDiT3-XL/2", depth=2, hidden_size=None, num_heads=None, compute_dtype="bfloat16",
                        attention_impl="auto", remat=remat, scan_blocks=False))
    c.vae.downsample = (1, 8, 8)
    c.text_encoder.update(dict(model_max_length=300, dtype="bfloat16"))  # T5 in bf16, as the stage configs
    c.train.target = TARGET
    return setup_run(c, abstract_encoders=True)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """remat → (setup, optimized HLO text) of the step at the bucket."""
    out = {}
    for remat in ("none", "full"):
        setup = _setup(tmp_path_factory.mktemp(remat), remat)
        lowered = setup.step.lower(setup.batch_spec(PIXELS, GLOBAL_BATCH), setup.encoders.weights)
        target = targets.target_of(setup.mesh)
        out[remat] = setup, target_cache.optimized_hlo(lowered, target, compile_options.of_mesh(setup.mesh))
    return out


def test_the_target_picks_cudnn_and_its_compiler_options(programs):
    setup, _ = programs["none"]
    assert targets.platform_of(setup.mesh) == "gpu" and setup.mesh.size == 8
    assert setup.model_config.attention_impl == "cudnn"  # "auto" followed the target, not this CPU
    assert compile_options.of_mesh(setup.mesh)["xla_gpu_enable_triton_gemm"] is False


def test_attention_is_cudnn_flash_without_a_score_tensor(programs):
    for remat, (_setup, text) in programs.items():
        f = hlo.facts(text)
        assert f.custom_calls.get("__cudnn$fmhaSoftmax", 0) >= 2, (remat, f.custom_calls)  # spatial and temporal
        assert f.custom_calls.get("__cudnn$fmhaSoftmaxBackward", 0) >= 2, (remat, f.custom_calls)
        heads = 16
        for n in (405, 406, 15, 16):  # the attended lengths, padded to even for cuDNN: no [..., heads, N, N]
            scores = [i.name for i in f.instrs for _, dims in i.shapes if dims[-3:] == (heads, n, n)]
            assert not scores, (remat, n, scores[:5])


def test_a_bf16_step_runs_no_f32_gemm(programs):
    _, text = programs["none"]
    comps, _ = hlo.parse(text)
    gemms = 0
    for instrs in comps.values():
        table = {i.name: i for i in instrs}
        for i in instrs:
            if i.op == "custom-call" and i.target() in ("__cublas$gemm", "__cublas$lt$matmul"):
                gemms += 1
                operand_types = {table[o].dtype for o in i.operands[:2] if o in table}
                assert operand_types == {"bf16"}, (i.name, operand_types, i.dims)
    assert gemms > 20, gemms


def test_full_remat_recomputes_the_blocks_forward_and_the_count_matches_the_formula(programs):
    setup, none_text = programs["none"]
    _, full_text = programs["full"]
    cfg = setup.model_config
    latent = setup.encoders.latent_size(PIXELS)
    per_device = GLOBAL_BATCH / setup.mesh.size
    model = mfu.train_flops_per_sample(cfg, latent) * per_device
    none, full = hlo.matmul_flops(none_text), hlo.matmul_flops(full_text)
    # no remat: the compiled matmuls are the formula's, and a little more: cuDNN's backward recomputes the scores
    # (5 matmuls where the formula counts 4) and each odd sequence gets one padding token (measured: 1.020 ×)
    assert model <= none <= 1.04 * model, (none / model)
    # full remat: the blocks' forward once more (measured: 1.008 × the formula's forward)
    forward = mfu.forward_flops(cfg, latent, cfg.model_max_length) * per_device
    assert 0.95 * forward <= full - none <= 1.05 * forward, ((full - none) / forward)


def test_fsdp_reduce_scatters_the_gradients_and_gathers_the_params(programs):
    setup, text = programs["none"]
    f = hlo.facts(text)
    params = sum(int(x.size) for x in __import__("jax").tree.leaves(setup.plan.abstract.params))
    scattered = sum(__import__("math").prod(d) for _, d in f.collectives["reduce-scatter"])
    gathered = sum(__import__("math").prod(d) for _, d in f.collectives["all-gather"])
    reduced = sum(__import__("math").prod(d) for _, d in f.collectives["all-reduce"])
    # every gradient leaves the backward in its 1/8 shard: the shards add up to the trainable parameters (XLA may
    # keep a few small vectors whole), and the forward and backward gather each parameter
    assert 0.9 * params / 8 <= scattered <= 1.1 * params / 8, (scattered, params)
    assert gathered >= 0.9 * params, (gathered, params)
    assert reduced < 0.01 * params, (reduced, params)  # scalars and norms, never a gradient
