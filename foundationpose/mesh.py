"""Load an object mesh once and derive everything the pose pipeline needs from it (spec §1.1, §2.4).

``load_object`` reads OBJ / PLY / GLB (anything trimesh loads) in metres, centres it on the
axis-aligned bounding box of its vertices, recomputes vertex normals the way trimesh does for
the reference's centred copy, measures the diameter and uploads ``MeshTensors`` for the renderer.

Colour sources, in order (spec §1.1):

1. texture visuals with an image: RGB texture (alpha dropped), UVs with ``v' = 1 - v``, ``uv_faces = faces``;
2. colour visuals: per-vertex colours (face colours are averaged to vertices by trimesh); a mesh without
   any colour gets trimesh's default grey 102/255 on every vertex;
3. texture visuals whose material has **no image**: the reference fails here; we log a warning and use
   the material's main colour (``diffuse`` / ``baseColorFactor``, trimesh grey when unset) per vertex.

Texture size: ``load_object(..., max_texture_side=N)`` downscales a larger texture image (whatever path
it came by: an OBJ's material, a GLB's embedded image, a texture given separately) to at most N pixels
per side before it is decoded in full, and refuses images above Pillow's decompression-bomb threshold
(``PIL.Image.MAX_IMAGE_PIXELS``) with :class:`~foundationpose.errors.InputTooLargeError`. A 160x160
crop samples far fewer texels than a 2048-pixel texture holds; ``None`` keeps the image as the
reference does.

8-bit colours become floats as ``c * float32(1/255)``: the reference divides by 255 on the GPU, which
PyTorch evaluates as a multiplication by the float32 reciprocal (1 ulp from ``c / 255`` for some ``c``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trimesh
from PIL import Image
from torch import Tensor

from .coordinate_frames import centred_from_mesh as _centred_from_mesh
from .coordinate_frames import mesh_from_centred as _mesh_from_centred
from .errors import InputError, InputTooLargeError
from .symmetry import ObjectSymmetry, Symmetry

__all__ = [
    "DIAMETER_MAX_POINTS",
    "MeshTensors",
    "ObjectModel",
    "load_object",
    "mesh_diameter",
    "colors_u8_to_float",
    "limit_texture_images",
    "material_image",
    "reduced_texture",
]

logger = logging.getLogger(__name__)

DIAMETER_MAX_POINTS = 10_000  # diameter from at most this many random vertices (spec §1.1)
_DIAMETER_CHUNK_ELEMENTS = 1 << 22  # pairwise differences held at once while measuring the diameter
_INV_255_F32 = np.float32(np.float32(1.0) / np.float32(255.0))


@dataclass(frozen=True, eq=False)
class MeshTensors:
    """The centred mesh as tensors on one device (spec §1.1 "mesh tensors").

    verts: (V, 3) float32 metres, centred frame. faces: (F, 3) int32 vertex indices.
    normals: (V, 3) float32 unit vertex normals (trimesh-recomputed; zero for unreferenced vertices).
    Exactly one colour source is set:
    uv: (V, 2) float32 texture coordinates with ``v' = 1 - v`` (image row 0 at v' = 0), uv_faces: (F, 3) int32
    (= faces) and texture: (Ht, Wt, 3) float32 RGB in [0, 1]; or vertex_colors: (V, 3) float32 RGB in [0, 1].
    """

    verts: Tensor
    faces: Tensor
    normals: Tensor
    uv: Tensor | None = None
    uv_faces: Tensor | None = None
    texture: Tensor | None = None
    vertex_colors: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.verts.device

    @property
    def has_texture(self) -> bool:
        return self.texture is not None

    def to(self, device: str | torch.device) -> MeshTensors:
        """A copy with every tensor on ``device`` (self when already there)."""
        device = torch.device(device)
        if self.verts.device == device:
            return self
        moved = {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
            for f in dataclasses.fields(self)
        }
        return MeshTensors(**moved)


@dataclass(frozen=True, eq=False)
class ObjectModel:
    """A loaded object: the mesh, its centring, diameter and renderer tensors (read-only).

    name: label (file stem by default). mesh: the original trimesh (mesh frame, metres).
    mesh_centred: trimesh copy translated by ``-mesh_centre`` (centred frame, recomputed normals).
    mesh_centre: (3,) float64 ``c`` = AABB centre of the vertices, mesh frame.
    diameter: float (the float64 value), metres. tensors: ``MeshTensors`` of ``mesh_centred``.
    centred_from_mesh: (4, 4) float64 translation ``-c`` (spec ``Tc``); mesh_from_centred: its inverse.
    validity: the thresholds that judge this object's track results (a
    :class:`foundationpose.validity.ValidityConfig`); None = the calibrated defaults.
    symmetry: the object's declared symmetries (:class:`foundationpose.symmetry.ObjectSymmetry`), used by the
    register's hypothesis grid and for the reported pose of a session; None = not symmetric.
    """

    name: str
    mesh: trimesh.Trimesh
    mesh_centred: trimesh.Trimesh
    mesh_centre: np.ndarray
    diameter: float
    tensors: MeshTensors
    centred_from_mesh: np.ndarray
    mesh_from_centred: np.ndarray
    validity: Any = None
    symmetry: ObjectSymmetry | None = None

    @property
    def symmetry_tfs(self) -> np.ndarray | None:
        """(K, 4, 4) float64 symmetry transforms in the centred frame (the register grid's), or None."""
        return None if self.symmetry is None else self.symmetry.tfs_centred

    @property
    def radius(self) -> float:
        """``rho = d / 2`` metres (xyz normaliser and translation scale)."""
        return self.diameter / 2

    @cached_property
    def oriented_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``(to_origin (4, 4) float64, extents (3,) float64)`` of the ORIGINAL mesh (trimesh ``oriented_bounds``).

        Used to draw the 3D box with pose ``cam_from_mesh @ inv(to_origin)`` (spec §7.2). Computed on first
        use (it needs a convex hull, i.e. scipy).
        """
        to_origin, extents = trimesh.bounds.oriented_bounds(self.mesh)
        to_origin = np.asarray(to_origin, dtype=np.float64)
        extents = np.asarray(extents, dtype=np.float64)
        to_origin.setflags(write=False)
        extents.setflags(write=False)
        return to_origin, extents


def colors_u8_to_float(colors: np.ndarray) -> np.ndarray:
    """8-bit colours to float32 in [0, 1] as the reference computes them: ``float32(c) * float32(1/255)``."""
    return np.asarray(colors, dtype=np.float32) * _INV_255_F32


def _max_pairwise_distance(pts: np.ndarray) -> float:
    """Reference: max over i, j of ``np.linalg.norm(pts[j] - pts[i])`` (float64), in row chunks."""
    m = len(pts)
    rows_per_chunk = max(1, _DIAMETER_CHUNK_ELEMENTS // (3 * m))
    best = 0.0
    for start in range(0, m, rows_per_chunk):
        diffs = pts[None, :, :] - pts[start : start + rows_per_chunk, None, :]  # (rows, m, 3)
        best = max(best, float(np.linalg.norm(diffs, axis=-1).max()))
    return best


def _candidate_pairs(pts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs whose squared distance is within a safe margin of the maximum (Gram-matrix estimate)."""
    centred = pts - pts.mean(axis=0)
    sq = (centred * centred).sum(axis=1)  # (m,)
    margin = 1e-9 * 4.0 * float(sq.max())  # >> rounding error of the Gram estimate (~1e-15 relative)
    m = len(pts)
    rows_per_chunk = max(1, _DIAMETER_CHUNK_ELEMENTS // m)

    def estimate(start: int) -> np.ndarray:
        rows = slice(start, start + rows_per_chunk)
        est = centred[rows] @ centred.T  # (rows, m); in place below to limit memory traffic
        est *= -2.0
        est += sq[rows, None]
        est += sq[None, :]
        return est

    best = max(float(estimate(start).max()) for start in range(0, m, rows_per_chunk))
    firsts, seconds = [], []
    for start in range(0, m, rows_per_chunk):
        i, j = np.nonzero(estimate(start) >= best - margin)
        firsts.append(i + start)
        seconds.append(j)
    return np.concatenate(firsts), np.concatenate(seconds)


def mesh_diameter(verts: np.ndarray, seed: int = 0, max_points: int = DIAMETER_MAX_POINTS) -> float:
    """Maximum pairwise distance between vertices (spec §1.1), float64.

    verts: (V, 3) float64 metres. With V <= max_points the result is the exact maximum over all vertices;
    otherwise over ``np.random.RandomState(seed).choice(V, max_points, replace=False)`` — what the reference
    draws from NumPy's global legacy RNG after ``np.random.seed(seed)``. The value is the reference's
    ``np.linalg.norm(p_j - p_i)`` maximised over all pairs; to keep it fast, pairs are first screened
    with a Gram-matrix estimate of the squared distance and only those within a margin far above its
    rounding error are evaluated with the reference expression (same result as the brute force).
    """
    pts = np.asarray(verts, dtype=np.float64)
    n_verts = len(pts)
    if n_verts > max_points:
        ids = np.random.RandomState(seed).choice(n_verts, size=max_points, replace=False)
        pts = pts[ids]
    if len(pts) < 2:
        return 0.0
    first, second = _candidate_pairs(pts)
    return float(np.linalg.norm(pts[second] - pts[first], axis=-1).max())


def _load_trimesh(
    source: str | Path | trimesh.Trimesh | trimesh.Scene, max_texture_side: int | None
) -> tuple[trimesh.Trimesh, str]:
    """Load (or accept) one triangle mesh; scenes are merged into one mesh with their transforms baked in.

    Texture images are limited (``limit_texture_images``) before the merge; an in-memory source is copied
    first (never modified), so limit it yourself beforehand to avoid the copy decoding a large image.
    """
    if isinstance(source, (trimesh.Trimesh, trimesh.Scene)):
        loaded, name = source.copy(), str(source.metadata.get("name") or "mesh")  # never modify the caller's
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise InputError("mesh", "an existing mesh file (OBJ, PLY, GLB, ...)", f"'{path}' (no such file)")
        try:
            loaded = trimesh.load(str(path))  # same call as the reference for OBJ / PLY
        except Exception as exc:  # trimesh raises many types for unknown or broken files
            raise InputError(
                "mesh",
                "a mesh file trimesh can read (OBJ, PLY, GLB, ...)",
                f"'{path.name}' ({type(exc).__name__}: {exc})",
            ) from exc
        name = path.stem
    else:
        raise InputError("mesh", "a file path or a trimesh.Trimesh", type(source).__name__)
    limit_texture_images(loaded, max_texture_side)
    if isinstance(loaded, trimesh.Scene):
        meshes = [g for g in loaded.geometry.values() if isinstance(g, trimesh.Trimesh)]
        if not meshes:
            raise InputError("mesh", "at least one triangle mesh", "a scene without triangle meshes")
        loaded = loaded.to_mesh()
    if not isinstance(loaded, trimesh.Trimesh):
        raise InputError("mesh", "a triangle mesh", type(loaded).__name__)
    return loaded, name


def _check_geometry(mesh: trimesh.Trimesh) -> None:
    verts = np.asarray(mesh.vertices)
    faces = np.asarray(mesh.faces)
    if len(verts) == 0 or len(faces) == 0:
        raise InputError("mesh", "a non-empty triangle mesh", f"{len(verts)} vertices and {len(faces)} faces")
    if not np.isfinite(verts).all():
        raise InputError(
            "mesh",
            "finite vertex coordinates",
            f"{int((~np.isfinite(verts)).any(axis=1).sum())} vertices with NaN or inf",
        )
    if faces.ndim != 2 or faces.shape[1] != 3:
        raise InputError("mesh", "triangle faces (F, 3)", f"faces of shape {faces.shape}")


def material_image(material: object) -> Image.Image | None:
    """The texture image of a trimesh material: ``image`` (simple materials) or ``baseColorTexture`` (PBR, GLB)."""
    image = getattr(material, "image", None)
    if image is None:
        image = getattr(material, "baseColorTexture", None)  # PBR materials (GLB)
    return image


def reduced_texture(image: Image.Image, max_side: int | None, field: str = "mesh") -> Image.Image:
    """``image`` decoded at most ``max_side`` pixels per side (aspect kept); the header is checked first.

    Pillow opens lazily: ``size`` comes from the header, so a bomb is refused before any pixel is decoded,
    and JPEGs are decoded at a reduced scale (``draft``) instead of in full.
    """
    width, height = image.size
    if width * height > Image.MAX_IMAGE_PIXELS:
        raise InputTooLargeError(
            field,
            f"a texture image of at most {Image.MAX_IMAGE_PIXELS} pixels (Pillow's decompression-bomb limit)",
            f"{width}x{height}",
        )
    if max_side is None or max(width, height) <= max_side:
        return image
    scale = max_side / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    if image.format == "JPEG":
        image.draft("RGB", size)  # decode at 1/2, 1/4 or 1/8 scale: never the full image
    try:
        image.load()  # PNG: the full image once (no RGB copy of it below); JPEG: the draft scale
        if image.mode not in ("RGB", "RGBA", "L"):
            image = image.convert("RGB")  # palette / 16-bit modes cannot be reduced as they are
        factor = max(1, min(image.size[0] // size[0], image.size[1] // size[1]))
        reduced = image.reduce(factor) if factor > 1 else image  # cheap box step to near the target
        reduced = reduced.resize(size, Image.Resampling.LANCZOS)
        reduced = reduced if reduced.mode == "RGB" else reduced.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(field, "a decodable texture image", f"{type(exc).__name__}") from exc
    logger.info("texture %dx%d downscaled to %dx%d (max_texture_side %d)", width, height, *size, max_side)
    return reduced


def limit_texture_images(loaded: trimesh.Trimesh | trimesh.Scene, max_side: int | None) -> None:
    """Check, and downscale to ``max_side`` pixels per side, every texture image of ``loaded`` in place.

    Call it on a freshly loaded mesh or scene before anything copies it: trimesh decodes a lazily opened
    image in full when it copies or merges materials. Raises InputTooLargeError above Pillow's bomb limit.
    """
    meshes = loaded.geometry.values() if isinstance(loaded, trimesh.Scene) else (loaded,)
    for mesh in meshes:
        visual = getattr(mesh, "visual", None)
        if not isinstance(visual, trimesh.visual.TextureVisuals) or visual.material is None:
            continue
        for attr in ("image", "baseColorTexture"):
            image = getattr(visual.material, attr, None)
            if isinstance(image, Image.Image):
                reduced = reduced_texture(image, max_side)
                if reduced is not image:
                    setattr(visual.material, attr, reduced)


def _colour_tensors(mesh: trimesh.Trimesh, device: torch.device) -> dict[str, Tensor]:
    """Colour fields of ``MeshTensors`` for the centred mesh (see module docstring for the rules)."""
    n_verts = len(mesh.vertices)
    visual = mesh.visual
    if isinstance(visual, trimesh.visual.TextureVisuals):
        image = material_image(visual.material)
        if image is not None:
            uv = None if visual.uv is None else np.asarray(visual.uv, dtype=np.float64)
            if uv is None or uv.ndim != 2 or uv.shape != (n_verts, 2):
                got = "no UV coordinates" if uv is None else f"UVs of shape {uv.shape} for {n_verts} vertices"
                raise InputError("mesh", "one (u, v) per vertex for the texture image", got)
            if not np.isfinite(uv).all():
                raise InputError("mesh", "finite UV coordinates", "UVs with NaN or inf")
            rgb = np.asarray(image.convert("RGB"))[..., :3]
            if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
                raise InputError("mesh", "a non-empty texture image", f"an image of shape {rgb.shape}")
            uv_t = torch.tensor(uv, dtype=torch.float32, device=device)
            uv_t[:, 1] = 1 - uv_t[:, 1]  # image row 0 at v' = 0, in float32 like the reference
            return {
                "uv": uv_t,
                "uv_faces": torch.tensor(np.asarray(mesh.faces), dtype=torch.int32, device=device),
                "texture": torch.tensor(colors_u8_to_float(rgb), device=device),
            }
        main = getattr(visual.material, "main_color", None)
        colour = np.asarray(trimesh.visual.color.to_rgba(main), dtype=np.uint8).reshape(-1)[:3]
        logger.warning(
            "mesh material %r has no texture image: rendering with its main colour %s "
            "(the reference implementation fails on such meshes)",
            getattr(visual.material, "name", None),
            colour.tolist(),
        )
        colours = np.tile(colour, (n_verts, 1))
    else:
        colours = np.asarray(visual.vertex_colors)[:, :3]  # trimesh default grey 102 when undefined
    return {"vertex_colors": torch.tensor(colors_u8_to_float(colours), device=device).reshape(n_verts, 3)}


def load_object(
    path_or_trimesh: str | Path | trimesh.Trimesh | trimesh.Scene,
    device: str | torch.device = "cpu",
    diameter_seed: int = 0,
    *,
    name: str | None = None,
    max_diameter_m: float | None = 10.0,
    max_texture_side: int | None = None,
    symmetries: Sequence[Symmetry] = (),
    validity: Any = None,
) -> ObjectModel:
    """Load a mesh (metres) and prepare it for registration and tracking (spec §1.1).

    path_or_trimesh: OBJ / PLY / GLB / ... path (read with ``trimesh.load``; a multi-mesh scene is merged
        into one mesh, transforms baked) or an in-memory ``trimesh.Trimesh`` (not modified).
    device: where ``tensors`` live. diameter_seed: seed of the vertex subset for meshes with more than
        10 000 vertices (0 = the reference demo's global seed).
    name: label for logs and the server (default: the file stem).
    max_diameter_m: reject meshes wider than this (metres) as probably not in metres; None disables.
    max_texture_side: downscale a larger texture image to this many pixels per side (None: keep it).
    symmetries: the object's symmetries (:func:`foundationpose.symmetry.parse_symmetry`, ``load_symmetry_file``).
    validity: its validity thresholds (a :class:`foundationpose.validity.ValidityConfig`; None = the defaults).
    Raises ``InputError`` (field ``mesh``) for unreadable files, empty meshes, non-finite vertices,
    texture images without matching UVs, a zero or implausibly large diameter.
    """
    mesh, default_name = _load_trimesh(path_or_trimesh, max_texture_side)
    _check_geometry(mesh)
    verts = np.asarray(mesh.vertices, dtype=np.float64)
    centre = (verts.min(axis=0) + verts.max(axis=0)) / 2  # AABB centre, not the centroid

    centred = mesh.copy()  # like the reference: the copy drops cached normals, so trimesh recomputes them
    centred.vertices = centred.vertices - centre.reshape(1, 3)
    verts_centred = np.asarray(centred.vertices, dtype=np.float64)
    diameter = mesh_diameter(verts_centred, seed=diameter_seed)
    if not diameter > 0:
        raise InputError("mesh", "a mesh with non-zero extent", "all vertices at one point")
    if max_diameter_m is not None and diameter > max_diameter_m:
        raise InputError(
            "mesh",
            f"a mesh in metres (diameter <= {max_diameter_m:g} m)",
            f"diameter {diameter:.4g}",
            "Mesh in millimetres? Scale its vertices by 0.001",
        )

    dev = torch.device(device)
    normals = np.asarray(centred.vertex_normals, dtype=np.float64)
    tensors = MeshTensors(
        verts=torch.tensor(verts_centred, dtype=torch.float32, device=dev),
        faces=torch.tensor(np.asarray(centred.faces), dtype=torch.int32, device=dev),
        normals=torch.tensor(normals, dtype=torch.float32, device=dev),
        **_colour_tensors(centred, dev),
    )
    c_from_m = _centred_from_mesh(centre)
    m_from_c = _mesh_from_centred(centre)
    for arr in (centre, c_from_m, m_from_c):
        arr.setflags(write=False)
    model = ObjectModel(
        name=name or default_name,
        mesh=mesh,
        mesh_centred=centred,
        mesh_centre=centre,
        diameter=float(diameter),
        tensors=tensors,
        centred_from_mesh=c_from_m,
        mesh_from_centred=m_from_c,
        symmetry=ObjectSymmetry.of(symmetries, centre),
        validity=validity,
    )
    logger.info(
        "loaded object %r: %d vertices, %d faces, diameter %.4f m, %s",
        model.name,
        len(verts),
        len(mesh.faces),
        model.diameter,
        "textured" if tensors.has_texture else "vertex colours",
    )
    return model
