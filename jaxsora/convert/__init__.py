"""STDiT3 weights between jaxsora (orbax) and PyTorch (Open-Sora 1.2 / PixArt-Σ state dicts).

CLI: `python -m jaxsora.convert to-torch CKPT OUT.{safetensors,pth} [--ema] [--dtype bf16]` and
`python -m jaxsora.convert from-torch IN.{pth,safetensors} OUT --model STDiT3-XL/2`.
"""
from jaxsora.lazy_imports import lazy_names

# The names load their modules on first use: `python -m jaxsora.convert` checks its input path before importing jax.
__getattr__, __dir__, __all__ = lazy_names(__name__, {
    "native": ("load_model", "load_weights", "save_weights"),
    "torch": ("LoadReport", "from_torch_state_dict", "load_torch_state_dict", "read_state_dict",
              "save_torch_state_dict", "to_torch_state_dict", "torch_shapes"),
})
