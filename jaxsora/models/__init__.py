"""Model layers: STDiT3, the VAEs and T5, in Flax NNX."""
import flax

# Parameters carry *logical* sharding names (embed, heads, mlp, ...) that jaxsora.parallel maps to
# mesh axes when it places the train state. Flax ≥ 0.12 would otherwise try to shard each variable
# eagerly at creation with those names as if they were mesh axes. (Set here, not in the package
# root, so that data-loading worker processes import no JAX.)
flax.config.update("flax_always_shard_variable", False)
