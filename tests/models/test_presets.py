"""The `model` group → STDiT3Config: the preset `model.name` names, its shape open to overrides
(`--config.model.depth=2`: the base config's placeholders, None meaning the preset's own)."""
import pytest

from configs import demo, stage1
from jaxsora.models.from_config import build_model_config

CHANNELS = dict(in_channels=4, caption_channels=64, model_max_length=8)


@pytest.mark.parametrize("config, depth, hidden, heads", [(stage1, 28, 1152, 16), (demo, 4, 128, 4)])
def test_unset_shape_is_the_presets(config, depth, hidden, heads):
    c = config.get_config()
    assert c.model.depth is None and c.model.hidden_size is None and c.model.num_heads is None
    m = build_model_config(c.model, **CHANNELS)
    assert (m.depth, m.hidden_size, m.num_heads) == (depth, hidden, heads)


def test_set_shape_overrides_the_preset():
    c = demo.get_config()
    c.model.depth, c.model.hidden_size, c.model.num_heads = 1, 64, 2
    m = build_model_config(c.model, **CHANNELS)
    assert (m.depth, m.hidden_size, m.num_heads, m.patch_size) == (1, 64, 2, (1, 2, 2))  # the rest: the preset's
    with pytest.raises(TypeError):
        c.model.depth = "two"  # a placeholder keeps its type (the command line says so in one line)


def test_load_refuses_a_model_of_another_shape(tmp_path):
    """--load with a shape the checkpoint was not trained at: one line before anything compiles (restore
    would otherwise call every step of the run unreadable)."""
    import json
    from types import SimpleNamespace

    from jaxsora.errors import ConfigError
    from jaxsora.train.plan.validate import _check_model_shape

    c = demo.get_config()
    stored = {"name": "demo", **build_model_config(c.model, **CHANNELS).to_dict()}  # as a run records it
    meta = tmp_path / "run" / "checkpoints" / "5" / "config"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(json.dumps({"model": stored}))
    opts = SimpleNamespace(load=str(tmp_path / "run"), step=None)
    _check_model_shape(c, opts)  # the checkpoint's own shape
    c.model.depth = 2
    with pytest.raises(ConfigError, match=r"depth: 4 in the checkpoint, 2 in the config\); resume with"):
        _check_model_shape(c, opts)
    c.model.depth, c.model.name = None, "tiny"
    with pytest.raises(ConfigError, match="depth: 4 in the checkpoint, 2 in the config; hidden_size: 128"):
        _check_model_shape(c, opts)
