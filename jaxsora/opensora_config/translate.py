"""`python -m jaxsora.config translate OPEN_SORA_CONFIG.py`: the jaxsora config file (`get_config()` on top of
`configs/base.py`) equivalent to an Open-Sora train config. Every value the Open-Sora file decides is written,
commented with the Open-Sora key it comes from; the keys meaningless here and the run flags the file names are
listed in its docstring. It resolves to exactly the config `python -m jaxsora.train OPEN_SORA_CONFIG.py` runs
(the same `Translation` applied to the same base)."""
from __future__ import annotations

import os
import pprint
import textwrap

from jaxsora.opensora_config.mapping import Translation
from jaxsora.opensora_config.train import translate_train

# The translated file's group order (configs/base.py's).
_GROUP_ORDER = ("model", "vae", "text_encoder", "data", "scheduler", "mask_ratios", "optim", "mesh", "train", "lora",
                "wandb", "sample", "eval")
_WIDTH = 120  # the project's line length
_FLAG_SOURCES = {"load": "load", "ckpt_path": "model.from_pretrained", "start_from_scratch": "start_from_scratch"}


def _value(value, indent: int) -> str:
    """repr(value); a dict too long for one line gets one line per key (a bucket table: one resolution a line)."""
    text = repr(value)
    if indent + len(text) <= _WIDTH - 4 or not isinstance(value, dict):
        return text if indent + len(text) <= _WIDTH else pprint.pformat(value, width=_WIDTH - indent, sort_dicts=False)
    items = [f"    {k!r}: {v!r}," for k, v in value.items()]
    if any(len(i) + 4 > _WIDTH for i in items):
        return pprint.pformat(value, width=_WIDTH - indent, sort_dicts=False).replace("\n", "\n" + " " * indent)
    return "{\n" + "\n".join("    " + i for i in items) + "\n    }"


def _assignment(key: str, value, source: str) -> list[str]:
    target = "c." + key
    body = f"    {target} = {_value(value, len(target) + 7)}"
    if "\n" in body:  # a table: its comment above it
        return [f"    # {source}"[:_WIDTH], body]
    comment = f"  # {source}"
    if "\n" not in body and len(body) + len(comment) <= _WIDTH:
        return [body + comment]
    return [f"    # {source}"[:_WIDTH], body]


def render(tr: Translation) -> str:
    """The jaxsora config file of `tr`."""
    src = os.path.abspath(tr.path)
    doc = [f'"""jaxsora config translated from the Open-Sora config {src}',
           "",
           "Written by `python -m jaxsora.config translate`: `python -m jaxsora.train THIS_FILE` runs the config that",
           "`python -m jaxsora.train` runs from the Open-Sora file. Each value says the Open-Sora key it comes from",
           "(\"absent\": the file leaves it out, and Open-Sora's own default applies); what Open-Sora has no key for",
           "is configs/base.py's."]
    if tr.notes:
        doc += ["", "Open-Sora keys meaningless here, and what jaxsora does instead:"]
        doc += [line for n in tr.notes for line in textwrap.wrap(n, _WIDTH - 4, initial_indent="- ",
                                                                   subsequent_indent="  ")]
    if tr.flags:
        doc += ["", "Run flags the Open-Sora file names (give them on the command line with this file):"]
        for name, value in tr.flags.items():
            flag = "--" + name.replace("_", "-")
            doc.append(f"- {flag}" + ("" if value is True else f" {value}") + f"  ({_FLAG_SOURCES.get(name, name)})")
    if tr.data_path_key != "data.table":
        doc += ["", f"--data-path of the Open-Sora file goes to {tr.data_path_key} here: "
                    f"--config.{tr.data_path_key}=DIR"]
    doc.append('"""')
    lines = [ln.replace('"""', "'''") if 0 < i < len(doc) - 1 else ln for i, ln in enumerate(doc)]
    lines += ["from configs import base", "", "", "def get_config():", "    c = base.get_config()"]
    order = {g: i for i, g in enumerate(_GROUP_ORDER)}
    settings = sorted(enumerate(tr.settings), key=lambda p: (order.get(p[1].key.split(".")[0], len(order)), p[0]))
    group = None
    for _, s in settings:
        g = s.key.split(".")[0]
        if g != group and group is not None:
            lines.append("")
        group = g
        lines += _assignment(s.key, s.value, s.source)
    lines += ["    return c", ""]
    return "\n".join(lines)


def translate_file(path: str) -> str:
    """The translated file of the Open-Sora config `path` (ConfigError naming the first problem)."""
    return render(translate_train(path))
