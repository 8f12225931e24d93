"""Open-Sora 1.2 config files, run as they are: the mmengine-style reader (`reader`), the machinery of the key
maps (`mapping`), the train-key map (`train`), the inference-key map (`inference`) and the jaxsora config file
writer (`translate`). Imports no jax, flax, optax, orbax or torch: a mistake in such a file is answered at once."""
from jaxsora.opensora_config.mapping import Translation
from jaxsora.opensora_config.reader import is_opensora_config, read_config
from jaxsora.opensora_config.train import TRAIN_KEYS, translate_train

__all__ = ["TRAIN_KEYS", "Translation", "is_opensora_config", "read_config", "translate_train"]
