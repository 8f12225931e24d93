"""The small training config shared by the loop tests (a ~100k-parameter STDiT3, tiny T5)."""
import os

from configs import demo

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# The fake loader's captions hold 10 tokens, the last of each batch 13 (of 16): with these `data.text_lengths`
# batches run cut to 14 (11 alone), and the trainer compiles each run's step twice (the plan at the full 16, for
# its memory check, then the cut 14 when met). The tests of the cut, the runs they compare with, the
# multi-process runs (which agree on one length) and the run the sampler tests read pass them; the other runs
# train at the planned 16, one compile each.
CUT_LENGTHS = (11, 14)


def small_config(outputs, *, max_steps=6, ckpt_every=3, mesh=(-1, 1, 1), experiment="run", text_lengths=(),
                 **train_kw):
    c = demo.get_config()
    c.data.table = os.path.join(REPO, "pyproject.toml")  # any existing file: the fake loader ignores it
    c.model.update(dict(depth=1, hidden_size=32, num_heads=2))
    c.text_encoder.update(dict(d_model=16, num_layers=1, num_heads=2, d_ff=32, model_max_length=16))
    c.mesh.update(dict(data=mesh[0], fsdp=mesh[1], sequence=mesh[2]))
    c.data.text_lengths = tuple(text_lengths)
    # the rate these tests were sized with (the demo trains at 2e-3), held after the warm-up: the demo's decay
    # follows train.max_steps, which these tests vary between runs that must match (a resume that goes further,
    # a second run that shares the first one's compiled step)
    c.optim.update(dict(lr=1e-3, warmup_steps=2, lr_schedule="linear_warmup", cooldown_steps=0, decay_start=0))
    # the training t these tests were sized with (the demo trains at loc 1.5): at 1.5 the first steps draw t nearer
    # 1000, where the loss is ~3 and the 8-device run's reduction order moved it 1.4e-5 (relative) from 1 device's
    c.scheduler.loc = 1.0
    c.train.update(dict(outputs=str(outputs), experiment=experiment, max_steps=max_steps, ckpt_every=ckpt_every,
                        log_every=1, async_checkpoint=True, **train_kw))
    return c
