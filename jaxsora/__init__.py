"""jaxsora: Open-Sora 1.2 (STDiT3, rectified flow, bucketed video data) in JAX/Flax."""

__version__ = "0.1.0"
