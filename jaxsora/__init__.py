"""jaxsora: Open-Sora 1.2 (STDiT3, rectified flow, bucketed video data) in JAX/Flax."""
import flax

# Parameters carry *logical* sharding names (embed, heads, mlp, ...) that jaxsora.parallel.mesh
# maps to mesh axes when it places the train state. Flax ≥ 0.12 would otherwise try to shard each
# variable eagerly at creation with those names as if they were mesh axes.
flax.config.update("flax_always_shard_variable", False)

__version__ = "0.1.0"
