"""Triton renderer backend: the CUDA-graph-capturable rasteriser (spec §3), beside nvdiffrast and the CPU twin.

Same contract as the other backends (:class:`foundationpose.render.base.Renderer`): N poses of one mesh straight
into N crop windows with the crop-adjusted projection of :mod:`foundationpose.render.projection`, z-buffer on
``z/w`` (nearest wins, exact ties to the lowest face), no culling, perspective-correct barycentrics, vertical
flip, the shading of spec §3.4, background 0. The per-pose matrices (``M = P G T``, the crop's scale and offset)
come from the shared flow of :class:`foundationpose.render._core.RendererCore`, except the crop bounds: a small
kernel inverts the crop windows in closed form (a CUDA graph can capture it, a batched LU maybe not; on the CPU
its bounds equal the LU's for crop windows). Everything per vertex and per pixel runs in three Triton kernels
(:mod:`foundationpose.render._triton_raster_kernels`) whose arithmetic is that of the reference twin,
:mod:`foundationpose.render.cpu_raster` with :mod:`foundationpose.render.attributes` and ``shading``.

Capture in a CUDA graph: after one warm-up call with the same mesh, N and crop size (it JIT-compiles the
kernels and allocates the scratch), a render enqueues a fixed sequence of ~10 small torch ops and four kernel
launches with grids fixed by (N, mesh, size): no host synchronisation, no scratch allocation, every output
written through its strides into the caller's buffers (``out=``; any strides, e.g. views of a channels-first
network buffer). :meth:`TritonRasterizer.render_network_input` writes the networks' NHWC input directly (rgb
rescaled, xyz centred and normalised as :mod:`foundationpose.network_inputs` does, bit-equal), no extra pass. Scratch (an int64 z-buffer, a triangle queue and its counter) is allocated once per
(capacity, raster size, mesh face count), capacity = N rounded up to a power of two (at most
``chunk_hypotheses``), never freed while the renderer lives (graphs keep pointing at it), and left clean by
every render. Use host K (or a device K fixed at capture time): a new host K is cached on first use.

Mesh groups (:class:`foundationpose.render.groups.RowMeshes`: row i renders mesh ``row_mesh[i]`` of a group): the
same launches over the group's packed tables; the raster kernel's grid covers the largest mesh's faces, each row
reads its mesh's face range (and, in the resolve kernel, its colour source and texture) from device tables indexed by
``row_mesh`` (data, so a group render is captured like a single mesh's). Faces keep their packed index in the
z-buffer key, which orders a row's faces as the mesh's own indices do (ties go to the same face). Scratch is per
total face count of the group.

Streams: on CUDA it renders on a stream of its own, like the nvdiffrast backend (``SideStreamCore``); renders
of one renderer share scratch, so they are serialised (host lock + one stream). Two CUDA graphs captured from
the same renderer with the same capacity share scratch: replay them on one stream, or give each its own
renderer. On a CPU device the kernels run under the Triton interpreter (slow; for tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from foundationpose.errors import RenderError
from foundationpose.network_inputs import RGB_SCALE, XYZ_CLIP, _radius_reciprocal_f32
from foundationpose.render._core import SideStreamCore
from foundationpose.render.base import RenderConfig, RenderOutput
from foundationpose.render.groups import RowMeshes
from foundationpose.render.projection import clip_from_centred

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["LaunchConfig", "TritonRasterizer", "has_triton"]

logger = logging.getLogger(__name__)

_QUEUE_MAX = 1 << 20  # queued large triangles per scratch (4 MiB); beyond it a triangle is drawn inline
# (xyz scale, invalid z) while render_network_input runs in this thread / context, else None.
_NETWORK_EPILOGUE: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "triton_render_network_epilogue", default=None
)


def has_triton() -> bool:
    """True when the Triton kernels can be imported (triton installed)."""
    try:
        from foundationpose.render import _triton_raster_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():  # noqa: ANN202 - the private kernel module
    try:
        from foundationpose.render import _triton_raster_kernels
    except ImportError as exc:
        raise RenderError(f"the triton renderer needs the triton package ({exc})") from exc
    return _triton_raster_kernels


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """Launch geometry of the three kernels (block sizes are powers of two).

    small_area: largest pixel box a triangle is drawn with inline (one lane per triangle, one pixel per loop
    step); larger ones are queued for the tiled kernel. large_programs x large_splits programs share the queue.
    """

    block_triangles: int = 64
    small_area: int = 128
    raster_warps: int = 2
    tile_h: int = 16
    tile_w: int = 16
    large_programs: int = 1024
    large_splits: int = 4
    large_warps: int = 4
    block_pixels: int = 256
    resolve_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_triangles", "tile_h", "tile_w", "block_pixels"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        for name in ("small_area", "large_programs", "large_splits", "raster_warps", "large_warps", "resolve_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# The interpreter runs programs one after another in Python: few, wide programs.
_INTERPRETER_LAUNCH = LaunchConfig(
    block_triangles=1024, small_area=64, tile_h=32, tile_w=32, large_programs=2, large_splits=1, block_pixels=4096
)


class _Scratch:
    """z-buffer (capacity * Hr * Wr int64, all EMPTY between renders), queue (int32) and queue counter."""

    __slots__ = ("zbuf", "queue", "count", "queue_capacity")

    def __init__(self, capacity: int, size_hw: tuple[int, int], n_faces: int, device: torch.device) -> None:
        empty = _kernels().EMPTY_KEY.value
        self.zbuf = torch.full((capacity * size_hw[0] * size_hw[1],), empty, dtype=torch.int64, device=device)
        self.queue_capacity = max(1, min(capacity * n_faces, _QUEUE_MAX))
        self.queue = torch.empty((self.queue_capacity,), dtype=torch.int32, device=device)
        self.count = torch.zeros((1,), dtype=torch.int32, device=device)


class _PoseChunk:
    """Per-pose inputs of one chunk: ``clip_from_centred`` (n, 4, 4), crop ``[ax, ay, bx, by]`` (n, 4) or None
    (full frame), poses (n, 4, 4), all float32 contiguous; ``size_hw`` of the raster."""

    __slots__ = ("clip_from_centred", "crop", "poses", "size_hw")

    def __init__(self, m: Tensor, crop: Tensor | None, poses: Tensor, size_hw: tuple[int, int]) -> None:
        self.clip_from_centred = m
        self.crop = crop
        self.poses = poses
        self.size_hw = size_hw


class TritonRasterizer(SideStreamCore):
    """Renderer backend on Triton kernels; see the module docstring.

    device: a CUDA device (compiled kernels) or the CPU (Triton interpreter). stream: CUDA stream to render on
    (default: a new one owned by the renderer). launch: kernel geometry (default: tuned for CUDA, or wide
    programs under the interpreter). use_caller_stream: enqueue on the caller's current stream instead (no
    fork/join; ``ready`` is None), the simplest form to capture in a CUDA graph; renders from several streams at
    once then need one renderer per stream (they would share scratch).
    Raises RenderError when triton (or, on CPU, its interpreter) is missing.
    """

    name = "triton"
    renders_groups = True  # RowMeshes: every row of a mesh group in one pass (module docstring)

    def __init__(
        self,
        device: str | torch.device = "cuda",
        config: RenderConfig | None = None,
        stream: torch.cuda.Stream | None = None,
        launch: LaunchConfig | None = None,
        *,
        use_caller_stream: bool = False,
    ) -> None:
        kernels = _kernels()
        super().__init__(device, config, stream)  # no stream (None) on the CPU
        if use_caller_stream:
            if stream is not None:
                raise ValueError("pass either stream or use_caller_stream=True, not both")
            self._stream = None  # enqueue on the caller's current stream: ready is None, nothing to join
        self._interpreted = self.device.type != "cuda" or _is_interpreted(kernels.RESOLVE_KERNELS[0])
        if self.device.type != "cuda" and not kernels.interpreter_available():
            raise RenderError(f"the triton renderer on {self.device} needs triton's interpreter, which is missing")
        self.launch = launch or (_INTERPRETER_LAUNCH if self._interpreted else LaunchConfig())
        self._scratch: dict[tuple[int, int, int, int], _Scratch] = {}
        self._lock = threading.Lock()  # scratch is shared: one render's launches at a time
        self._compile_options = _compile_options()

    # -- streams (CPU: inline, like the CPU rasteriser) --------------------------------------------------------------

    def _stream_scope(self, caller_tensors: Sequence[Tensor]) -> contextlib.AbstractContextManager[object]:
        if self._stream is not None:
            return self._locked(super()._stream_scope(caller_tensors))
        if self.device.type == "cuda":
            return self._locked(torch.cuda.device(self.device))
        return self._locked(contextlib.nullcontext())

    @contextlib.contextmanager
    def _locked(self, scope: contextlib.AbstractContextManager[object]) -> Iterator[None]:
        with self._lock, scope:
            yield

    def _finish(self, out):  # noqa: ANN001, ANN202 - RenderOutput in, RenderOutput out
        return out if self._stream is None else super()._finish(out)

    # -- network-input layout ----------------------------------------------------------------------------------------

    def render_network_input(
        self,
        mesh: MeshTensors,
        cam_from_centred: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        crop_from_img: Tensor,
        network_input: Tensor,
        mask: Tensor,
        *,
        diameter: float,
        invalid_z: float,
    ) -> RenderOutput:
        """Render straight into the networks' input buffer (the rendered branch A), with no extra pass.

        network_input: (N, S, S, 6) float32 view (any strides; e.g. a pool buffer), channels R G B X Y Z, fully
        overwritten with what ``refine`` builds from a render: ``rgb_to_unit(rgb * 255)`` and
        ``normalize_xyz(xyz, t, diameter, invalid_z)`` (``t`` = the poses' translations), the same float32 ops.
        mask: (N, S, S) bool coverage buffer. diameter: mesh diameter (metres). invalid_z: ``REFINE_INVALID_Z``
        or ``SCORE_INVALID_Z``. Other arguments as :meth:`render`. Returns views of ``network_input``.
        """
        if network_input.ndim != 4 or network_input.shape[-1] != 6:
            raise ValueError(f"network_input: expected (N, S, S, 6); got {tuple(network_input.shape)}")
        out = RenderOutput(rgb=network_input[..., :3], xyz_cam=network_input[..., 3:], mask=mask)
        token = _NETWORK_EPILOGUE.set((float(_radius_reciprocal_f32(diameter)), float(np.float32(invalid_z))))
        try:
            return self.render(mesh, cam_from_centred, K, img_hw, crop_from_img, out=out)
        finally:
            _NETWORK_EPILOGUE.reset(token)

    # -- per-chunk work ----------------------------------------------------------------------------------------------

    def _crop_bounds(self, crop_from_img: Tensor, crop_size_px: int) -> Tensor:
        """projection.crop_bounds with the closed-form affine inverse in one kernel: no batched LU (which a CUDA
        graph may not capture); within an ulp of the LU inverse for crop windows (scale and shift; bit-equal where the LU divides)."""
        kernel = _kernels().CROP_BOUNDS_KERNELS[0 if self.device.type == "cuda" else 1]
        f = _f32(crop_from_img)
        n = f.shape[0]
        bounds = torch.empty((n, 4), dtype=torch.float32, device=f.device)
        block = 128
        with _quiet(self._interpreted), self._device_scope():
            kernel[(triton_cdiv(n, block),)](
                f, bounds, n, float(crop_size_px - 1), BLOCK=block, num_warps=1, **self._options()
            )
        return bounds

    def _device_scope(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _options(self) -> dict[str, bool]:
        return {} if self._interpreted else self._compile_options

    def _chunk_inputs(
        self,
        mesh: MeshTensors,
        poses: Tensor,
        projection: Tensor,
        crop: tuple[Tensor, Tensor] | None,
        size_hw: tuple[int, int],
    ) -> _PoseChunk:  # type: ignore[override]  # per-pose inputs; the kernels do the per-vertex work
        m = clip_from_centred(projection, poses, constants=self.constants).contiguous()
        crop_rows = None if crop is None else torch.cat(crop, dim=1).contiguous()  # [ax, ay, bx, by]
        return _PoseChunk(m, crop_rows, poses.contiguous(), size_hw)

    def scratch_for(self, n: int, size_hw: tuple[int, int], n_faces: int) -> _Scratch:
        """The scratch a chunk of ``n`` hypotheses renders with (allocated on first use, then kept)."""
        capacity = min(1 << max(0, int(n) - 1).bit_length(), max(self.config.chunk_hypotheses, int(n)))
        key = (capacity, int(size_hw[0]), int(size_hw[1]), int(n_faces))
        scratch = self._scratch.get(key)
        if scratch is None:
            h, w = key[1], key[2]
            if capacity * h * w >= 2**31 or capacity * n_faces >= 2**31:
                raise ValueError(f"render too large for int32 indexing: {capacity} x {h} x {w}, {n_faces} faces")
            scratch = _Scratch(capacity, (h, w), n_faces, self.device)
            self._scratch[key] = scratch
            logger.debug("triton renderer scratch: capacity %d, %dx%d, %d faces", capacity, h, w, n_faces)
        return scratch

    def _draw(self, mesh: MeshTensors | RowMeshes, chunk: _PoseChunk, rgb: Tensor, xyz: Tensor,  # type: ignore[override]
              mask: Tensor) -> None:
        kernels, cfg, launch = _kernels(), self.config, self.launch
        n = chunk.poses.shape[0]
        h, w = chunk.size_hw
        grouped = isinstance(mesh, RowMeshes)
        if grouped:  # one pass over the group's packed tables; each row rasterises its mesh's face range
            packed = mesh.group.packed
            faces, verts, normals = packed.faces, packed.verts, packed.normals
            n_faces, grid_faces = packed.total_faces, packed.max_faces
            albedo, colour, colour_faces, texture, tex_h, tex_w = 0, packed.uv, packed.uv_faces, packed.texture, 1, 1
            row_mesh = mesh.row_mesh
            raster_tables = (row_mesh, packed.face_start, packed.face_count)
            resolve_tables = (row_mesh, packed.albedo, packed.vertex_colors, packed.tex_offset, packed.tex_h,
                              packed.tex_w)
        else:
            faces = _int32(mesh.faces)
            n_faces = grid_faces = faces.shape[0]
            verts = _f32(mesh.verts)
            normals = _f32(mesh.normals)
            source = self.albedo_source(mesh)
            if source == "texture":
                albedo, colour = 2, _f32(mesh.uv)
                colour_faces = _int32(mesh.uv_faces if mesh.uv_faces is not None else mesh.faces)
                texture = _f32(mesh.texture)
                if texture.ndim != 3 or texture.shape[2] != 3:
                    raise ValueError(f"mesh.texture: expected (Ht, Wt, 3); got {tuple(texture.shape)}")
                tex_h, tex_w = texture.shape[0], texture.shape[1]
            elif source == "vertex_colors":
                albedo, colour, colour_faces, texture, tex_h, tex_w = 1, _f32(mesh.vertex_colors), faces, verts, 1, 1
            else:
                albedo, colour, colour_faces, texture, tex_h, tex_w = 0, verts, faces, verts, 1, 1
            raster_tables = (faces, faces, faces)  # unused without GROUPED
            resolve_tables = (faces, faces, faces, faces, faces, faces)
        if n_faces == 0:
            rgb.zero_()
            xyz.zero_()
            mask.zero_()
            return
        scratch = self.scratch_for(n, (h, w), n_faces)
        m, crop, poses = chunk.clip_from_centred, chunk.crop, chunk.poses
        has_crop = crop is not None
        crop_arg = crop if has_crop else m  # unused without a crop
        xs, xo = _pixel_centre_consts(w)
        ys, yo = _pixel_centre_consts(h)
        variant = 0 if self.device.type == "cuda" else 1  # compiled on CUDA (unless TRITON_INTERPRET=1)
        small = kernels.RASTER_SMALL_KERNELS[variant]
        large = kernels.RASTER_LARGE_KERNELS[variant]
        resolve = kernels.RESOLVE_KERNELS[variant]
        options = self._options()
        epilogue = _NETWORK_EPILOGUE.get()
        xyz_scale, invalid_z = epilogue if epilogue is not None else (1.0, 0.0)
        mask_u8 = mask.view(torch.uint8)
        with _quiet(self._interpreted):
            raster_args = (
                verts, faces, m, crop_arg, scratch.zbuf, scratch.queue, scratch.count, *raster_tables,
                n_faces, h, w, xs, xo, ys, yo, scratch.queue_capacity,
            )
            small[(triton_cdiv(grid_faces, launch.block_triangles), n)](
                *raster_args,
                HAS_CROP=has_crop,
                GROUPED=grouped,
                SMALL_AREA=launch.small_area,
                BLOCK_T=launch.block_triangles,
                num_warps=launch.raster_warps,
                **options,
            )
            large[(launch.large_programs, launch.large_splits)](
                *raster_args,
                HAS_CROP=has_crop,
                TILE_H=launch.tile_h,
                TILE_W=launch.tile_w,
                num_warps=launch.large_warps,
                **options,
            )
            resolve[(triton_cdiv(h * w, launch.block_pixels), n)](
                verts, normals, faces, colour, colour_faces, texture, m, crop_arg, poses,
                scratch.zbuf, scratch.count, rgb, xyz, mask_u8,
                h, w, xs, xo, ys, yo, tex_h, tex_w,
                float(np.float32(cfg.untextured_albedo)), float(np.float32(cfg.ambient_weight)),
                float(np.float32(cfg.diffuse_weight)),
                RGB_SCALE, xyz_scale, invalid_z, float(XYZ_CLIP),
                *rgb.stride(), *xyz.stride(), *mask_u8.stride(), *resolve_tables,
                HAS_CROP=has_crop,
                GROUPED=grouped,
                ALBEDO=albedo,
                NETWORK_INPUT=epilogue is not None,
                BLOCK_P=launch.block_pixels,
                num_warps=launch.resolve_warps,
                **options,
            )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pixel_centre_consts(size: int) -> tuple[float, float]:
    """nvdiffrast's pixel centre ``xs * j + xo``: ``xs = float32(2/size)``, ``xo = float32(1/size) - 1``."""
    scale = np.float32(2.0) / np.float32(size)
    offset = np.float32(1.0) / np.float32(size) - np.float32(1.0)
    return float(scale), float(offset)


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


def _is_interpreted(kernel: object) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(kernel, InterpretedFunction)


def _compile_options() -> dict[str, bool]:
    """Keep float32 products separately rounded (no FMA contraction), as the torch twin computes them."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no NVIDIA backend: the option is moot
        return {}
    return {"enable_fp_fusion": False} if "enable_fp_fusion" in CUDAOptions.__dataclass_fields__ else {}


@contextlib.contextmanager
def _quiet(interpreted: bool) -> Iterator[None]:
    """Under the interpreter, silence NumPy's warnings for the masked-out lanes (0/0, inf - inf)."""
    if interpreted:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            yield
    else:
        yield
