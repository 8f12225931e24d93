"""The tiny random text encoder's settings where a config leaves them out — the one place they are set
(`jaxsora.models.t5` builds from them; configs/base.py and the dry run's shapes read them). Free of jax, so
that a config file loads, and a mistake in it is reported, without importing jax."""

TINY_DEFAULTS = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, model_max_length=32, seed=0, dtype="float32")
