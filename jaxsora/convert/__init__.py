"""STDiT3 weights between jaxsora (orbax) and PyTorch (Open-Sora 1.2 / PixArt-Σ state dicts).

CLI: `python -m jaxsora.convert to-torch CKPT OUT.{safetensors,pth} [--ema] [--dtype bf16]` and
`python -m jaxsora.convert from-torch IN.{pth,safetensors} OUT --model STDiT3-XL/2`.
"""
from jaxsora.convert.native import load_model, load_weights, save_weights
from jaxsora.convert.torch import (
    LoadReport,
    from_torch_state_dict,
    load_torch_state_dict,
    read_state_dict,
    save_torch_state_dict,
    to_torch_state_dict,
    torch_shapes,
)

__all__ = [
    "to_torch_state_dict", "from_torch_state_dict", "load_torch_state_dict", "read_state_dict",
    "save_torch_state_dict", "torch_shapes", "LoadReport", "save_weights", "load_weights", "load_model",
]
