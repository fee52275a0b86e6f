"""JSON in and out with nclip's conventions: a bad file is a one-line NclipError, and non-finite
floats (which JSON cannot hold) are replaced on the way out."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from nclip.errors import NclipError


def jsonable(x: Any, nonfinite: Callable[[float], Any]) -> Any:
    """``x`` with dict keys as strings, tuples as lists, and each NaN/inf float ``f`` replaced by
    ``nonfinite(f)`` (for example ``str`` for "nan", or ``lambda f: None`` for null)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v, nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, nonfinite) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return nonfinite(x)
    return x


def read_json(path: Path) -> Any:
    """The parsed contents of a JSON file; invalid JSON is an NclipError naming file and line."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NclipError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
