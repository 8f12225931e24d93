"""Lambda stage 3 (Lambda's lambda/stage3.py): official stage-3 buckets/masks, lr 2e-4, LinearWarmup 1000
(the config's value; the tutorial says 400 was used generally), wd 0.01. Init: --ckpt-path <stage-2 final checkpoint>"""
import importlib

from configs import stage3 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage3", epochs=5, lr=2e-4, warmup=1000)
