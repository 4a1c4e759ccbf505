"""The object registry: meshes by id, loaded from the objects directory and added by upload.

Layout of the objects directory (``--objects DIR``):

* ``<id>/`` with one mesh file (``*.obj``, ``*.ply`` or ``*.glb``; an OBJ may bring its MTL and
  texture images) and optionally ``texture.png`` / ``texture.jpg`` applied to the mesh's UVs;
* ``<id>.obj`` / ``<id>.ply`` / ``<id>.glb`` directly in the directory;
* uploads are stored as ``<id>/mesh.<ext>`` (+ ``texture.<ext>``) with an ``object.json`` marker;
  they are parsed from bytes only (no file references are followed, e.g. an OBJ's ``mtllib``);
* an ``<id>/object.json`` may declare the object's properties (an upload's holds those it was uploaded with):
  ``"symmetry"``, a list of declarations (``"z:4"``, ``"z:inf"``, ``"0,0,1:2"``:
  :func:`foundationpose.symmetry.parse_symmetry`), and ``"validity"``, thresholds of
  :class:`foundationpose.validity.ValidityConfig` by name (the rest keep their calibrated defaults);
* symmetries found at upload: an uploaded mesh's symmetries and near-symmetries are detected from its geometry
  (:func:`foundationpose.symmetry_detect.detect_symmetries`, with whether its texture breaks each) and kept in its
  ``object.json`` as ``"symmetries_found"``. When the upload declares none, the real ones (neither the geometry nor
  the texture breaks them: :func:`~foundationpose.symmetry_detect.real_symmetries`) become the object's
  symmetries, so a symmetric object without a print is registered on its reduced grid and answered as the member
  of its symmetry class, never with an orientation it cannot know. A declaration wins over what was found.
  Objects put in the directory by hand are not searched (their ``symmetries_found`` is null: declare theirs).

Ids full-match ``^[A-Za-z0-9_-]{1,64}$`` (no trailing newline), so an id can never name a path outside the directory; every
path is built as ``root / id`` and checked to be a direct child of the root. Uploads are staged in a
hidden ``.staging-*`` folder inside the root and renamed into place once the mesh loaded.

Limits (:class:`server.limits.ObjectLimits`): an upload above ``max_faces`` / ``max_vertices`` or whose
register cost (faces x hypotheses x passes) is above the budget is refused with 413 naming the mesh
and the limit, unless it asks for ``simplify=true`` (decimated with fast-simplification; colours and
texture are dropped). Textures of every path are downscaled to ``max_texture_side``. The registry
holds at most ``max_objects`` objects and ``max_total_bytes`` of object memory (507 beyond).

Threading: ``load_all``, ``store_upload`` and ``delete_files`` do file and mesh work and run in a
worker thread; the dictionary is changed only from the event loop (``add``/``remove``/``reserve``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trimesh
from PIL import Image

from deploy_core.errors import CapacityError
from foundationpose.errors import InputError, InputTooLargeError, UnknownObjectError
from foundationpose.mesh import ObjectModel, limit_texture_images, load_object, reduced_texture
from foundationpose.symmetry import ObjectSymmetry, parse_symmetry
from foundationpose.symmetry_detect import DetectedSymmetry, detect_symmetries, real_symmetries
from foundationpose.validity import ValidityConfig
from server.codecs import JPEG_MAGIC, PNG_MAGIC, open_image
from server.errors import ConflictError, ImageTooLargeError, ObjectStoreFullError
from server.fields import EXPECTED, ID_PATTERN, check_id
from server.limits import ObjectLimits, register_cost

__all__ = ["OBJECT_ID_PATTERN", "MESH_SUFFIXES", "ObjectEntry", "ObjectRegistry", "check_object_id", "found_symmetries",
           "mesh_kind", "object_nbytes", "object_properties"]

log = logging.getLogger(__name__)

OBJECT_ID_PATTERN = ID_PATTERN
_ID_RE = re.compile(ID_PATTERN)
MESH_SUFFIXES = (".obj", ".ply", ".glb")
_TEXTURE_NAMES = ("texture.png", "texture.jpg", "texture.jpeg")
_MARKER = "object.json"
_STAGING_PREFIX = ".staging-"
MAX_TEXTURE_SIDE = 8192  # pixels; larger textures are refused before decoding


def check_object_id(object_id: str | None) -> str:
    """The id itself, or InputError (field ``object_id``) when it does not full-match the id pattern."""
    return check_id(object_id, "object_id")


def mesh_kind(data: bytes, filename: str | None) -> str:
    """``"obj"``, ``"ply"`` or ``"glb"`` from the content (GLB / PLY magic) or else the file name."""
    if data.startswith(b"glTF"):
        return "glb"
    if data[:4] in (b"ply\n", b"ply\r"):
        return "ply"
    suffix = Path(filename or "").suffix.lower()
    if suffix == ".obj" or (not suffix and b"\nv " in data[:65536]):
        return "obj"
    raise InputError("mesh", "an OBJ, PLY or GLB mesh file", f"{filename or 'a file'} of unknown format")


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """One registered object. mesh_file is relative to the objects directory."""

    object_id: str
    model: ObjectModel
    mesh_file: str
    textured: bool
    source: str  # "directory" or "upload"
    loaded_at_unix_s: float
    nbytes: int = 0  # memory held (object_nbytes), counted against ObjectLimits.max_total_bytes
    simplified_from_faces: int | None = None  # faces before ``simplify=true`` decimated the upload
    symmetries_found: tuple[DetectedSymmetry, ...] | None = None  # detected at upload; None: not searched
    symmetry_source: str | None = None  # "found" when model.symmetry are the real symmetries found at upload

    @property
    def symmetry_origin(self) -> str | None:
        """Where the object's symmetries come from: ``found`` (at upload), ``declared``, or None (none)."""
        return None if self.model.symmetry is None else (self.symmetry_source or "declared")

    def symmetry_answer(self) -> dict[str, Any]:
        """What every pose answer of this object says about its symmetries: ``symmetric_under``, the symmetries
        the answered pose is defined up to (declared, else the real ones found; empty: the orientation is
        determined), their ``source``, and ``found``: each symmetry or near-symmetry found at upload, whether the
        geometry or the texture breaks it and so whether it is ``real`` (null: the object was not searched)."""
        symmetry = self.model.symmetry
        found = None if self.symmetries_found is None else [
            {"declaration": d.declaration, "geometry_breaks": d.geometry_breaks, "texture_breaks": d.texture_breaks,
             "real": d.real} for d in self.symmetries_found]
        return {"symmetric_under": [] if symmetry is None else [s.describe() for s in symmetry.declarations],
                "source": self.symmetry_origin, "found": found}

    def info(self) -> dict[str, Any]:
        """JSON description for ``GET /objects``."""
        mesh = self.model.mesh
        lo, hi = np.asarray(mesh.bounds, dtype=np.float64)
        return {
            "object_id": self.object_id,
            "diameter_m": round(self.model.diameter, 6),
            "extents_m": [round(float(v), 6) for v in hi - lo],
            "mesh_centre_m": [round(float(v), 6) for v in self.model.mesh_centre],
            "vertices": int(len(mesh.vertices)),
            "faces": int(len(mesh.faces)),
            "textured": self.textured,
            "source": self.source,
            "mesh_file": self.mesh_file,
            "memory_bytes": self.nbytes,
            "simplified_from_faces": self.simplified_from_faces,
            "symmetry": None if self.model.symmetry is None else {**self.model.symmetry.describe(),
                                                                  "source": self.symmetry_origin},
            "symmetries_found": None if self.symmetries_found is None else [
                d.describe() for d in self.symmetries_found],
            "validity": None if self.model.validity is None else dataclasses.asdict(self.model.validity),
        }


def object_properties(meta: dict[str, Any]) -> dict[str, Any]:
    """``load_object``'s ``symmetries`` and ``validity`` from an ``object.json``'s ``"symmetry"`` (a list of
    declarations) and ``"validity"`` (thresholds by name); InputError naming the field."""
    properties: dict[str, Any] = {}
    symmetry = meta.get("symmetry")
    if symmetry is not None:
        if not isinstance(symmetry, list) or not all(isinstance(text, str) for text in symmetry):
            raise InputError("symmetry", 'a list of declarations such as ["z:4"] or ["z:inf"]', ascii(symmetry)[:80])
        try:
            properties["symmetries"] = [parse_symmetry(text) for text in symmetry]
        except InputError as exc:
            raise InputError("symmetry", exc.expected, exc.got) from None
    validity = meta.get("validity")
    if validity is not None:
        names = [f.name for f in dataclasses.fields(ValidityConfig)]
        if not isinstance(validity, dict) or not set(validity) <= set(names) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in validity.values()):
            raise InputError("validity", f"a JSON object of thresholds by name ({', '.join(names)})",
                             ascii(validity)[:120])
        try:
            properties["validity"] = ValidityConfig(**{k: float(v) for k, v in validity.items()})
        except ValueError as exc:
            raise InputError("validity", "thresholds in their ranges (docs/tracking.md)", str(exc)) from None
    return properties


def found_symmetries(meta: dict[str, Any]) -> tuple[DetectedSymmetry, ...] | None:
    """The symmetries an ``object.json`` records as found at upload (``"symmetries_found"``, each as
    :meth:`~foundationpose.symmetry_detect.DetectedSymmetry.describe` wrote it); None when it records none.
    InputError naming the field when they do not read back."""
    found = meta.get("symmetries_found")
    if found is None:
        return None
    expected = "a list of found symmetries as the server wrote them"
    if not isinstance(found, list) or not all(isinstance(d, dict) for d in found):
        raise InputError("symmetries_found", expected, ascii(found)[:80])
    try:
        return tuple(DetectedSymmetry.from_description(d) for d in found)
    except (ValueError, InputError) as exc:
        raise InputError("symmetries_found", expected, str(exc)[:120]) from None


def _with_found(model: ObjectModel, found: tuple[DetectedSymmetry, ...] | None) -> tuple[ObjectModel, str | None]:
    """(model, symmetry source): a model without declared symmetries takes the real ones found, if any."""
    if model.symmetry is not None:
        return model, "declared"
    real = real_symmetries(found or ())
    if not real:
        return model, None
    return dataclasses.replace(model, symmetry=ObjectSymmetry.of(real, model.mesh_centre)), "found"


def object_nbytes(model: ObjectModel) -> int:
    """Bytes an object holds: renderer tensors, both trimesh copies' arrays and their texture images."""
    total = sum(t.numel() * t.element_size() for t in vars(model.tensors).values() if isinstance(t, torch.Tensor))
    for mesh in (model.mesh, model.mesh_centred):
        total += int(np.asarray(mesh.vertices).nbytes + np.asarray(mesh.faces).nbytes)
        material = getattr(mesh.visual, "material", None)
        for attr in ("image", "baseColorTexture"):
            image = getattr(material, attr, None)
            if isinstance(image, Image.Image):
                total += image.width * image.height * len(image.getbands())
    return int(total)


def _face_count(loaded: trimesh.Trimesh | trimesh.Scene) -> tuple[int, int]:
    """(faces, vertices) the merged mesh will have (a scene's instances each count)."""
    if isinstance(loaded, trimesh.Trimesh):
        return len(loaded.faces), len(loaded.vertices)
    faces = verts = 0
    for node in loaded.graph.nodes_geometry:
        geometry = loaded.geometry.get(loaded.graph[node][1])
        if isinstance(geometry, trimesh.Trimesh):
            faces, verts = faces + len(geometry.faces), verts + len(geometry.vertices)
    return faces, verts


def _simplified(loaded: trimesh.Trimesh | trimesh.Scene, face_count: int) -> trimesh.Trimesh:
    """``loaded`` decimated to at most ``face_count`` faces (quadric edge collapse; colours are dropped)."""
    mesh = loaded.to_mesh() if isinstance(loaded, trimesh.Scene) else loaded
    try:
        import fast_simplification  # noqa: F401  (trimesh's decimation backend)
    except ModuleNotFoundError as exc:
        raise InputTooLargeError("mesh", "a mesh within the limits (this server cannot simplify: "
                                 "fast-simplification is not installed)", f"{len(mesh.faces)} faces") from exc
    simple = mesh.simplify_quadric_decimation(face_count=face_count)
    return trimesh.Trimesh(vertices=np.asarray(simple.vertices), faces=np.asarray(simple.faces), process=False)


def _mesh_problem(exc: BaseException, kind: str) -> str:
    """What is wrong with a mesh file, in our words, from the exception its parser raised."""
    if isinstance(exc, IndexError):
        return "faces that refer to vertices the file does not have"
    if isinstance(exc, (UnicodeError, LookupError, ModuleNotFoundError)):  # text decoding (charset detection)
        return "text that is not UTF-8 or ASCII"
    return f"a file that is not a valid {kind.upper()} (truncated or corrupt)"


def _trimesh_from_bytes(data: bytes, kind: str) -> trimesh.Trimesh | trimesh.Scene:
    try:
        loaded = trimesh.load(file_obj=io.BytesIO(data), file_type=kind)
    except Exception as exc:  # trimesh raises many types for broken files: answer in our words, log its own
        log.info("mesh upload: trimesh could not read the %s file: %s: %s", kind, type(exc).__name__, exc)
        raise InputError("mesh", f"a mesh file in {kind.upper()} format", _mesh_problem(exc, kind)) from exc
    if isinstance(loaded, trimesh.PointCloud):
        raise InputError("mesh", "a triangle mesh", "vertices without faces (a point cloud)")
    return loaded


def _with_texture(loaded: trimesh.Trimesh | trimesh.Scene, texture: bytes, max_side: int | None = None) -> trimesh.Trimesh:
    """The mesh with ``texture`` (PNG / JPEG bytes) as its image on its own UVs."""
    if isinstance(loaded, trimesh.Scene):
        loaded = loaded.to_mesh() if loaded.geometry else loaded
    if not isinstance(loaded, trimesh.Trimesh):
        raise InputError("mesh", "a triangle mesh", type(loaded).__name__)
    uv = getattr(loaded.visual, "uv", None)
    if uv is None or len(uv) != len(loaded.vertices):
        raise InputError("texture", "a mesh with one UV coordinate per vertex to map the texture", "a mesh without UVs")
    image = _decode_texture(texture, max_side)
    loaded.visual = trimesh.visual.TextureVisuals(uv=np.asarray(uv), image=image)
    return loaded


def _decode_texture(data: bytes, max_side: int | None = None) -> Image.Image:
    """The texture field's image, refused above MAX_TEXTURE_SIDE and reduced to ``max_side`` (from its header)."""
    expected = EXPECTED["texture"]
    if not (data.startswith(PNG_MAGIC) or data.startswith(JPEG_MAGIC)):
        raise InputError("texture", expected, "a file that is neither PNG nor JPEG")
    errors = (OSError, SyntaxError, ValueError)
    # a decompression bomb is a size error (413), like a header above the side limit
    image = open_image(data, "texture", expected, f"at most {MAX_TEXTURE_SIDE} pixels per side")
    width, height = image.size
    if max(width, height) > MAX_TEXTURE_SIDE:
        raise ImageTooLargeError("texture", f"texture: expected at most {MAX_TEXTURE_SIDE} pixels per side; "
                                 f"got {width}x{height}")
    try:
        image = reduced_texture(image, max_side, "texture")
        return image if image.mode == "RGB" else image.convert("RGB")
    except InputError:
        raise  # already ours (InputTooLargeError is a ValueError too: keep its 413)
    except errors as exc:
        raise InputError("texture", expected, f"an undecodable image ({type(exc).__name__})") from exc


class ObjectRegistry:
    """Objects by id (see the module docstring). ``device``: where mesh tensors are loaded."""

    def __init__(self, root: Path, device: str | torch.device = "cpu", *, limits: ObjectLimits | None = None,
                 register_shape: tuple[int, int] = (252, 5), max_register_cost: int | None = None,
                 on_drop: Callable[[ObjectModel], None] | None = None) -> None:
        """register_shape: (hypotheses, register iterations) of the server, for the register cost.
        max_register_cost: the resolved budget (``limits.max_register_cost`` or the device's); None: no check.
        on_drop: called with an object's model when the registry drops it (deleted, or replaced by
        :meth:`load_one`), to let go of what was kept for it (its prepared track steps' keys)."""
        self.root = Path(root).resolve()
        self.device = torch.device(device)
        self.limits = limits if limits is not None else ObjectLimits()
        self.register_shape = register_shape
        self.max_register_cost = max_register_cost
        self._entries: dict[str, ObjectEntry] = {}
        self._pending: set[str] = set()
        self._on_drop = on_drop
        self.load_failures: dict[str, str] = {}  # file name -> why it did not load, of the last load_all

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # -- lookups (event loop) ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def get(self, object_id: str | None) -> ObjectEntry:
        check_object_id(object_id)
        entry = self._entries.get(object_id)  # type: ignore[arg-type]
        if entry is None:
            raise UnknownObjectError(f"object_id: no object {object_id!r}; GET /objects lists the loaded ones")
        return entry

    def entries(self) -> list[ObjectEntry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def is_current(self, entry: ObjectEntry) -> bool:
        return self._entries.get(entry.object_id) is entry

    # -- changes (event loop) ----------------------------------------------------------------
    def reserve(self, object_id: str) -> None:
        """Claim an id for an upload in progress; ConflictError when taken."""
        check_object_id(object_id)
        if len(self._entries) + len(self._pending) >= self.limits.max_objects:
            raise ObjectStoreFullError(f"the server holds {len(self._entries)} objects, its limit (max_objects = "
                                       f"{self.limits.max_objects}); DELETE /objects/<id> some first")
        path = self._path(object_id)
        if object_id in self._entries or object_id in self._pending or path.exists() or path.is_symlink():
            raise ConflictError(f"object_id: {object_id!r} already exists; DELETE /objects/{object_id} first",
                                field="object_id")
        self._pending.add(object_id)

    def release(self, object_id: str) -> None:
        self._pending.discard(object_id)

    def add(self, entry: ObjectEntry) -> None:
        """Register ``entry``; ObjectStoreFullError (and the id released) when its memory does not fit."""
        try:
            self._check_room(entry.object_id, entry.nbytes)
        except ObjectStoreFullError:
            self._pending.discard(entry.object_id)
            raise
        self._entries[entry.object_id] = entry
        self._pending.discard(entry.object_id)

    def _check_room(self, object_id: str, nbytes: int) -> None:
        used, cap = self.total_bytes, self.limits.max_total_bytes
        if used + nbytes > cap:
            mib = 1024 * 1024
            raise ObjectStoreFullError(
                f"object {object_id!r} needs {nbytes / mib:.1f} MiB but the loaded objects hold {used / mib:.1f} of "
                f"{cap / mib:.0f} MiB (max_objects_mb); DELETE /objects/<id> some first or use smaller textures")

    def remove(self, object_id: str) -> ObjectEntry:
        entry = self.get(object_id)
        del self._entries[object_id]
        self._dropped(entry)
        return entry

    def _dropped(self, entry: ObjectEntry | None) -> None:
        if entry is not None and self._on_drop is not None:
            self._on_drop(entry.model)

    # -- file work (worker thread) -----------------------------------------------------------
    def _path(self, name: str) -> Path:
        path = self.root / name
        if path.parent != self.root:  # ids cannot contain separators; keep it true for any name
            raise InputError("object_id", "a plain name", repr(name))
        return path

    def load_all(self) -> list[str]:
        """Load every object in the directory (skipping, with an error log, those that fail: they are in
        :attr:`load_failures`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.load_failures = {}
        for stale in self.root.glob(f"{_STAGING_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        found: dict[str, Path] = {}
        for path in sorted(self.root.iterdir()):
            if path.name.startswith("."):
                continue
            object_id = path.stem if path.is_file() else path.name
            if path.is_file() and path.suffix.lower() not in MESH_SUFFIXES:
                continue
            if _ID_RE.fullmatch(object_id) is None:
                log.warning("objects dir: skipping %s (id %r does not match %s)", path.name, object_id, OBJECT_ID_PATTERN)
                continue
            if object_id in found:
                log.warning("objects dir: skipping %s (id %r already taken by %s)", path.name, object_id,
                            found[object_id].name)
                continue
            found[object_id] = path
        for object_id, path in found.items():
            if len(self._entries) >= self.limits.max_objects:
                log.error("objects dir: skipping %s and the rest: %d objects is the limit (max_objects)",
                          path.name, self.limits.max_objects)
                break
            try:
                entry = self._load_path(object_id, path)
                self._check_room(object_id, entry.nbytes)
                self._entries[object_id] = entry
            except Exception as exc:
                log.error("objects dir: could not load %s: %s: %s", path.name, type(exc).__name__, exc)
                self.load_failures[path.name] = f"{type(exc).__name__}: {exc}"
        log.info("loaded %d objects from %s: %s", len(self._entries), self.root, sorted(self._entries))
        return sorted(self._entries)

    def load_one(self, object_id: str) -> ObjectEntry:
        """(Re)load one object from the directory (``<id>/`` or ``<id>.obj|.ply|.glb``) and register it.

        For a second process sharing the directory (a Ray Serve replica) that learns of an upload or a
        replacement after its start. UnknownObjectError when the directory has no such object.
        """
        check_object_id(object_id)
        candidates = [self._path(object_id)] + [self._path(object_id + suffix) for suffix in MESH_SUFFIXES]
        path = next((p for p in candidates if p.is_dir() or p.is_file()), None)
        if path is None:
            raise UnknownObjectError(f"object_id: no object {object_id!r} in {self.root}")
        entry = self._load_path(object_id, path)
        old, self._entries[object_id] = self._entries.get(object_id), entry
        self._dropped(old)
        return entry

    def _load_path(self, object_id: str, path: Path) -> ObjectEntry:
        rel = lambda p: str(p.relative_to(self.root))  # noqa: E731
        side = self.limits.max_texture_side
        if path.is_file():
            model = load_object(path, device=self.device, name=object_id, max_texture_side=side)
            return ObjectEntry(object_id, model, rel(path), model.tensors.has_texture, "directory", time.time(),
                               object_nbytes(model))
        marker = path / _MARKER
        meta = json.loads(marker.read_text(encoding="utf-8")) if marker.is_file() else {}
        if not isinstance(meta, dict):
            raise InputError(f"{path.name}/{_MARKER}", "a JSON object", f"JSON {type(meta).__name__}")
        properties = object_properties(meta)
        if "mesh" in meta:  # an upload
            mesh_path = self._path(object_id) / Path(str(meta["mesh"])).name
            texture_name = meta.get("texture")
            texture = (path / Path(str(texture_name)).name).read_bytes() if texture_name else None
            model, _ = self._load_bytes(object_id, mesh_path.read_bytes(), mesh_path.suffix[1:], texture,
                                        properties=properties)
            found = found_symmetries(meta)
            model, source = _with_found(model, found)
            return ObjectEntry(object_id, model, rel(mesh_path), model.tensors.has_texture, "upload", time.time(),
                               object_nbytes(model), symmetries_found=found, symmetry_source=source)
        meshes = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in MESH_SUFFIXES)
        if not meshes:
            raise InputError("mesh", f"one {'/'.join(MESH_SUFFIXES)} file in {path.name}/", "none")
        if len(meshes) > 1:
            log.warning("objects dir: %s/ holds %d meshes; using %s", path.name, len(meshes), meshes[0].name)
        texture_path = next((path / n for n in _TEXTURE_NAMES if (path / n).is_file()), None)
        if texture_path is None:
            model = load_object(meshes[0], device=self.device, name=object_id, max_texture_side=side, **properties)
        else:
            loaded = trimesh.load(str(meshes[0]))
            limit_texture_images(loaded, side)
            model = load_object(_with_texture(loaded, texture_path.read_bytes(), side), device=self.device,
                                name=object_id, max_texture_side=side, **properties)
        return ObjectEntry(object_id, model, rel(meshes[0]), model.tensors.has_texture, "directory", time.time(),
                           object_nbytes(model))

    def _load_bytes(self, object_id: str, mesh: bytes, kind: str, texture: bytes | None, *,
                    check: str | None = None, simplify: bool = False,
                    properties: dict[str, Any] | None = None) -> tuple[ObjectModel, int | None]:
        """(model, faces before simplification or None). check: the upload's file name (checks the size).
        properties: ``load_object``'s symmetries / validity (:func:`object_properties`)."""
        side = self.limits.max_texture_side
        loaded = _trimesh_from_bytes(mesh, kind)
        limit_texture_images(loaded, side)  # before trimesh copies (and so decodes) the image
        simplified_from = None
        if check is not None:
            faces, verts = _face_count(loaded)
            if self._size_problem(loaded) is not None and simplify:
                loaded, simplified_from = _simplified(loaded, self._face_budget()), faces
                log.info("upload %r: simplified %d -> %d faces (simplify=true)", object_id, faces, len(loaded.faces))
            problem = self._size_problem(loaded)
            if problem is not None:
                raise InputTooLargeError(
                    "mesh", problem, f"{check!r} of object {object_id!r} with {faces} faces and {verts} vertices",
                    f"Simplify it to at most {self._face_budget()} faces first (e.g. Blender's Decimate modifier or "
                    "trimesh's simplify_quadric_decimation), or upload it with simplify=true to let the server "
                    "decimate it (its colours and texture are then dropped)")
        try:
            if texture is not None:
                loaded = _with_texture(loaded, texture, side)
            return (load_object(loaded, device=self.device, name=object_id, max_texture_side=side, **(properties or {})),
                    simplified_from)
        except (InputError, CapacityError):
            raise
        except Exception as exc:  # a library failure on a mesh that parsed: the mesh's fault, said in our words
            log.info("object %r: preparing the mesh failed: %s: %s", object_id, type(exc).__name__, exc)
            raise InputError("mesh", "a triangle mesh with valid faces and UVs", _mesh_problem(exc, kind)) from exc

    def _face_budget(self) -> int:
        """Most faces an upload may have: the face limit, lowered by the register-cost budget."""
        budget = self.limits.max_faces
        if self.max_register_cost is not None:
            budget = min(budget, self.max_register_cost // max(1, register_cost(1, *self.register_shape)))
        return max(1, budget)

    def _size_problem(self, loaded: trimesh.Trimesh | trimesh.Scene) -> str | None:
        """What the mesh should be, when it is over a limit; None when it is within them."""
        faces, verts = _face_count(loaded)
        lim = self.limits
        if faces > lim.max_faces or verts > lim.max_vertices:
            return (f"a mesh of at most {lim.max_faces} faces and {lim.max_vertices} vertices (max_mesh_faces, "
                    "max_mesh_vertices)")
        if self.max_register_cost is not None:
            cost = register_cost(faces, *self.register_shape)
            if cost > self.max_register_cost:
                hyp, iters = self.register_shape
                return (f"a mesh this server can register within its request timeout: at most {self._face_budget()} "
                        f"faces at {hyp} hypotheses x {iters + 1} render passes (estimated cost {cost:.3g} > budget "
                        f"{self.max_register_cost:.3g} triangles, max_register_cost)")
        return None

    def store_upload(self, object_id: str, mesh: bytes, filename: str | None, texture: bytes | None,
                     simplify: bool = False, declared: dict[str, Any] | None = None) -> ObjectEntry:
        """Load an uploaded mesh and store it as ``<root>/<id>/`` (the id must be reserved first).

        The size limits are checked (413); ``simplify``: decimate a mesh over them instead. A simplified
        mesh is stored as the simplified PLY, so a restart loads what was registered. declared: the object's
        properties as ``object.json`` holds them (``symmetry``, ``validity``; checked here, 422 naming them).
        """
        check_object_id(object_id)
        if not mesh:
            raise InputError("mesh", "an OBJ, PLY or GLB mesh file", "an empty file")
        declared = dict(declared or {})
        properties = object_properties(declared)
        kind = mesh_kind(mesh, filename)
        model, simplified_from = self._load_bytes(object_id, mesh, kind, texture, check=filename or f"mesh.{kind}",
                                                  simplify=simplify, properties=properties)
        started = time.perf_counter()
        found = detect_symmetries(model.mesh)
        model, source = _with_found(model, found)
        log.info("upload %r: symmetries found in %.1f s: %s", object_id, time.perf_counter() - started,
                 ", ".join(f"{d.declaration} ({'real' if d.real else 'broken'})" for d in found) or "none")
        nbytes = object_nbytes(model)
        self._check_room(object_id, nbytes)  # before writing files; add() checks again on the event loop
        if simplified_from is not None:
            mesh, kind, texture = model.mesh.export(file_type="ply"), "ply", None
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self._path(f"{_STAGING_PREFIX}{secrets.token_hex(8)}")
        staging.mkdir()
        try:
            (staging / f"mesh.{kind}").write_bytes(mesh)
            meta: dict[str, Any] = {"object_id": object_id, "mesh": f"mesh.{kind}", "uploaded_unix_s": time.time(),
                                    **declared, "symmetries_found": [d.describe() for d in found]}
            if texture is not None:
                texture_name = "texture.png" if texture.startswith(PNG_MAGIC) else "texture.jpg"
                (staging / texture_name).write_bytes(texture)
                meta["texture"] = texture_name
            (staging / _MARKER).write_text(json.dumps(meta), encoding="utf-8")
            final = self._path(object_id)
            staging.rename(final)  # fails if the id appeared on disk meanwhile (never overwrites a folder)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if self._path(object_id).exists():
                raise ConflictError(f"object_id: {object_id!r} already exists on disk", field="object_id") from exc
            raise
        log.info("stored uploaded object %r (%s, %d bytes, diameter %.4f m)", object_id, kind, len(mesh), model.diameter)
        return ObjectEntry(object_id, model, f"{object_id}/mesh.{kind}", model.tensors.has_texture, "upload", time.time(),
                           nbytes, simplified_from, symmetries_found=found, symmetry_source=source)

    def delete_files(self, entry: ObjectEntry) -> None:
        """Remove the entry's files from the objects directory (a symlink is unlinked, never followed)."""
        top = self._path(entry.mesh_file.split("/", 1)[0])
        try:
            if top.is_symlink() or top.is_file():
                top.unlink()
            elif top.is_dir():
                shutil.rmtree(top)
        except FileNotFoundError:
            pass
