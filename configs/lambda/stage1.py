"""Lambda speed run stage 1 (Lambda's lambda/stage1.py): official stage-1 buckets/masks, lr 1.6e-4, LinearWarmup 400,
wd 0.01. Init: --ckpt-path pretrained_models/PixArt-Sigma-XL-2-2K-MS.pth"""
import importlib

from configs import stage1 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage1", epochs=5, lr=1.6e-4, warmup=400)
