"""Scene layout and rendering: the objects' places, their visible-pixel masks, the background.

Scalar draws come from a ``Picker``, array draws (positions, noise) from its numpy ``Generator``;
a scene is fixed by the order of the draws, so a change here changes every sample.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageDraw

from nclip.data.synthetic.picker import Picker
from nclip.data.synthetic.shapes import COLOURS, JITTER_DEG, RGB, SHAPE_PARTS, SHAPE_TURNS, SHAPES

# Radius (of the shape's bounding circle) as a fraction of the image side, per size class.
_RADIUS = ((0.10, 0.13), (0.17, 0.22))
_MIN_SEPARATION = 0.85  # centres at least this times (r1 + r2) apart: small overlaps only
_MIN_VISIBLE = 0.3  # an object must keep this share of its pixels, else it is dropped


class Obj(NamedTuple):
    """One object of a scene, in pixel units."""

    shape: int
    colour: int
    size: int  # 0 small, 1 large
    radius: float
    cx: float
    cy: float
    angle: float  # radians


def _place(rng: np.random.Generator, radius: float, centres: np.ndarray, radii: np.ndarray,
           side: int, tries: int = 32) -> tuple[np.ndarray, bool]:
    """A centre [2] for a new object that keeps clear of the placed ones (``centres`` [k, 2]).

    Draws ``tries`` candidates at once; returns the first that is far enough from all placed
    objects and True, or else the candidate with the largest clearance and False.
    """
    lo, hi = radius + 0.5, side - 1.5 - radius
    cand = lo + (hi - lo) * rng.random((tries, 2))  # [T, 2]
    if len(centres) == 0:
        return cand[0], True
    diff = cand[:, None, :] - centres[None, :, :]  # [T, k, 2]
    dist = np.sqrt((diff * diff).sum(axis=2))  # [T, k]
    clearance = (dist - _MIN_SEPARATION * (radius + radii)).min(axis=1)  # [T]
    ok = clearance >= 0
    if ok.any():
        return cand[int(ok.argmax())], True
    return cand[int(clearance.argmax())], False


def layout(rng: np.random.Generator, pick: Picker, side: int, max_objects: int,
           shape_pick: Picker | None = None) -> list[Obj]:
    """Random objects with little overlap; a large object that finds no room becomes small.

    With ``shape_pick`` the shapes come from it and everything else from ``pick``/``rng``: every
    ``pick.index`` takes one draw whatever its range, so two calls with the same ``pick`` stream and
    different ``shape_pick`` streams give the same layout with other shapes (a hard-negative group).
    """
    n = 1 + pick.index(max_objects)
    objs: list[Obj] = []
    centres, radii = np.zeros((n, 2)), np.zeros(n)  # filled as objects are placed
    for k in range(n):
        shape, colour, size = pick.index(len(SHAPES)), pick.index(len(COLOURS)), pick.index(2)
        if shape_pick is not None:
            shape = shape_pick.index(len(SHAPES))
        share = pick.uniform()  # where the radius lies in its size class
        while True:
            lo, hi = _RADIUS[size]
            radius = side * (lo + (hi - lo) * share)
            centre, ok = _place(rng, radius, centres[:k], radii[:k], side)
            if ok or size == 0:
                break
            size = 0  # no room for a large one: try small before accepting an overlap
        turns = pick.index(SHAPE_TURNS[shape])
        angle = math.radians(90.0 * turns + JITTER_DEG * (2 * pick.uniform() - 1))
        objs.append(Obj(shape, colour, size, radius, float(centre[0]), float(centre[1]), angle))
        centres[k], radii[k] = centre, radius
    return objs


def _object_mask(obj: Obj, side: int) -> np.ndarray:
    """bool [side, side]: the pixels the object covers when nothing hides it."""
    c, s = math.cos(obj.angle), math.sin(obj.angle)
    rot = np.array([[c, s], [-s, c]]) * obj.radius  # row-vector convention: p' = p @ rot + centre
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    for verts, fill in SHAPE_PARTS[obj.shape]:
        pts = verts @ rot + (obj.cx, obj.cy)
        draw.polygon(pts.ravel().tolist(), fill=255 if fill else 0)
    return np.asarray(canvas) > 0


def _visible_masks(full: list[np.ndarray]) -> np.ndarray:
    """bool [n, H, W] visible pixels of each object; later objects are drawn on top."""
    owner = np.zeros(full[0].shape, dtype=np.uint8)  # 0 = background, k + 1 = object k
    for k, mask in enumerate(full):
        owner[mask] = k + 1
    return owner[None] == np.arange(1, len(full) + 1, dtype=np.uint8)[:, None, None]


class Grid(NamedTuple):
    x: np.ndarray  # float32 [S, S] column coordinate in [-0.5, 0.5]
    y: np.ndarray  # float32 [S, S] row coordinate in [-0.5, 0.5]


def _background(rng: np.random.Generator, pick: Picker, kind: int, grid: Grid) -> np.ndarray:
    """int16 [3, S, S] (channel planes) low-contrast background: noise, gradient or stripes.

    Values stay within [50, 205] so no clipping is needed, and objects (saturated colours,
    black and white) stand out. Planes, not [S, S, 3]: numpy is several times slower on
    arrays whose last axis has length 3.
    """
    side = grid.x.shape[0]
    grey = 95 + 65 * pick.uniform()
    base = np.array([grey + 24 * pick.uniform() - 12 for _ in range(3)])  # [3] slight tint
    if kind == 0:  # noisy: uniform noise of amplitude 12..20
        amplitude = 12 + 8 * pick.uniform()
        pattern = (rng.random((side, side), dtype=np.float32) - 0.5) * np.float32(2 * amplitude)
    else:
        theta = 2 * math.pi * pick.uniform()
        along = grid.x * np.float32(math.cos(theta)) + grid.y * np.float32(math.sin(theta))
        if kind == 1:  # gradient: up to +-30 over the half diagonal (|along| <= 0.71)
            pattern = along * np.float32(25 + 17 * pick.uniform())
        else:  # striped: 3 to 8 soft stripes across the image
            freq, phase = 3 + 5 * pick.uniform(), 2 * math.pi * pick.uniform()
            pattern = np.sin(along * np.float32(2 * math.pi * freq) + np.float32(phase))
            pattern *= np.float32(8 + 6 * pick.uniform())
    return pattern.astype(np.int16)[None] + base.astype(np.int16)[:, None, None]


def render(rng: np.random.Generator, pick: Picker, objs: list[Obj], kind: int,
           grid: Grid) -> tuple[np.ndarray, list[Obj], np.ndarray, np.ndarray]:
    """Draw a scene.

    Returns (uint8 image [S, S, 3], kept objects, visible masks bool [n, S, S], visible pixel
    counts int [n]). An object hidden below ``_MIN_VISIBLE`` of its own area by later ones is
    dropped (its caption would lie); that only happens when ``layout`` accepted an overlap.
    """
    side = grid.x.shape[0]
    full = [_object_mask(o, side) for o in objs]
    area = np.array([np.count_nonzero(m) for m in full])  # [n]
    while True:
        visible = _visible_masks(full)  # [n, S, S]
        counts = np.count_nonzero(visible, axis=(1, 2))  # [n]
        keep = counts >= np.maximum(_MIN_VISIBLE * area, 1)
        if keep.all():
            break
        objs = [o for o, k in zip(objs, keep) if k]
        full = [m for m, k in zip(full, keep) if k]
        area = area[keep]
    planes = _background(rng, pick, kind, grid)  # int16 [3, S, S]
    for k, obj in enumerate(objs):
        for c in range(3):  # each object's colour jitters by up to +-12 per channel
            value = RGB[obj.colour, c] + pick.index(25) - 12
            planes[c][visible[k]] = min(max(value, 0), 255)
    image = np.empty((side, side, 3), dtype=np.uint8)
    for c in range(3):
        image[:, :, c] = planes[c]
    return image, objs, visible, counts
