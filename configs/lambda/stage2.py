"""Lambda stage 2 (Lambda's lambda/stage2.py): official stage-2 buckets/masks, lr 1.6e-4, LinearWarmup 400 (unlike the
official stage 2, which has no scheduler), wd 0.01. Init: --ckpt-path <stage-1 final checkpoint>"""
import importlib

from configs import stage2 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage2", epochs=5, lr=1.6e-4, warmup=400)
