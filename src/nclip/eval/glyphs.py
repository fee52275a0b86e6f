"""Fonts for the report's class names that matplotlib's default font cannot draw.

A user's class folders may be named in any script; DejaVu Sans, matplotlib's default, has no CJK
(among others), so such names were boxes in the plots and every draw warned "Glyph N missing from
font(s)" -- 18 warnings for one report. :func:`class_name_fonts` adds installed fonts
that have the missing glyphs behind the default one (matplotlib falls back through the family list
glyph by glyph); the names no installed font can draw are said once, and the per-glyph warnings
of those names are not repeated.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterable, Iterator

# matplotlib's "Last Resort" font maps every code point to a box that names its block: it "has"
# every glyph, and drawing with it is what we avoid
_NOT_A_FALLBACK = ("Last Resort",)
MISSING_GLYPH = r"Glyph \d+ .* missing from font"


@lru_cache(maxsize=None)
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):  # a font file FreeType cannot read covers nothing
        return frozenset()


def _default_font() -> tuple[str, str]:
    """(family name, file) of the font matplotlib draws text with now."""
    from matplotlib import font_manager, rcParams
    from matplotlib.ft2font import FT2Font

    path = font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"]))
    return FT2Font(path).family_name, path


def _installed() -> list[tuple[str, str]]:
    """(family name, file) of every installed font matplotlib knows, once per family, by name."""
    from matplotlib import font_manager

    fonts = {}
    for f in sorted(font_manager.fontManager.ttflist, key=lambda f: (f.name, f.fname)):
        if not f.name.startswith(_NOT_A_FALLBACK):
            fonts.setdefault(f.name, f.fname)
    return sorted(fonts.items())


def fallback_fonts(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """(families to put behind the default font, names that still cannot be drawn) for ``names``:
    greedily the installed font that covers most of the still-missing characters, until none helps."""
    names = list(dict.fromkeys(names))
    _, default_path = _default_font()
    have = _charmap(default_path)
    missing = {ord(c) for n in names for c in n if not c.isspace()} - have
    families: list[str] = []
    candidates = _installed() if missing else []
    while missing and candidates:
        best = max(candidates, key=lambda fam: len(missing & _charmap(fam[1])))
        gained = missing & _charmap(best[1])
        if not gained:
            break
        families.append(best[0])
        candidates.remove(best)
        missing -= gained
    return families, [n for n in names if any(ord(c) in missing for c in n)]


@contextmanager
def class_name_fonts(names: Iterable[str], say: Callable[[str], None]) -> Iterator[list[str]]:
    """Inside: matplotlib text falls back to installed fonts with the glyphs of ``names``; the names
    none has are passed to ``say`` once (and yielded), and their glyph warnings are not repeated."""
    import matplotlib

    families, undrawable = fallback_fonts(names)
    default_family, _ = _default_font()
    rc = {"font.family": [default_family, *families]} if families else {}
    with matplotlib.rc_context(rc), warnings.catch_warnings():
        if undrawable:
            warnings.filterwarnings("ignore", message=MISSING_GLYPH, category=UserWarning)
            say(f"no installed font has every character of {len(undrawable)} class name(s), drawn with boxes "
                f"in the report's plots: {', '.join(undrawable)} (install a font that has them, then delete "
                "matplotlib's font cache, ~/.cache/matplotlib, so that it is found)")
        yield undrawable
