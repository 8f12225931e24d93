"""The Flax settings every model module needs before it creates a variable; each of them imports this.

Parameters carry *logical* sharding names (embed, heads, mlp, ...) that jaxsora.parallel maps to mesh axes
when it places the train state. Flax ≥ 0.12 would otherwise try to shard each variable eagerly at creation
with those names as if they were mesh axes. (Not in the package roots, so that data-loading worker processes
and the config files import no JAX.)"""
import flax

flax.config.update("flax_always_shard_variable", False)
