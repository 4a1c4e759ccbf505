"""Loss curves as a PNG drawn with Pillow (no plotting library needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = ["plot_curves"]

_COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207))


def plot_curves(path: Path, rows: Sequence[dict], x_key: str, y_keys: Sequence[str], title: str,
                size: tuple[int, int] = (900, 520)) -> Path:
    """Draw ``y_keys`` of the log rows against ``x_key`` on a log-10 y axis; rows missing a key are skipped."""
    width, height = size
    left, right, top, bottom = 70, 20, 40, 60
    img = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(img)
    series = {}
    for key in y_keys:
        pts = [(float(r[x_key]), math.log10(float(r[key]))) for r in rows
               if r.get(key) is not None and r.get(x_key) is not None and float(r[key]) > 0]
        if pts:
            series[key] = pts
    draw.text((left, 12), title, fill=(0, 0, 0))
    if not series:
        draw.text((left, height // 2), "no data yet", fill=(0, 0, 0))
        img.save(path)
        return path
    xs = [p[0] for pts in series.values() for p in pts]
    ys = [p[1] for pts in series.values() for p in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = math.floor(min(ys)), math.ceil(max(ys)) if math.ceil(max(ys)) > math.floor(min(ys)) else math.floor(min(ys)) + 1

    def to_px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline=(0, 0, 0))
    for decade in range(int(y0), int(y1) + 1):
        _, py = to_px(x0, decade)
        draw.line([left, py, width - right, py], fill=(225, 225, 225))
        draw.text((8, py - 6), f"1e{decade}", fill=(0, 0, 0))
    for i in range(6):
        x = x0 + (x1 - x0) * i / 5
        px, _ = to_px(x, y0)
        draw.text((px - 12, height - bottom + 6), f"{x:.3g}", fill=(0, 0, 0))
    draw.text((width // 2 - 30, height - 24), x_key, fill=(0, 0, 0))
    for index, (key, pts) in enumerate(series.items()):
        colour = _COLOURS[index % len(_COLOURS)]
        line = [to_px(x, y) for x, y in pts]
        if len(line) > 1:
            draw.line(line, fill=colour, width=2)
        else:
            px, py = line[0]
            draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
        draw.text((width - right - 220, top + 8 + 16 * index), key, fill=colour)
    img.save(path)
    return path
