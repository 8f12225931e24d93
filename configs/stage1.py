"""Open-Sora 1.2 stage 1 (upstream train/stage1.py): 144p–360p video + images, lr 1e-4, warmup 1000,
masks 0.80 identity."""
from configs import base


def get_config():
    c = base.get_config()
    c.train.experiment = "stage1"
    c.train.epochs = 1000  # the stage file's `epochs = 1000`: in practice train.max_steps ends the run
    return c
