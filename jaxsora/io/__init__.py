"""Weights I/O: `weights` reads any weights file or folder lazily, `fill` puts a state dict into an
NNX module; the name maps live beside each model family (models/t5.py, models/vae.py,
convert/torch.py)."""
