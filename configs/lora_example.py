"""LoRA fine-tuning of a trained STDiT3 (e.g. the released Open-Sora 1.2 weights) on your own data.

    python -m jaxsora.train --config configs/lora_example.py --data-path my_clips.csv \
        --ckpt-path pretrained_models/OpenSora-STDiT-v3/model.safetensors

Stage 3's data recipe (buckets up to 1080p, its frame masks), with rank-16 adapters on every
self- and cross-attention projection of the 56 blocks; the base model stays frozen, so the
optimizer state and the EMA hold the adapters only (13.4M numbers at XL/2 instead of 1.2B).
Export with `python -m jaxsora.tools.lora merge --ckpt-path outputs/<NNN>-lora --output merged/` (a
plain jaxsora checkpoint: sampling, `convert to-torch`) or `export-adapters` (peft-style file).
"""
from configs import stage3


def get_config():
    c = stage3.get_config()
    c.train.experiment = "lora"
    c.lora.update(dict(rank=16, alpha=16.0, dropout=0.0, targets=("attention", "cross_attention"), init="kaiming"))
    # Adapters start at B = 0 (the base's output): a short warmup, the full-training lr, no decay.
    c.optim.update(dict(lr=1e-4, lr_schedule="linear_warmup", warmup_steps=100, weight_decay=0.0))
    c.train.update(dict(max_steps=2000, ckpt_every=200, keep_ckpts=3))
    return c
