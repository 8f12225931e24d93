"""Lambda stage 7. Its config was never published; the tutorial says stage 7 used "the same
config as Stage 6", started with --ckpt-path (so the one-cycle warm-up runs again). This is stage 6
under its own experiment name. Init: --ckpt-path <stage-6 checkpoint>"""
import importlib

_stage6 = importlib.import_module("configs.lambda.stage6")


def get_config():
    c = _stage6.get_config()
    c.train.experiment = "lambda-stage7"
    return c
