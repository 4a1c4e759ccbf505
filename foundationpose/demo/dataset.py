"""Read a recorded RGB-D sequence in the official demo layout (spec §7.1).

::

    <scene>/
      cam_K.txt              3 lines x 3 numbers, row-major K (pixels)
      rgb/<id>.png           8-bit colour (alpha dropped); read as RGB
      depth/<id>.png         16-bit single channel, millimetres, 0 = no reading
      masks/<id>.png         object mask; the first frame's is required, the others optional
      mesh/*.obj|*.ply|*.glb the object, metres (first .obj by name, else .ply, else .glb)
      annotated_poses/<id>.txt   optional ground truth, 4x4 cam_from_mesh, metres

Frames are the ``rgb/`` files in sorted file-name order; ``<id>`` is the file stem. Depth and mask paths
are built from the id (``depth/<id>.png``), not by substring replacement of ``rgb`` in the colour path as
the reference does (which breaks for scene paths that contain ``rgb``).

Conversions (spec §7.1): depth ``uint16 / 1000`` computed in float64, values ``< 0.001`` set to 0, then
cast to float32 metres. Mask: if the PNG has 3 or more channels, the first of channels 0, 1, 2 *in
OpenCV's B, G, R order* with a non-zero sum is used (alpha ignored); then ``> 0``.

Every problem with the files raises :class:`DatasetError` (an :class:`InputError`, hence a
:class:`PoseError`) naming the file, what was expected and what was found.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from foundationpose.constants import MIN_VALID_DEPTH_M  # "no reading" below it (spec §7.1, §2.8)
from foundationpose.errors import InputError

__all__ = [
    "BUNDLED_SEQUENCE_DIR",
    "DatasetError",
    "Frame",
    "RecordedSequence",
    "frame_rate_hint",
    "read_K",
    "read_depth",
    "read_mask",
    "read_pose",
    "read_rgb",
]

logger = logging.getLogger(__name__)

# The 40-frame synthetic sequence shipped inside the package (regenerate: python tools/make_demo_sequence.py).
BUNDLED_SEQUENCE_DIR = Path(__file__).resolve().parents[1] / "data" / "demo_sequence"
RGB_SUFFIXES = (".png", ".jpg", ".jpeg")
MESH_SUFFIXES = (".obj", ".ply", ".glb")  # in order of preference (spec §7.1: textured_simple.obj)
DEPTH_UNITS_PER_M = 1000.0  # uint16 millimetres -> metres: divide (as the reference does, in float64)


class DatasetError(InputError):
    """A recorded sequence is missing files or holds files in an unexpected format.

    ``field`` is the offending path relative to the sequence root (e.g. ``depth/000012.png``).
    """


@dataclass(frozen=True, slots=True, eq=False)
class Frame:
    """One recorded frame.

    id: file stem shared by ``rgb/``, ``depth/``, ``masks/`` and ``annotated_poses/``.
    rgb: (H, W, 3) uint8, RGB order.  depth: (H, W) float32 metres, 0 = invalid.
    mask: (H, W) bool, or None when ``masks/<id>.png`` does not exist.
    gt_pose: (4, 4) float64 cam_from_mesh ground truth (metres), or None.
    """

    id: str
    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray | None
    gt_pose: np.ndarray | None


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _imread(path: Path, field: str) -> np.ndarray:
    if not path.is_file():
        raise DatasetError(field, "an existing image file", "no such file")
    image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise DatasetError(field, "an image OpenCV can decode", f"an unreadable file of {path.stat().st_size} bytes")
    return image


def _describe(image: np.ndarray) -> str:
    channels = 1 if image.ndim == 2 else image.shape[2]
    return f"{image.dtype} with {channels} channel(s), {image.shape[1]}x{image.shape[0]} px"


def read_rgb(path: Path, field: str = "rgb") -> np.ndarray:
    """(H, W, 3) uint8 RGB from an 8-bit colour (or grey) image; alpha dropped, OpenCV BGR converted."""
    image = _imread(path, field)
    if image.dtype != np.uint8:
        raise DatasetError(field, "an 8-bit colour image", _describe(image))
    if image.ndim == 2:
        return np.ascontiguousarray(np.repeat(image[:, :, None], 3, axis=2))
    if image.shape[2] == 1:
        return np.ascontiguousarray(np.repeat(image, 3, axis=2))
    if image.shape[2] < 3:
        raise DatasetError(field, "a colour image with 3 or 4 channels", _describe(image))
    return np.ascontiguousarray(image[:, :, 2::-1])  # B, G, R (, A) -> R, G, B


def read_depth(path: Path, field: str = "depth") -> np.ndarray:
    """(H, W) float32 metres from a 16-bit single-channel PNG in millimetres (spec §7.1)."""
    image = _imread(path, field)
    if image.dtype != np.uint16 or image.ndim != 2:
        hint = "Depth must be 16-bit millimetres; an 8-bit PNG has lost its precision" if image.dtype == np.uint8 else None
        raise DatasetError(field, "a 16-bit single-channel PNG (millimetres)", _describe(image), hint)
    metres = image.astype(np.float64) / DEPTH_UNITS_PER_M  # float64 like the reference, then float32
    metres[metres < MIN_VALID_DEPTH_M] = 0.0
    return metres.astype(np.float32)


def read_mask(path: Path, field: str = "mask") -> np.ndarray:
    """(H, W) bool mask (spec §7.1: first non-empty channel of B, G, R when there are >= 3 channels)."""
    image = _imread(path, field)
    if image.ndim == 3:
        if image.shape[2] >= 3:
            chosen = image[:, :, 0]
            for channel in range(3):
                if image[:, :, channel].sum() > 0:
                    chosen = image[:, :, channel]
                    break
            image = chosen
        else:
            image = image[:, :, 0]  # grey (+ alpha)
    return image > 0


def _read_matrix(path: Path, field: str, shape: tuple[int, int]) -> np.ndarray:
    if not path.is_file():
        raise DatasetError(field, "an existing text file", "no such file")
    expected = f"{shape[0]} lines of {shape[1]} whitespace-separated numbers"
    text = path.read_text(encoding="utf-8", errors="replace")
    rows = [line.split() for line in text.splitlines() if line.strip()]
    if len(rows) != shape[0] or any(len(row) != shape[1] for row in rows):
        got = f"{len(rows)} non-empty line(s) with {[len(r) for r in rows][:6]} numbers"
        raise DatasetError(field, expected, got)
    try:
        matrix = np.array([[float(x) for x in row] for row in rows], dtype=np.float64)
    except ValueError as exc:
        raise DatasetError(field, expected, f"non-numeric text ({exc})") from exc
    if not np.isfinite(matrix).all():
        raise DatasetError(field, "finite numbers", "NaN or inf")
    return matrix


def read_K(path: Path, field: str = "cam_K.txt") -> np.ndarray:
    """(3, 3) float64 pinhole intrinsics in pixels from ``cam_K.txt`` (row-major, whitespace separated)."""
    K = _read_matrix(path, field, (3, 3))
    if not (K[0, 0] > 0 and K[1, 1] > 0) or K[1, 0] != 0 or not np.allclose(K[2], [0.0, 0.0, 1.0]):
        got = np.array2string(K, precision=4, separator=", ").replace("\n", "")
        raise DatasetError(field, "[[fx, s, cx], [0, fy, cy], [0, 0, 1]] with fx, fy > 0", got)
    return K


def read_pose(path: Path, field: str = "pose") -> np.ndarray:
    """(4, 4) float64 rigid transform (metres) from a text file of 4 lines x 4 numbers."""
    pose = _read_matrix(path, field, (4, 4))
    rot = pose[:3, :3]
    if not np.allclose(pose[3], [0.0, 0.0, 0.0, 1.0], atol=1e-6) or not np.allclose(rot @ rot.T, np.eye(3), atol=1e-4):
        raise DatasetError(field, "a rigid 4x4 transform (orthonormal rotation, last row 0 0 0 1)",
                           np.array2string(pose, precision=4, separator=", ").replace("\n", ""))
    return pose


class RecordedSequence:
    """A recorded sequence in the official layout (see the module docstring); iterate it for :class:`Frame` s.

    path: the scene folder.  max_frames: read only the first ``max_frames`` frames (None = all).

    The structure (folders, cam_K.txt, matching rgb/depth ids, the first mask, the first frame's image
    sizes and depth format) is checked here, so most mistakes surface before any processing; each frame's
    images are checked again when read. Attributes: ``root``, ``K`` (3, 3) float64, ``ids`` (sorted),
    ``mesh_path`` (Path or None), ``image_hw`` (H, W), ``has_ground_truth``.
    """

    def __init__(self, path: str | Path, *, max_frames: int | None = None) -> None:
        root = Path(path).expanduser()
        if not root.is_dir():
            what = "a file, not a folder" if root.exists() else "no such folder"
            raise DatasetError("data", "a sequence folder with cam_K.txt, rgb/, depth/, masks/", f"'{root}' ({what})")
        if max_frames is not None and max_frames < 1:
            raise DatasetError("max_frames", "a positive number of frames or None", str(max_frames))
        self.root = root
        self.K = read_K(root / "cam_K.txt")
        rgb_dir, depth_dir = root / "rgb", root / "depth"
        for folder in (rgb_dir, depth_dir):
            if not folder.is_dir():
                raise DatasetError(f"{folder.name}/", "a folder of per-frame images", f"none in '{root}'")
        rgb_files = sorted(p for p in rgb_dir.iterdir() if p.is_file() and p.suffix.lower() in RGB_SUFFIXES)
        self._rgb_paths = {p.stem: p for p in rgb_files}
        depth_ids = {p.stem for p in depth_dir.iterdir() if p.is_file() and p.suffix.lower() == ".png"}
        if not rgb_files:
            raise DatasetError("rgb/", f"at least one image ({', '.join(RGB_SUFFIXES)})", "no images")
        if len(self._rgb_paths) != len(rgb_files):
            raise DatasetError("rgb/", "one image per frame id", "two images with the same id (e.g. .png and .jpg)")
        ids = sorted(self._rgb_paths)
        missing_depth = [i for i in ids if i not in depth_ids]
        extra_depth = sorted(depth_ids - set(ids))
        if missing_depth or extra_depth:
            got = f"{len(ids)} rgb and {len(depth_ids)} depth frames"
            if missing_depth:
                got += f"; no depth/<id>.png for {_listing(missing_depth)}"
            if extra_depth:
                got += f"; depth without rgb for {_listing(extra_depth)}"
            raise DatasetError("depth/", "one depth/<id>.png for every rgb/<id> image", got)
        self.ids: list[str] = ids[:max_frames] if max_frames is not None else ids
        self.mesh_path = _find_mesh(root / "mesh")
        self._pose_dir = root / "annotated_poses"
        self.has_ground_truth = self._pose_dir.is_dir() and any(
            (self._pose_dir / f"{i}.txt").is_file() for i in self.ids
        )
        first = self.ids[0]
        if not (root / "masks" / f"{first}.png").is_file():
            raise DatasetError(f"masks/{first}.png", "the first frame's object mask (registration needs it)",
                               "no such file")
        self.image_hw = self._check_first_frame()
        logger.info("sequence %s: %d frames, %dx%d, mesh %s, ground truth %s", root, len(self.ids),
                    self.image_hw[1], self.image_hw[0], self.mesh_path, self.has_ground_truth)

    def _check_first_frame(self) -> tuple[int, int]:
        frame = self.read(0)
        return int(frame.rgb.shape[0]), int(frame.rgb.shape[1])

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[Frame]:
        for index in range(len(self.ids)):
            yield self.read(index)

    def __getitem__(self, index: int) -> Frame:
        return self.read(index)

    def read(self, index: int) -> Frame:
        """Read and check frame ``index`` (0-based, in sorted id order)."""
        frame_id = self.ids[index]
        rgb_path = self._rgb_paths[frame_id]
        rgb = read_rgb(rgb_path, _rel(rgb_path, self.root))
        depth_path = self.root / "depth" / f"{frame_id}.png"
        depth = read_depth(depth_path, _rel(depth_path, self.root))
        if depth.shape != rgb.shape[:2]:
            raise DatasetError(_rel(depth_path, self.root), f"the size of its rgb image, {rgb.shape[1]}x{rgb.shape[0]} px",
                               f"{depth.shape[1]}x{depth.shape[0]} px")
        expected_hw = getattr(self, "image_hw", None)
        if expected_hw is not None and rgb.shape[:2] != expected_hw:
            raise DatasetError(_rel(rgb_path, self.root), f"the first frame's size {expected_hw[1]}x{expected_hw[0]} px "
                               "(one cam_K.txt for all frames)", f"{rgb.shape[1]}x{rgb.shape[0]} px")
        mask_path = self.root / "masks" / f"{frame_id}.png"
        mask = None
        if mask_path.is_file():
            mask = read_mask(mask_path, _rel(mask_path, self.root))
            if mask.shape != rgb.shape[:2]:
                raise DatasetError(_rel(mask_path, self.root), f"the size of its rgb image, {rgb.shape[1]}x{rgb.shape[0]} px",
                                   f"{mask.shape[1]}x{mask.shape[0]} px")
        pose_path = self._pose_dir / f"{frame_id}.txt"
        gt_pose = read_pose(pose_path, _rel(pose_path, self.root)) if pose_path.is_file() else None
        return Frame(id=frame_id, rgb=rgb, depth=depth, mask=mask, gt_pose=gt_pose)

    def __repr__(self) -> str:
        return f"RecordedSequence('{self.root}', {len(self)} frames)"


def _listing(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _find_mesh(mesh_dir: Path) -> Path | None:
    """First ``.obj`` by name in ``mesh_dir``, else ``.ply``, else ``.glb``; None when there is none."""
    if not mesh_dir.is_dir():
        return None
    files = sorted(p for p in mesh_dir.iterdir() if p.is_file())
    for suffix in MESH_SUFFIXES:
        for candidate in files:
            if candidate.suffix.lower() == suffix:
                return candidate
    return None


def frame_rate_hint(ids: list[str], default_fps: float = 10.0) -> float:
    """Frames per second implied by nanosecond-timestamp ids (YCBInEOAT style), else ``default_fps``."""
    if len(ids) < 2 or not all(i.isdigit() and len(i) >= 16 for i in ids):
        return default_fps
    span_s = (int(ids[-1]) - int(ids[0])) * 1e-9
    fps = (len(ids) - 1) / span_s if span_s > 0 else default_fps
    return fps if math.isfinite(fps) and 1.0 <= fps <= 240.0 else default_fps
