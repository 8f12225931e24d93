"""The train state: what it holds, how it is sharded, and how it comes into existence on the mesh.

`TrainState` = step, trainable params, frozen variables (frozen Params and Buffers), optimizer
state, EMA of the params and the RNG key. Every array is created directly in its shard:

- `StatePlan` traces the model's construction once (blocks are built in nested traces, see
  `models.stdit3`), which gives the graphdef, the abstract state and, from the logical axis
  names on each parameter, the state's shardings — no array is allocated.
- `init_state_sharded` runs that initialization as one jitted program whose outputs are the
  shards (no full copy on any device or host).
- `state_from_weights` builds the optimizer state and EMA for loaded weights (`--ckpt-path`) on
  the mesh; the weights themselves are read shard by shard by `jaxsora.convert.sharded`, and only
  what a file lacks is initialized (`init_variables_sharded`).
- Restoring (`--load`) reads each shard from the checkpoint into its target sharding
  (`jaxsora.checkpoint.restore` with `plan.abstract_sharded`).

LoRA (`plan.lora`, see `jaxsora.models.lora`): the model is built, then its targeted Linears are
wrapped (in the same trace); the trainable params are then the adapters alone, so the optimizer
state and the EMA hold adapters only and the whole base model (its Params, unchanged paths) is in
`frozen`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxsora.models import lora as lora_lib
from jaxsora.models.config import STDiT3Config
from jaxsora.models.stdit3 import STDiT3
from jaxsora.parallel.sharding import abstract_with_shardings, constrain_tree, tree_shardings


@struct.dataclass
class TrainState:
    step: jax.Array  # optimizer steps applied (int32)
    params: Any  # nnx.State of the trainable Params
    frozen: Any  # nnx.State of everything else in the model (frozen Params, Buffers)
    opt_state: Any
    ema: Any  # nnx.State, float32, same tree as params
    rng: jax.Array  # raw key data (uint32), so orbax stores it as a plain array


def split_model(model: STDiT3):
    """(graphdef, trainable state, frozen state). A model with LoRA adapters trains only them."""
    return nnx.split(model, lora_lib.trainable_filter(model), ...)


def build_model(config: STDiT3Config, seed: int, lora: lora_lib.LoRASpec | None = None) -> STDiT3:
    """The model of a plan: STDiT3 from `seed`, with the LoRA adapters of `lora` (None: none)."""
    model = STDiT3(config, rngs=nnx.Rngs(seed))
    if lora is not None:
        lora_lib.apply_lora(model, lora, seed=seed)
    return model


def _state_from(params, frozen, tx: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        frozen=frozen,
        opt_state=tx.init(params),
        ema=jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params),  # not an alias: both are donated
        rng=jax.random.key_data(jax.random.key(seed)),
    )


@dataclasses.dataclass
class StatePlan:
    """The train state of `config` on `mesh`, before any array exists."""

    config: STDiT3Config
    tx: optax.GradientTransformation
    seed: int
    mesh: jax.sharding.Mesh
    rules: tuple
    graphdef: Any
    abstract: TrainState  # ShapeDtypeStructs (inside nnx Variables, with their logical names)
    shardings: TrainState  # a NamedSharding per leaf
    traced_init: Any = None  # the traced initialization (`jax.stages.Traced`), compiled only if used
    lora: lora_lib.LoRASpec | None = None  # LoRA adapters (only they are trained), or None
    compiled_init: Any = dataclasses.field(default=None, repr=False)  # traced_init compiled, once it has run

    @property
    def abstract_sharded(self) -> TrainState:
        """ShapeDtypeStructs carrying the target shardings (restore targets, AOT compiles)."""
        return abstract_with_shardings(self.abstract, self.shardings)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def _model(self) -> STDiT3:
        return build_model(self.config, self.seed, self.lora)


def use_threefry_kernel_on_gpu() -> None:
    """Lower jax's threefry PRNG to its CUDA kernel on GPUs (`jax_threefry_gpu_kernel_lowering`): the same
    bits as the default inline lowering, which XLA:GPU compiles anew for every initializer — a fresh
    STDiT3-XL/2 state took 65 s to compile and run on an H200 (jax 0.11.2), 11 s with the kernel, and the
    train step's time and compile time did not move (bench/gpu_step.sh). No effect on other backends; a jax
    that no longer has the option keeps its own lowering."""
    with contextlib.suppress(AttributeError):
        jax.config.update("jax_threefry_gpu_kernel_lowering", True)


def plan_state(config: STDiT3Config, tx: optax.GradientTransformation, seed: int, mesh: jax.sharding.Mesh,
               rules, lora: lora_lib.LoRASpec | None = None) -> StatePlan:
    """Trace the initialization once: it yields the graphdef, the abstract state and — from the
    logical names each parameter carries — the shardings, which the traced program applies to its
    own outputs. Nothing is allocated; `init_state_sharded` compiles and runs that same trace (on a
    GPU with jax's threefry kernel: `use_threefry_kernel_on_gpu`)."""
    use_threefry_kernel_on_gpu()
    box = {}

    def init():
        graphdef, params, frozen = split_model(build_model(config, seed, lora))
        state = _state_from(params, frozen, tx, seed)
        box["graphdef"], box["shardings"] = graphdef, tree_shardings(state, mesh, rules)
        return constrain_tree(state, box["shardings"])

    with jax.set_mesh(mesh):
        traced = jax.jit(init).trace()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), traced.out_info)
    return StatePlan(config, tx, seed, mesh, rules, box["graphdef"], abstract, box["shardings"], traced, lora)


def init_state_sharded(plan: StatePlan) -> TrainState:
    """A freshly initialized state, each array computed directly in its shard (the plan's trace)."""
    with jax.set_mesh(plan.mesh):
        if plan.compiled_init is None:  # kept: a plan reused by a later run of the process (`setup_run`)
            plan.compiled_init = plan.traced_init.lower().compile()
        return plan.compiled_init()


def model_variables(tree) -> dict:
    """{NNX path: leaf} of the params and frozen variables of a TrainState-shaped tree."""
    return {tuple(path): v.get_value() for sub in (tree.params, tree.frozen) for path, v in nnx.to_flat_state(sub)}


def init_variables_sharded(plan: StatePlan, paths) -> dict:
    """{NNX path: array} of the fresh initialization of just these model variables, each in its
    shard — what a partial weight file lacks. The other initializers are dead code XLA drops."""
    paths = set(paths)
    if not paths:
        return {}
    shardings = {p: s for p, s in model_variables(plan.shardings).items() if p in paths}

    def init():
        _, params, frozen = split_model(plan._model())
        values = {tuple(path): v.get_value() for sub in (params, frozen) for path, v in nnx.to_flat_state(sub)}
        return constrain_tree({p: values[p] for p in shardings}, shardings)

    with jax.set_mesh(plan.mesh):
        return jax.jit(init, out_shardings=shardings)()


def with_variables(plan: StatePlan, values: dict) -> tuple[Any, Any]:
    """(params, frozen) nnx.States of the plan's structure holding `values` {NNX path: array}."""
    def fill(abstract):
        return nnx.from_flat_state([(path, v.replace(values[tuple(path)])) for path, v in nnx.to_flat_state(abstract)])

    return fill(plan.abstract.params), fill(plan.abstract.frozen)


def state_from_weights(plan: StatePlan, params, frozen) -> TrainState:
    """Step 0, fresh optimizer state, EMA = the weights: `--ckpt-path`. Runs on the mesh."""
    def complete(params, frozen):
        return constrain_tree(_state_from(params, frozen, plan.tx, plan.seed), plan.shardings)

    with jax.set_mesh(plan.mesh):
        return jax.jit(complete, out_shardings=plan.shardings, donate_argnums=(0, 1))(params, frozen)
