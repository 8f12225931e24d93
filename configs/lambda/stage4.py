"""Lambda stage 4 (Lambda's lambda/stage4.py): stage-1 buckets, no masking, one-cycle cos 1.6e-5 → 6.4e-4 (400 steps)
→ 1.6e-4 (400 steps), then constant. Init: --ckpt-path <stage-3 final checkpoint>"""
import importlib

from configs import stage1 as official

_common = importlib.import_module("configs.lambda._common")  # 'lambda' is a Python keyword


def get_config():
    c = official.get_config()
    return _common.apply(c, experiment="lambda-stage4", epochs=10, lr=1.6e-4, one_cycle=(1.6e-5, 6.4e-4), no_masks=True)
