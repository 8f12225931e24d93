"""Lambda stage 6 (Lambda's lambda/stage6.py): stage-3 buckets, no masking, one-cycle 1.6e-5 → 3.2e-4 → 0.8e-4.
Init: --ckpt-path <stage-5 ckpt>"""
import importlib

from configs import stage3 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage6", epochs=10, lr=0.8e-4, one_cycle=(1.6e-5, 3.2e-4), no_masks=True)
