"""Limits on the objects a server holds: mesh size at upload, texture size, object count and memory.

Why: the render cost of a register grows with faces x hypotheses, and one heavy mesh keeps the
register lane busy for minutes (issue 12: 233k faces made one CPU render stage run ~10 minutes);
textures are decoded to float32 RGB (an 8192x8192 image is 805 MB as a tensor). The limits refuse
such objects at upload, where the user can still act on the message, instead of letting them starve
every later request.

This module imports neither torch nor trimesh (the CLI reads it before ``--help`` is answered).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RASTER_RATE", "REGISTER_BUDGET_SHARE", "ObjectLimits", "register_cost", "register_cost_budget"]


# Triangles rasterised per second at 160x160 crops (register_cost units), conservative. CPU: the CPU
# rasteriser on the 2-core development machine (an 82k-face mesh at 16 hypotheses x 2 passes: 34 s per
# register, of which ~12 s are the networks; issue 12 saw 233k faces x 252 hypotheses take ~10 min per
# pass). CUDA: nvdiffrast, far faster than the face limit matters for.
RASTER_RATE = {"cpu": 120_000.0, "cuda": 2.0e9}
# Share of the request timeout the rasterising may take; the rest is for the networks and queueing.
REGISTER_BUDGET_SHARE = 0.5


def register_cost_budget(device_type: str, request_timeout_s: float) -> int:
    """The default ``max_register_cost`` for a device type (``cpu`` / ``cuda``) and request timeout."""
    rate = RASTER_RATE.get(device_type, RASTER_RATE["cuda"])
    return int(rate * REGISTER_BUDGET_SHARE * request_timeout_s)


def register_cost(faces: int, hypotheses: int, register_iterations: int) -> int:
    """Triangles rasterised by one register: every hypothesis is rendered once per refine iteration
    and once more for scoring (``faces x hypotheses x (iterations + 1)``)."""
    return int(faces) * int(hypotheses) * (int(register_iterations) + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectLimits:
    """What ``POST /objects`` (and, for textures and memory, the objects directory) accepts.

    max_faces / max_vertices: an uploaded mesh above either is refused with 413 (or decimated to
        ``max_faces`` when the upload sends ``simplify=true`` and fast-simplification is installed).
    max_register_cost: refuse an upload whose ``register_cost`` (faces x hypotheses x (register
        iterations + 1), with the server's settings) is above this (413). None (default): derived from
        the device, as the cost the device rasterises within half the request timeout
        (``RASTER_RATE[device type] x REGISTER_BUDGET_SHARE x request_timeout_s``), so a register that
        would only end in 504 while holding the register lane is refused at upload instead.
    max_texture_side: textures (the ``texture`` field and images embedded in GLB/OBJ materials) are
        downscaled to at most this many pixels per side; images above Pillow's decompression-bomb limit
        are refused (413).
    max_objects: loaded objects at most (507 when full). max_total_bytes: memory of the loaded objects
        (tensors, meshes and texture images) at most (507 when an upload would exceed it).
    """

    max_faces: int = 200_000
    max_vertices: int = 200_000
    max_register_cost: int | None = None
    max_texture_side: int = 2048
    max_objects: int = 256
    max_total_bytes: int = 4 * 1024**3

    def __post_init__(self) -> None:
        for name in ("max_faces", "max_vertices", "max_texture_side", "max_objects", "max_total_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_register_cost is not None and not self.max_register_cost > 0:
            raise ValueError(f"max_register_cost must be > 0 or None, got {self.max_register_cost!r}")
