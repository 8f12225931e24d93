"""Open-Sora 1.2 stage 2 (upstream train/stage2.py): up to 480p/720p; **no warmup and no lr scheduler**."""
from configs import base

STAGE2_BUCKETS = {
    "144p": base.STAGE1_BUCKETS["144p"],
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 1.0), 5), 408: ((0.5, 1.0), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 1.0), 5), 408: ((0.4, 1.0), 2)},
    "360p": {1: (0.5, 141), 51: (0.15, 8), 102: ((0.3, 0.5), 4), 204: ((0.3, 1.0), 2), 408: ((0.5, 0.5), 1)},
    "512": {1: (0.4, 141), 51: (0.15, 8), 102: ((0.2, 0.4), 4), 204: ((0.2, 1.0), 2), 408: ((0.4, 0.5), 1)},
    "480p": {1: (0.5, 89), 51: (0.2, 5), 102: (0.2, 2), 204: (0.1, 1)},
    "720p": {1: (0.1, 36), 51: (0.03, 1)},
    "1024": {1: (0.1, 36), 51: (0.02, 1)},
    "1080p": {1: (0.01, 5)},
    "2048": {1: (0.01, 5)},
}

# Open-Sora 1.2 stage 2 mask_ratios at ee909a7 (identity = 0.75).
STAGE2_MASKS = {
    "random": 0.005, "intepolate": 0.002, "quarter_random": 0.007, "quarter_head": 0.002, "quarter_tail": 0.002,
    "quarter_head_tail": 0.002, "image_random": 0.0, "image_head": 0.22, "image_tail": 0.005,
    "image_head_tail": 0.005,
}


def get_config():
    c = base.get_config()
    c.train.experiment = "stage2"
    c.train.epochs = 1000  # the stage file's `epochs = 1000`: in practice train.max_steps ends the run
    c.data.bucket_config = STAGE2_BUCKETS
    c.mask_ratios = STAGE2_MASKS
    c.optim.lr_schedule = "constant"
    c.optim.warmup_steps = 0
    return c
