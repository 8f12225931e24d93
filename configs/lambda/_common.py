"""LambdaLabs speed-run settings common to stages 1–7 (the Lambda fork's configs): weight decay 0.01, wandb on
(project sora_speedrun), checkpoints every 100 steps, outputs in outputs_speedrun."""


def apply(c, *, experiment, lr, epochs, warmup=None, one_cycle=None, no_masks=False):
    c.train.experiment = experiment
    c.train.epochs = epochs  # the stage file's `epochs` (5 in stages 1-3, 10 in 4-6): the run ends after them
    c.train.outputs = "outputs_speedrun"
    c.train.ckpt_every = 100
    c.optim.weight_decay = 0.01
    c.optim.lr = lr
    c.wandb.enabled = True
    c.wandb.project = "sora_speedrun"
    if one_cycle is not None:  # Lambda OneCycleScheduler: min → max over 400 steps → final (= lr) over 400
        c.optim.lr_schedule = "1cycle"
        c.optim.min_lr, c.optim.max_lr = one_cycle
        c.optim.warmup_steps = 400
        c.optim.cooldown_steps = 400
    elif warmup:
        c.optim.lr_schedule = "linear_warmup"
        c.optim.warmup_steps = warmup
    else:
        c.optim.lr_schedule = "constant"
        c.optim.warmup_steps = 0
    if no_masks:  # stages 4–7: mask_ratios = {"random": 0.0} → identity 1.0
        c.mask_ratios = {"random": 0.0}
    return c
