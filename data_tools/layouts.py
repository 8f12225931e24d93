"""The tables datasets come with, and how `data_tools.meta` turns each into ours (`path`, `text`, ...).

- **jaxsora / Open-Sora** (`path`, `text`, and any other columns): ours already.
- **OpenVid-1M** (`OpenVid-1M.csv`, `OpenVidHD.csv` of huggingface.co/datasets/nkp37/OpenVid-1M):
  `video` (the clip's file name; `unzip -j` puts them all in one folder), `caption`, `aesthetic
  score`, `motion score`, `temporal consistency score`, `camera motion`, `frame`, `fps`, `seconds`.
  `video` → `path` (under `--root`), `caption` → `text`, `aesthetic score` → `aes` and `motion
  score` → `flow` (the same kinds of score as Open-Sora's `aes` and `flow`: an aesthetic predictor's
  score, the motion between frames; on OpenVid's own scales, so choose `filter` thresholds from
  OpenVid's values, not from Open-Sora's). The rest are kept; `fps` is measured again.
- **MiraData** (`miradata_v1_330k.csv` and the 93k/42k/9k versions, github.com/mira-space/MiraData):
  `clip_id`, `source`, `video_url`, `video_id`, `width`, `height`, `fps`, `seconds`, `timestamp`,
  `frame_number`, `framestamp`, `file_path` (where its download script writes the clip, under the
  clip folder), `short_caption`, `dense_caption`, `background_caption`, `main_object_caption`,
  `style_caption`, `camera_caption`. `file_path` → `path` (under `--root`), the caption column
  chosen (default `dense_caption`) → `text`. It has no scores. The rest are kept; `width`, `height`
  and `fps` are measured again.

Why `dense_caption` by default: MiraData's README describes it as the caption that summarizes the
other five, and it is the same kind of text as OpenVid-1M's `caption` (a paragraph describing the
scene, its subjects and the camera), which a table merged from both mixes it with; `short_caption`
is a one-sentence caption from the Panda-70M captioner. The text encoder keeps the first 300 T5
tokens of a longer caption, as Open-Sora 1.2 does. `--caption short_caption` (or any other
caption column) chooses another.
"""
from __future__ import annotations

import dataclasses

from jaxsora.errors import BadInput, UnknownKey


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str  # what --layout calls it
    title: str  # how messages name it
    path: str  # the column naming the clip's file
    captions: tuple[str, ...]  # the caption columns; the first is the default
    scores: tuple[tuple[str, str], ...] = ()  # (their score column, ours)
    signature: tuple[str, ...] = ()  # columns that tell this layout apart

    def renames(self, caption: str) -> dict[str, str]:
        """Their column → ours, for the caption column `caption`."""
        return {self.path: "path", caption: "text", **dict(self.scores)}


JAXSORA = Layout("jaxsora", "jaxsora (Open-Sora's)", path="path", captions=("text",), signature=("path",))
OPENVID = Layout("openvid", "OpenVid-1M", path="video", captions=("caption",),
                 scores=(("aesthetic score", "aes"), ("motion score", "flow")), signature=("video", "caption"))
MIRADATA = Layout("miradata", "MiraData", path="file_path",
                  captions=("dense_caption", "short_caption", "main_object_caption", "background_caption",
                            "style_caption", "camera_caption"),
                  signature=("file_path", "dense_caption"))
LAYOUTS = {layout.name: layout for layout in (JAXSORA, OPENVID, MIRADATA)}


def detect(columns: list[str]) -> Layout:
    """The layout whose signature columns the table has (ours first); UnknownKey naming the columns."""
    for layout in LAYOUTS.values():
        if all(c in columns for c in layout.signature):
            return layout
    known = "; ".join(f"{x.title}: {', '.join(x.signature)}" for x in LAYOUTS.values())
    raise UnknownKey(f"unknown table layout: its columns are {columns}; meta reads tables with these columns "
                     f"({known}), or give --layout")


def resolve(name: str, columns: list[str], caption: str | None) -> tuple[Layout, dict[str, str]]:
    """(the layout, their column → ours) for a table with `columns`: `name` ("auto" detects it),
    `caption` the caption column (None: the layout's default). One-line errors for what is missing."""
    layout = detect(columns) if name == "auto" else LAYOUTS[name]
    caption = caption or layout.captions[0]
    need = [layout.path, caption]
    missing = [c for c in need if c not in columns]
    if missing:
        raise UnknownKey(f"the {layout.title} layout needs column {', '.join(map(repr, missing))}; the table's columns "
                         f"are {columns}")
    renames = {k: v for k, v in layout.renames(caption).items() if k in columns and k != v}
    clash = [v for k, v in renames.items() if v in columns and v not in renames]
    if clash:
        raise BadInput(f"the table has a column {clash[0]!r} already and {layout.title}'s "
                       f"{next(k for k, v in renames.items() if v == clash[0])!r} would become it; rename one of them")
    return layout, renames
