"""Printed surfaces of the procedural object suite: painters of one part's texture cell.

A painter maps the cell-local texture coordinates of every pixel, ``U`` and ``V`` (H, W) in [0, 1] (the layout of
:mod:`foundationpose.synthetic.primitives`: a prism's side band above :data:`~.primitives.SIDE_V0`, its caps
below), to an (H, W, 3) float RGB image in [0, 255]. Three kinds:

* :func:`banded`: a base colour with horizontal stripes (constant along ``u``, so a band wrapped round a cylinder
  looks the same from every side) and one colour per cap;
* :func:`label`: a printed label over another painter in a rectangle of (u, v): paper, a logo disc and a title
  bar at its left end, and lines of text-like ink bars whose lengths are drawn from a seeded generator (so the
  label reads differently from its two ends and from every side);
* :func:`layered`: painters applied in order, each over what the previous left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from foundationpose.synthetic.primitives import SIDE_V0

__all__ = ["Painter", "banded", "label", "layered"]

Painter = Callable[[np.ndarray, np.ndarray], np.ndarray]
Colour = tuple[int, int, int]


def banded(base: Colour, stripes: Sequence[tuple[float, float, Colour]] = (),
           caps: tuple[Colour, Colour] | None = None) -> Painter:
    """``base`` everywhere, ``stripes`` ``(v0, v1, colour)`` across the side band (``v`` in [v0, v1)), and the
    bottom / top cap colours ``caps`` (default: ``base``)."""
    bottom, top = caps if caps is not None else (base, base)

    def paint(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        image = np.empty((*u.shape, 3), dtype=np.float64)
        image[:] = base
        for v0, v1, colour in stripes:
            image[(v >= v0) & (v < v1)] = colour
        cap = v < SIDE_V0 - 0.01
        image[cap & (u < 0.5)] = bottom
        image[cap & (u >= 0.5)] = top
        return image

    return paint


def label(region: tuple[float, float, float, float], rng: np.random.Generator, *, paper: Colour, ink: Colour,
          accent: Colour, lines: int = 4) -> Painter:
    """A label in ``region`` = (u0, u1, v0, v1) of the cell: ``paper`` ground, an ``accent`` logo disc and a thick
    ``ink`` title bar in the upper left, and ``lines`` rows of ink "words" of seeded lengths below them. Paints
    the region only (apply it with :func:`layered` over the surface's own painter)."""
    u0, u1, v0, v1 = region
    if not (0 <= u0 < u1 <= 1 and 0 <= v0 < v1 <= 1):
        raise ValueError(f"a label's region must be (u0, u1, v0, v1) inside [0, 1] with u0 < u1, v0 < v1; got {region}")
    width, height = u1 - u0, v1 - v0
    words = []  # (u_start, u_end, v_low, v_high) in region fractions
    for row in range(lines):
        top = 0.55 - row * 0.45 / lines
        low = top - 0.45 / lines * 0.55
        x = 0.06
        limit = 0.94 - (0.3 if row == lines - 1 else 0.0) * rng.random()  # a ragged last line
        while x < limit:
            length = float(rng.uniform(0.05, 0.22))
            words.append((x, min(x + length, limit), low, top))
            x += length + float(rng.uniform(0.03, 0.06))

    def paint(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        image = np.full((*u.shape, 3), np.nan)
        fu, fv = (u - u0) / width, (v - v0) / height
        inside = (fu >= 0) & (fu <= 1) & (fv >= 0) & (fv <= 1)
        image[inside] = paper
        logo = ((fu - 0.14) * width) ** 2 + ((fv - 0.8) * height) ** 2 <= (0.13 * min(width, height)) ** 2
        image[inside & logo] = accent
        image[inside & (fu >= 0.3) & (fu <= 0.9) & (fv >= 0.72) & (fv <= 0.9)] = ink  # title
        for a, b, low, high in words:
            image[inside & (fu >= a) & (fu < b) & (fv >= low) & (fv < high)] = ink
        return image

    return paint


def layered(*painters: Painter) -> Painter:
    """The painters in order, each over the last; a painter leaves a pixel alone by returning NaN there."""
    if not painters:
        raise ValueError("layered needs at least one painter")

    def paint(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        image = painters[0](u, v)
        for painter in painters[1:]:
            over = painter(u, v)
            keep = ~np.isnan(over[..., 0])
            image[keep] = over[keep]
        return image

    return paint
