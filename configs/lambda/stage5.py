"""Lambda stage 5 (Lambda's lambda/stage5.py): stage-2 buckets, no masking, one-cycle as stage 4.
Init: --ckpt-path <stage-4 ckpt>"""
import importlib

from configs import stage2 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage5", epochs=10, lr=1.6e-4, one_cycle=(1.6e-5, 6.4e-4), no_masks=True)
