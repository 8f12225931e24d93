"""Model layers: STDiT3, the VAEs and T5, in Flax NNX.

The package itself imports nothing heavy, so that a config (configs/*.py reads `text_defaults`) loads without
jax or flax; every module that creates Flax variables imports `_flax` (the settings they need) first."""
