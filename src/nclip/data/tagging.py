"""Tagging data as image–text pairs (xCLIP Sec. 4.3, "Pre-training with tagging data"; Tab. 8).

The paper pre-trains on ImageNet-21K "taking label names as annotation texts by concatenating them
with a sampled prompt". Here any labelled training source (``digits``, synthetic scenes, a
``folder`` tree, a CSV with ``data.csv_label_key``) becomes such pairs when ``data.tagging.enabled``:
the caption of sample i at epoch e is ``template.format(class name)``, the template drawn by a
generator seeded by (seed, e, i). So the prompt is re-sampled every epoch, and a caption is a pure
function of (seed, step, index): reproducible, exact on resume and the same however the global
batch is split over ranks (the epoch of a step is the step sampler's, see
:meth:`nclip.data.step_batches.StepBatches.epoch`; for episodic ProtoCLIP it is the episode).

Templates: ``data.tagging.templates`` names a text file, one template per line with one ``{}``,
``#`` comments and blank lines ignored; without one, the label kind's zero-shot prompt templates
(those ``nclip eval`` scores with: :data:`nclip.data.digits.DIGIT_TEMPLATES`, the scenes' shape
templates, :data:`nclip.data.folders.FOLDER_TEMPLATES` for the user's classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nclip.data.types import LabelKind
from nclip.errors import NclipError
from nclip.jsonio import read_text

_TAG_STREAM = 0x7A66  # separates the template draws from the other users of the run seed


def read_templates(path: str | Path, what: str = "data.tagging.templates: file") -> tuple[str, ...]:
    """The templates of a file: one per line, each with exactly one ``{}``; ``#`` comments and
    blank lines skipped. A bad line is a one-line error naming ``file:line``; ``what`` names the
    file in the error for a missing one (``nclip eval --templates`` reads it too)."""
    path, text = read_text(path, what)
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            ok = text.count("{}") == 1 and text.format("x") == text.replace("{}", "x")
        except (IndexError, KeyError, ValueError):  # other braces: "{name}", "{0}", a lone "{"
            ok = False
        if not ok:
            raise NclipError(f"{path}:{n}: a template needs exactly one {{}} (the class name) and no other braces, "
                             f"got {text!r}")
        out.append(text)
    if not out:
        raise NclipError(f"{path}: no templates (one per line, with {{}} for the class name)")
    return tuple(out)


class TagCaptions:
    """(epoch, dataset index, class id) → caption: a template, drawn by a generator seeded by
    (seed, epoch, index), filled with the class name."""

    def __init__(self, names: Sequence[str], templates: Sequence[str], seed: int):
        if not templates:
            raise ValueError("no templates")
        self.names, self.templates, self.seed = tuple(names), tuple(templates), seed

    def __call__(self, epoch: int, index: int, class_id: int) -> str:
        t = np.random.default_rng([self.seed, _TAG_STREAM, epoch, index]).integers(len(self.templates))
        return self.templates[int(t)].format(self.names[class_id])

    @classmethod
    def of(cls, space: LabelKind, templates_file: str | None, seed: int) -> TagCaptions:
        """Captions for the classes of ``space``, from ``templates_file`` or the space's own prompts."""
        templates = read_templates(templates_file) if templates_file else space.templates
        return cls(space.names, templates, seed)
