"""The vocabulary of the scenes and the geometry of each shape.

Class names are the exact words the captions use, so zero-shot prompts built from the dataset's
``label_kinds`` match the training text.
"""

from __future__ import annotations

import numpy as np

SHAPES: tuple[str, ...] = (
    "triangle", "square", "pentagon", "hexagon", "rectangle",      # realm 0: polygons
    "circle", "ellipse", "crescent", "ring", "semicircle",         # realm 1: curved shapes
    "star", "cross", "arrow", "diamond", "heart",                  # realm 2: symbols
)  # fmt: skip
REALMS: tuple[str, ...] = ("polygon", "curved shape", "symbol")
SHAPE_REALM: tuple[int, ...] = (0,) * 5 + (1,) * 5 + (2,) * 5
COLOURS: tuple[str, ...] = (
    "red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink", "white", "black",
)  # fmt: skip
COUNT_NAMES: tuple[str, ...] = ("one", "two", "three", "four", "five", "six")
SIZES: tuple[str, ...] = ("small", "large")
BACKGROUNDS: tuple[str, ...] = ("noisy", "gradient", "striped")

# Base RGB of each colour, far from the mid-grey backgrounds so objects stay clearly visible.
RGB = np.array(
    [
        [220, 35, 35], [245, 140, 20], [235, 215, 40], [40, 170, 60], [40, 210, 220],
        [35, 70, 215], [140, 50, 190], [245, 130, 190], [240, 240, 240], [25, 25, 25],
    ],
    dtype=np.int16,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Shape geometry: each shape is a few polygons in unit coordinates (x right, y down, inside the
# unit circle), drawn with fill (True) or cleared (False) in order, so rings and crescents are
# a disc minus a disc.
# ---------------------------------------------------------------------------------------------


def _arc(n: int, radius: float = 1.0, start_deg: float = 0.0, stop_deg: float = 360.0,
         centre: tuple[float, float] = (0.0, 0.0), closed: bool = True) -> np.ndarray:
    """[n, 2] points on a circular arc (``closed``: the end point is left out)."""
    t = np.deg2rad(np.linspace(start_deg, stop_deg, n, endpoint=not closed))
    return np.stack([centre[0] + radius * np.cos(t), centre[1] + radius * np.sin(t)], axis=1)


def _heart(n: int = 36) -> np.ndarray:
    """[n, 2] classic parametric heart, scaled into the unit circle and centred."""
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    x = 16 * np.sin(t) ** 3
    y = -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))
    pts = np.stack([x, y + 2.5], axis=1)
    return pts / np.abs(pts).max()


def _star(points: int = 5, inner: float = 0.42) -> np.ndarray:
    radii = np.tile([1.0, inner], points)
    t = np.deg2rad(-90 + np.arange(2 * points) * 180 / points)
    return np.stack([radii * np.cos(t), radii * np.sin(t)], axis=1)


def _poly(*xy: float) -> np.ndarray:
    return np.asarray(xy, dtype=np.float64).reshape(-1, 2)


_W = 0.33  # half width of a cross arm
SHAPE_PARTS: tuple[tuple[tuple[np.ndarray, bool], ...], ...] = (
    ((_arc(3, start_deg=-90), True),),                                   # triangle
    ((_arc(4, start_deg=45), True),),                                    # square
    ((_arc(5, start_deg=-90), True),),                                   # pentagon
    ((_arc(6), True),),                                                  # hexagon
    ((_poly(-0.87, -0.48, 0.87, -0.48, 0.87, 0.48, -0.87, 0.48), True),),  # rectangle
    ((_arc(32), True),),                                                 # circle
    ((_arc(32) * (1.0, 0.55), True),),                                   # ellipse
    ((_arc(32), True), (_arc(32, 0.85, centre=(0.5, 0.0)), False)),      # crescent
    ((_arc(32), True), (_arc(24, 0.55), False)),                         # ring
    ((_arc(17, 1.0, 180, 360, centre=(0, 0.4), closed=False), True),),   # semicircle
    ((_star(), True),),                                                  # star
    ((_poly(-_W, -1, _W, -1, _W, -_W, 1, -_W, 1, _W, _W, _W,
            _W, 1, -_W, 1, -_W, _W, -1, _W, -1, -_W, -_W, -_W) * 0.95, True),),  # cross
    ((_poly(-1, -0.25, 0.15, -0.25, 0.15, -0.65, 1, 0,
            0.15, 0.65, 0.15, 0.25, -1, 0.25), True),),                   # arrow
    ((_poly(0, -1, 0.62, 0, 0, 1, -0.62, 0), True),),                    # diamond
    ((_heart(), True),),                                                 # heart
)  # fmt: skip
# Base orientations (multiples of 90 degrees) a shape may take before a small jitter. Shapes whose
# identity survives any quarter turn get 4; shapes that would turn into another one (a square
# turned 45 degrees is a diamond) only get the jitter.
SHAPE_TURNS = (1, 1, 1, 1, 2, 1, 2, 4, 1, 4, 1, 1, 4, 2, 1)
JITTER_DEG = 20.0

assert len(SHAPES) == len(SHAPE_PARTS) == len(SHAPE_REALM) == len(SHAPE_TURNS)
assert len(COLOURS) == len(RGB)
