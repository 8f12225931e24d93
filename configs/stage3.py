"""Open-Sora 1.2 stage 3 (upstream train/stage3.py): high resolution (720p/1080p), warmup 1000."""
from configs import base

STAGE3_BUCKETS = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: (1.0, 27), 204: (1.0, 13), 408: (1.0, 6)},
    "256": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.5), 2)},
    "240p": {1: (1.0, 297), 51: (0.5, 20), 102: (0.5, 10), 204: (0.5, 5), 408: ((0.5, 0.4), 2)},
    "360p": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.3), 1)},
    "512": {1: (1.0, 141), 51: (0.5, 8), 102: (0.5, 4), 204: (0.5, 2), 408: ((0.5, 0.2), 1)},
    "480p": {1: (1.0, 89), 51: (0.5, 5), 102: (0.5, 3), 204: ((0.5, 0.5), 1), 408: (0.0, None)},
    "720p": {1: (0.3, 36), 51: (0.2, 2), 102: (0.1, 1), 204: (0.0, None)},
    "1024": {1: (0.3, 36), 51: (0.1, 2), 102: (0.1, 1), 204: (0.0, None)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.05, 5)},
}

# Open-Sora 1.2 stage 3 mask_ratios (identity = 0.75).
STAGE3_MASKS = {
    "random": 0.01, "intepolate": 0.002, "quarter_random": 0.002, "quarter_head": 0.002, "quarter_tail": 0.002,
    "quarter_head_tail": 0.002, "image_random": 0.0, "image_head": 0.22, "image_tail": 0.005,
    "image_head_tail": 0.005,
}


def get_config():
    c = base.get_config()
    c.train.experiment = "stage3"
    c.train.epochs = 1000  # the stage file's `epochs = 1000`: in practice train.max_steps ends the run
    c.data.bucket_config = STAGE3_BUCKETS
    c.mask_ratios = STAGE3_MASKS
    return c
