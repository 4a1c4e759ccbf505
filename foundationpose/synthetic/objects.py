"""The object suite: textured, real-object shapes whose near-symmetry only a detail or a print gives away.

Eight objects built from UV-mapped primitives (:mod:`foundationpose.synthetic.primitives`) with printed
textures (:mod:`foundationpose.synthetic.prints`), in metres, z up, the mesh frame's origin on the floor under
the main body's axis. Each has a ``split``: the ``tune`` half is the one any constant may be chosen on; the
``held_out`` half is reported beside it and never used to choose anything. Both halves mix the two ways a
near-symmetry is broken:

========================  ========  ==========================================================================
name                      split     near-symmetry (mesh frame) and what breaks it
========================  ========  ==========================================================================
``mug``                   tune      z:inf about the body's axis; broken by the handle (geometry)
``spray_bottle``          tune      z:inf about the body's axis; broken by the trigger head and nozzle (geometry)
``cereal_box``            tune      z:2, x:2, y:2 about the box centre; broken by the front's label (texture)
``can``                   tune      z:inf about the axis; broken by the printed label (texture)
``drill``                 held_out  x:inf about the barrel's axis; broken by the handle and battery (geometry)
``shoe``                  held_out  z:2 about the sole's centre; broken by the wide toe and the heel (geometry)
``jar``                   held_out  z:inf about the axis; broken by the printed label (texture)
``book``                  held_out  z:2, x:2, y:2 about the centre; broken by covers, spine and pages (texture)
========================  ========  ==========================================================================

The textures of the geometry-broken objects are bands constant round their axis (only the detail breaks the
symmetry); the texture-broken objects' geometry is exactly symmetric. Colours and the labels' text-like marks are
drawn from ``numpy.random.default_rng([seed, index])`` (index: the object's place in :data:`SUITE`), so an object
is the same whichever others are built with it, and a seed gives the same file bytes on every machine.

``python -m foundationpose.synthetic.objects --out DIR [--objects NAME ...] [--seed N]`` writes ``DIR/<name>.glb``
(embedded texture; what ``load_object`` and training read) and ``DIR/objects.json`` (the facts above per object,
with each file's SHA-256).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trimesh
from PIL import Image

from foundationpose.errors import InputError
from foundationpose.symmetry import Symmetry, parse_symmetry, symmetry_tfs, to_mesh_frame_tfs
from foundationpose.synthetic.primitives import (
    SIDE_V0,
    Part,
    circle,
    perimeter_fractions,
    prism,
    rectangle,
    rotation,
    transformed,
    tube_arc,
)
from foundationpose.synthetic.prints import Painter, banded, label, layered

__all__ = ["CATALOGUE_FILE", "SPLITS", "SUITE", "NearSymmetry", "SuiteObject", "main", "make_suite_mesh",
           "select_objects", "write_objects"]

logger = logging.getLogger(__name__)

SPLITS = ("tune", "held_out")
CATALOGUE_FILE = "objects.json"
_CELL_PX = 256
_MARGIN = 0.03  # fraction of a cell left free on each side (bilinear lookups stay inside the cell)
Colour = tuple[int, int, int]
Built = list[tuple[Part, Painter]]


@dataclass(frozen=True, slots=True)
class NearSymmetry:
    """A symmetry the object's shape nearly has. declaration: ``--symmetry`` spelling (``z:inf``, ``x:2``) in the
    mesh frame; point: a point of its axis (mesh frame, metres); broken_by: ``"geometry"`` and / or ``"texture"``;
    detail: what breaks it, in words."""

    declaration: str
    point: tuple[float, float, float]
    broken_by: tuple[str, ...]
    detail: str

    def symmetry(self) -> Symmetry:
        """The declaration as a :class:`~foundationpose.symmetry.Symmetry` about its axis point."""
        return dataclasses.replace(parse_symmetry(self.declaration), point=self.point)

    def test_symmetry(self) -> Symmetry:
        """The rotations that would map the object onto itself were it symmetric, as a discrete symmetry: the
        declaration itself, or every 60 degrees about the axis of a continuous one."""
        sym = self.symmetry()
        return sym if sym.kind == "discrete" else Symmetry("discrete", axis=sym.axis, order=6, point=sym.point)

    def test_angles_deg(self) -> tuple[float, ...]:
        """The angles of :meth:`transforms_mesh`: every non-zero multiple of 360 / the test symmetry's order."""
        order = self.test_symmetry().order or 1
        return tuple(360.0 * k / order for k in range(1, order))

    def transforms_mesh(self) -> np.ndarray:
        """(K, 4, 4) mesh-frame rotations by :meth:`test_angles_deg` about the axis through :attr:`point`."""
        origin = np.zeros(3)  # the mesh frame stands in for the centred one: the axis point is given
        return to_mesh_frame_tfs(symmetry_tfs([self.test_symmetry()], origin), origin)[1:]

    def describe(self) -> dict[str, Any]:
        return {"declaration": self.declaration, "point_m": list(self.point), "broken_by": list(self.broken_by),
                "detail": self.detail}


@dataclass(frozen=True, slots=True)
class SuiteObject:
    """One object of the suite: its builder draws colours and marks from the generator it is given."""

    name: str
    split: str
    description: str
    near_symmetries: tuple[NearSymmetry, ...]
    build: Callable[[np.random.Generator], Built]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "description": self.description,
                "near_symmetries": [s.describe() for s in self.near_symmetries]}


def _pick(rng: np.random.Generator, palette: Sequence[Colour]) -> Colour:
    colour = np.asarray(palette[int(rng.integers(len(palette)))], dtype=np.int64)
    return tuple(int(c) for c in np.clip(colour + rng.integers(-12, 13, size=3), 0, 255))  # type: ignore[return-value]


_BRIGHT = ((200, 40, 40), (30, 110, 200), (40, 160, 70), (230, 160, 20), (150, 50, 160), (20, 150, 160))
_DARK = ((30, 30, 35), (60, 40, 30), (25, 45, 80), (70, 20, 25))
_PAPER = ((245, 240, 225), (250, 250, 250), (240, 225, 160))
_METAL = (175, 178, 182)


def _mug(rng: np.random.Generator) -> Built:
    glaze, stripe = _pick(rng, _BRIGHT), _pick(rng, _DARK)
    body = prism(circle(0.041, 64), 0.0, 0.096)
    handle = transformed(tube_arc(0.03, 0.0065, -75.0, 75.0, tube_scale=(1.0, 1.6)), _translation(0.033, 0.0, 0.056))
    return [(body, banded(glaze, [(0.86, 0.92, stripe)], caps=((205, 190, 160), (70, 45, 30)))),
            (handle, banded(glaze))]


def _spray_bottle(rng: np.random.Generator) -> Built:
    liquid, head = _pick(rng, _BRIGHT), _pick(rng, _DARK)
    body = prism(circle(0.035, 48), 0.0, 0.16, top=circle(0.031, 48))
    shoulder = prism(circle(0.031, 48), 0.16, 0.185, top=circle(0.014, 48), caps=(False, False))
    neck = prism(circle(0.013, 32), 0.185, 0.207, caps=(False, False))
    top = prism(rectangle(0.07, 0.03, centre=(0.012, 0.0)), 0.205, 0.24, smooth=False)
    nozzle = transformed(prism(circle(0.005, 16), 0.0, 0.012), _translation(0.047, 0.0, 0.226) @ rotation("y", 90.0))
    trigger = prism(rectangle(0.012, 0.02, centre=(0.03, 0.0)), 0.165, 0.205, smooth=False)
    return [(body, banded(liquid, [(0.9, 0.94, (250, 250, 250))], caps=(liquid, liquid))),
            (shoulder, banded(liquid)), (neck, banded(head)), (top, banded(head)), (nozzle, banded(head)),
            (trigger, banded(head))]


def _cereal_box(rng: np.random.Generator) -> Built:
    card, paper, ink, accent = _pick(rng, _BRIGHT), _pick(rng, _PAPER), _pick(rng, _DARK), _pick(rng, _BRIGHT)
    footprint = rectangle(0.19, 0.065)
    spans = perimeter_fractions(footprint)  # sides: +x, +y, -x, -y (the front)
    u0, u1 = spans[3], spans[4]
    front = label((u0 + 0.04 * (u1 - u0), u1 - 0.3 * (u1 - u0), 0.62, 0.95), rng, paper=paper, ink=ink, accent=accent)
    return [(prism(footprint, 0.0, 0.27, smooth=False), layered(banded(card), front))]


def _can(rng: np.random.Generator) -> Built:
    colour, paper, ink, accent = _pick(rng, _BRIGHT), _pick(rng, _PAPER), _pick(rng, _DARK), _pick(rng, _BRIGHT)
    body = prism(circle(0.033, 64), 0.005, 0.116)
    bottom = prism(circle(0.026, 64), 0.0, 0.005, top=circle(0.033, 64), caps=(True, False))
    top = prism(circle(0.033, 64), 0.116, 0.122, top=circle(0.029, 64), caps=(False, True))
    printed = layered(banded(colour), label((0.05, 0.45, 0.4, 0.9), rng, paper=paper, ink=ink, accent=accent))
    return [(body, printed), (bottom, banded(_METAL)), (top, banded(_METAL))]


def _drill(rng: np.random.Generator) -> Built:
    shell, grip = _pick(rng, _BRIGHT), _pick(rng, _DARK)
    along_x = rotation("y", 90.0)  # the builders' z becomes +x
    barrel = transformed(prism(circle(0.03, 48), -0.09, 0.07), _translation(0.0, 0.0, 0.2) @ along_x)
    chuck = transformed(prism(circle(0.022, 32), 0.07, 0.11, top=circle(0.012, 32)),
                        _translation(0.0, 0.0, 0.2) @ along_x)
    handle = prism(rectangle(0.035, 0.03, centre=(-0.035, 0.0)), 0.06, 0.175, smooth=False, caps=(False, False))
    battery = prism(rectangle(0.085, 0.065, centre=(-0.03, 0.0)), 0.0, 0.06, smooth=False)
    return [(barrel, banded(shell, [(0.35, 0.42, grip)], caps=(grip, grip))), (chuck, banded(grip)),
            (handle, banded(grip)), (battery, banded(grip, [(0.6, 0.7, shell)]))]


def _shoe_outline(length: float, width: float, segments: int = 48) -> np.ndarray:
    """A shoe's footprint: an ellipse whose toe end (+x) is wider than its heel end."""
    t = 2.0 * np.pi * np.arange(segments) / segments
    return np.column_stack([length / 2 * np.cos(t), width / 2 * np.sin(t) * (1.0 + 0.22 * np.cos(t))])


def _shoe(rng: np.random.Generator) -> Built:
    fabric, stripe = _pick(rng, _BRIGHT), _pick(rng, _PAPER)
    sole_outline = _shoe_outline(0.27, 0.09)
    sole = prism(sole_outline, 0.0, 0.025)
    upper_bottom = 0.95 * sole_outline
    upper_top = 0.55 * sole_outline + np.array([-0.05, 0.0])  # tapers toward the ankle, behind the middle
    upper = prism(upper_bottom, 0.025, 0.08, top=upper_top, caps=(False, True))
    collar = prism(circle(0.032, 32, centre=(-0.07, 0.0), scale=(1.2, 1.0)), 0.07, 0.115,
                   top=circle(0.029, 32, centre=(-0.075, 0.0), scale=(1.2, 1.0)))
    return [(sole, banded((235, 235, 230), caps=((60, 60, 60), (235, 235, 230)))),
            (upper, banded(fabric, [(0.55, 0.65, stripe)], caps=(fabric, (40, 40, 45)))),
            (collar, banded(fabric, caps=(fabric, (40, 40, 45))))]


def _jar(rng: np.random.Generator) -> Built:
    content, paper, ink, accent = _pick(rng, _BRIGHT), _pick(rng, _PAPER), _pick(rng, _DARK), _pick(rng, _BRIGHT)
    body = prism(circle(0.042, 64), 0.0, 0.10, caps=(True, False))
    shoulder = prism(circle(0.042, 64), 0.10, 0.11, top=circle(0.036, 64), caps=(False, False))
    lid = prism(circle(0.038, 64), 0.11, 0.128)
    printed = layered(banded(content), label((0.55, 0.95, 0.45, 0.9), rng, paper=paper, ink=ink, accent=accent))
    return [(body, printed), (shoulder, banded(content)), (lid, banded((200, 165, 60)))]


def _book(rng: np.random.Generator) -> Built:
    cover, paper, ink, accent = _pick(rng, _BRIGHT), _pick(rng, _PAPER), _pick(rng, _DARK), _pick(rng, _BRIGHT)
    footprint = rectangle(0.15, 0.03)
    spans = perimeter_fractions(footprint)  # sides: +x (the spine), +y (the back), -x (the pages), -y (the front)
    pages = (238, 232, 210)
    spine = label((spans[0] + 0.002, spans[1] - 0.002, 0.45, 0.9), rng, paper=cover, ink=paper, accent=accent, lines=2)
    back = label((spans[1] + 0.05 * (spans[2] - spans[1]), spans[2] - 0.05 * (spans[2] - spans[1]), 0.35, 0.6), rng,
                 paper=cover, ink=paper, accent=cover, lines=5)
    edge = label((spans[2], spans[3], SIDE_V0, 1.0), rng, paper=pages, ink=pages, accent=pages, lines=0)
    front = label((spans[3] + 0.1 * (spans[4] - spans[3]), spans[4] - 0.1 * (spans[4] - spans[3]), 0.7, 0.95), rng,
                  paper=paper, ink=ink, accent=accent, lines=2)
    return [(prism(footprint, 0.0, 0.22, smooth=False), layered(banded(cover, caps=(pages, pages)), spine, back, edge,
                                                                  front))]


def _translation(x: float, y: float, z: float) -> np.ndarray:
    tf = np.eye(4)
    tf[:3, 3] = (x, y, z)
    return tf


def _about(axis_point: tuple[float, float, float], *declarations: str, broken_by: tuple[str, ...],
           detail: str) -> tuple[NearSymmetry, ...]:
    return tuple(NearSymmetry(d, axis_point, broken_by, detail) for d in declarations)


SUITE: tuple[SuiteObject, ...] = (
    SuiteObject("mug", "tune", "a 8.2 cm mug, 9.6 cm tall, glazed with a rim stripe, a C-shaped handle",
                _about((0.0, 0.0, 0.048), "z:inf", broken_by=("geometry",), detail="the handle"), _mug),
    SuiteObject("spray_bottle", "tune", "a 24 cm spray bottle: tapered body, neck, a trigger head with a nozzle",
                _about((0.0, 0.0, 0.12), "z:inf", broken_by=("geometry",), detail="the trigger head and nozzle"), _spray_bottle),
    SuiteObject("cereal_box", "tune", "a 19 x 6.5 x 27 cm carton, one colour, a printed label on its front",
                _about((0.0, 0.0, 0.135), "z:2", "x:2", "y:2", broken_by=("texture",),
                       detail="the label, on the front's upper left"), _cereal_box),
    SuiteObject("can", "tune", "a 6.6 cm drinks can, 12.2 cm tall, with a printed label over part of its wrap",
                _about((0.0, 0.0, 0.061), "z:inf", broken_by=("texture",), detail="the printed label"), _can),
    SuiteObject("drill", "held_out", "a 20 cm cordless drill: barrel and chuck along x, a grip, a battery below",
                _about((0.0, 0.0, 0.2), "x:inf", broken_by=("geometry",), detail="the grip and battery"), _drill),
    SuiteObject("shoe", "held_out", "a 27 cm shoe: sole, upper tapering to an ankle collar over the heel",
                _about((0.0, 0.0, 0.04), "z:2", broken_by=("geometry",), detail="the wide toe and the heel collar"), _shoe),
    SuiteObject("jar", "held_out", "an 8.4 cm jam jar, 12.8 cm tall, with a lid and a printed label",
                _about((0.0, 0.0, 0.064), "z:inf", broken_by=("texture",), detail="the printed label"), _jar),
    SuiteObject("book", "held_out", "a 15 x 3 x 22 cm book standing upright: cover, back, spine and page edges",
                _about((0.0, 0.0, 0.11), "z:2", "x:2", "y:2", broken_by=("texture",),
                       detail="front cover, back cover, spine and page edges printed differently"), _book),
)


def select_objects(names: Sequence[str] | None = None, split: str = "all") -> tuple[SuiteObject, ...]:
    """The suite's objects named (in :data:`SUITE`'s order; all when None) within ``split`` (``tune``,
    ``held_out`` or ``all``). Raises InputError naming the known objects or splits."""
    if split not in (*SPLITS, "all"):
        raise InputError("--split", f"one of {', '.join(SPLITS)}, all", repr(split))
    known = [o.name for o in SUITE]
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise InputError("--objects", f"names of the suite's objects ({', '.join(known)})", ", ".join(unknown))
    chosen = tuple(o for o in SUITE if (names is None or o.name in names) and split in ("all", o.split))
    if not chosen:
        raise InputError("--objects", f"at least one object of split {split!r}", ", ".join(names or ()) or "none")
    return chosen


def _atlas(painted: Built) -> tuple[np.ndarray, list[np.ndarray]]:
    """The texture atlas (one cell per part, row-major) and each part's UVs in it."""
    cells = math.ceil(math.sqrt(len(painted)))
    side = cells * _CELL_PX
    atlas = np.zeros((side, side, 3), dtype=np.uint8)
    centres = (np.arange(_CELL_PX) + 0.5) / _CELL_PX
    local = (centres - _MARGIN) / (1.0 - 2.0 * _MARGIN)
    u, v = np.meshgrid(local, 1.0 - local)  # image row 0 is the top of the cell (v = 1)
    uvs = []
    for index, (part, painter) in enumerate(painted):
        row, col = divmod(index, cells)
        image = np.clip(np.round(painter(np.clip(u, 0.0, 1.0), np.clip(v, 0.0, 1.0))), 0, 255).astype(np.uint8)
        atlas[row * _CELL_PX:(row + 1) * _CELL_PX, col * _CELL_PX:(col + 1) * _CELL_PX] = image
        pu = (col + _MARGIN + part.uv[:, 0] * (1.0 - 2.0 * _MARGIN)) / cells
        pv = 1.0 - (row + _MARGIN + (1.0 - part.uv[:, 1]) * (1.0 - 2.0 * _MARGIN)) / cells
        uvs.append(np.column_stack([pu, pv]))
    return atlas, uvs


def make_suite_mesh(name: str, seed: int = 0) -> trimesh.Trimesh:
    """The named object of :data:`SUITE` as a textured ``trimesh.Trimesh`` (metres, UV texture atlas)."""
    (obj,) = select_objects([name])
    index = [o.name for o in SUITE].index(name)
    painted = obj.build(np.random.default_rng([seed, index]))
    atlas, uvs = _atlas(painted)
    offsets = np.cumsum([0] + [len(p.vertices) for p, _ in painted])
    mesh = trimesh.Trimesh(vertices=np.concatenate([p.vertices for p, _ in painted]),
                           faces=np.concatenate([p.faces + o for (p, _), o in zip(painted, offsets, strict=False)]),
                           process=False)
    mesh.visual = trimesh.visual.TextureVisuals(uv=np.concatenate(uvs), image=Image.fromarray(atlas, mode="RGB"))
    mesh.metadata["name"] = name
    return mesh


def write_objects(out_dir: Path, names: Sequence[str] | None = None, seed: int = 0,
                  split: str = "all") -> dict[str, Any]:
    """Write ``out_dir/<name>.glb`` for each selected object and ``out_dir/objects.json`` (the catalogue: per
    object its facts, file and SHA-256, and the seed); returns the catalogue."""
    out_dir.mkdir(parents=True, exist_ok=True)
    catalogue: dict[str, Any] = {"generator": "foundationpose.synthetic.objects", "seed": seed, "objects": {}}
    for obj in select_objects(names, split):
        data = make_suite_mesh(obj.name, seed).export(file_type="glb")
        path = out_dir / f"{obj.name}.glb"
        path.write_bytes(data)
        catalogue["objects"][obj.name] = obj.describe() | {"file": path.name,
                                                            "sha256": hashlib.sha256(data).hexdigest()}
        logger.info("wrote %s (%d bytes)", path, len(data))
    (out_dir / CATALOGUE_FILE).write_text(json.dumps(catalogue, indent=2) + "\n", encoding="utf-8")
    return catalogue


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m foundationpose.synthetic.objects",
                                description="Write the object suite's meshes (GLB, embedded texture) and objects.json.")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    p.add_argument("--objects", nargs="+", default=None, metavar="NAME",
                   help=f"objects to write (default: all of {', '.join(o.name for o in SUITE)})")
    p.add_argument("--split", choices=(*SPLITS, "all"), default="all", help="default: all")
    p.add_argument("--seed", type=int, default=0, help="colour and label seed (default: 0)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        catalogue = write_objects(args.out, args.objects, args.seed, args.split)
    except InputError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({name: o["file"] for name, o in catalogue["objects"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
