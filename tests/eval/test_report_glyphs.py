"""Class names in any script (issue 28.12): the report's plots fall back to an installed font that
has their glyphs, and names no installed font can draw are said once, without matplotlib's
"Glyph missing" warning per glyph and per draw."""

from __future__ import annotations

import warnings

import matplotlib
import pytest
import torch

from nclip.eval import glyphs
from nclip.eval.report import render
from nclip.objectives.scores import ClipScore

matplotlib.use("Agg", force=True)

CJK = "狗"  # in no font matplotlib ships
STIX_ONLY = "𝐀pfel"  # U+1D400, mathematical bold A: in matplotlib's STIX fonts, not in DejaVu Sans


def _report(names, capsys) -> tuple[str, list[str], list[str]]:
    """(page, stderr lines, warnings) of a report with a confusion matrix and a t-SNE of ``names``."""
    n = len(names)
    g = torch.Generator().manual_seed(0)
    t = {"score": ClipScore(), "names": names, "labels": torch.arange(n).repeat(6), "dataset": "pets", "kind": "class",
         "image": {"clip": torch.randn(6 * n, 8, generator=g)}, "prompts": {"clip": torch.randn(2 * n, 8, generator=g)},
         "classes": {"clip": torch.randn(n, 8, generator=g)}}
    doc = {"results": {"zeroshot/pets-class/top1": 0.5}, "config": {"tsne_iters": 250}, "cache": {}, "timing": {},
           "checkpoint": {"path": "m", "objective": "clip", "heads": ["clip"], "head": "clip",
                          "weights_sha256": "ab" * 32}}
    artifacts = {"confusion": {"pets-class": (torch.eye(n, dtype=torch.long) * 3, names)}, "tsne": t}
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page = render(doc, artifacts)
    err = capsys.readouterr().err.splitlines()
    return page, err, [str(w.message) for w in caught]


def test_names_no_installed_font_can_draw_are_said_once(capsys, monkeypatch):
    monkeypatch.setattr(glyphs, "_installed", lambda: [])  # as on a machine without fonts beyond the default
    page, err, caught = _report(["chat_été", CJK, "car"], capsys)
    assert not [w for w in caught if "missing from font" in w], caught[:3]
    assert len(err) == 1 and err[0].startswith("nclip: warning: ") and CJK in err[0], err
    assert "chat_été" not in err[0]  # DejaVu Sans draws accents
    assert CJK in page.split('id="confusion"')[1].split("<img")[0]  # and the page says it above the plots


def test_an_installed_font_with_the_glyphs_draws_them(capsys):
    families, undrawable = glyphs.fallback_fonts(["chat_été", STIX_ONLY, "car"])
    assert families and undrawable == []
    page, err, caught = _report(["chat_été", STIX_ONLY, "car"], capsys)
    assert not [w for w in caught if "missing from font" in w], caught[:3]
    assert err == []


@pytest.mark.parametrize("names", [["cat", "dog"], ["chat_été", "Äpfel", "птица", "θάλασσα"]])
def test_names_the_default_font_draws_need_no_fallback(names):
    assert glyphs.fallback_fonts(names) == ([], [])
