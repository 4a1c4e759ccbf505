"""The render flow shared by every backend: checks, vertex transforms, chunking and write-out.

A backend supplies one method, :meth:`RendererCore._draw`, which rasterises one chunk of hypotheses and writes
shaded colour, xyz and coverage straight into the caller's output views, flipped vertically (the raster's row
0 is NDC y = -1, the output's row 0 is the top of the image: backends flip the raster once and do every
per-pixel step on the flipped raster). Everything else (the projection of spec §3.2, the crop transform of
§3.3, per-vertex xyz and diffuse terms, streams) lives here so both backends see bit-identical vertex inputs.

Per call this costs a fixed, small number of batched ops for all N poses (no host sync, no per-call host-to-
device copies: ``P`` per host K and the small constant matrices are cached on the device), one pass when
N <= ``chunk_hypotheses``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from deploy_core.cuda import as_device, new_stream, record_event
from foundationpose.render._cache import DEFAULT_MAX_INTRINSICS_ENTRIES, GeometryConstants
from foundationpose.render.base import RenderConfig, RenderOutput
from foundationpose.render.groups import RowMeshes, albedo_source
from foundationpose.render.projection import (
    apply_crop_to_clip_,
    clip_from_centred,
    crop_bounds,
    crop_scale_offset,
    full_frame_exact_bounds,
    projection_on_device,
    projections_on_device,
    single_k,
    vertices_to_clip,
)
from foundationpose.render.shading import vertex_diffuse, vertices_in_cam

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["RendererCore", "ChunkInputs", "SideStreamCore"]

logger = logging.getLogger(__name__)


class ChunkInputs:
    """Per-vertex inputs of one chunk of ``n`` hypotheses (all float32, contiguous, on the render device).

    clip: (n, V, 4) clip coordinates after the crop transform. xyz_cam: (n, V, 3) metres.
    diffuse: (n, V, 1) Lambert term. size_hw: (Hr, Wr) raster resolution.
    """

    __slots__ = ("clip", "xyz_cam", "diffuse", "size_hw")

    def __init__(self, clip: Tensor, xyz_cam: Tensor, diffuse: Tensor, size_hw: tuple[int, int]) -> None:
        self.clip = clip
        self.xyz_cam = xyz_cam
        self.diffuse = diffuse
        self.size_hw = size_hw


class RendererCore:
    """Base class of the backends; see :class:`foundationpose.render.base.Renderer` for the contract.

    ``mesh`` may be a :class:`foundationpose.render.groups.RowMeshes` (row i renders mesh ``row_mesh[i]`` of a
    group): a backend with ``renders_groups`` (the Triton rasteriser) draws every row in one pass, the others render
    each mesh's rows as one sub-batch (:meth:`_render_split`).
    """

    name = "core"
    renders_groups = False  # True: _draw takes RowMeshes chunks itself

    def __init__(self, device: str | torch.device, config: RenderConfig | None = None) -> None:
        self.device = as_device(device)
        self.config = config or RenderConfig()
        # this renderer's memo of G, crop constants and P per camera (no module-global cache)
        self.constants = GeometryConstants(
            name=f"{self.name} renderer",
            max_intrinsics_entries=DEFAULT_MAX_INTRINSICS_ENTRIES if self.config.cache_intrinsics else 0,
        )

    # -- backend hooks -------------------------------------------------------------------------------------------

    def _draw(self, mesh: MeshTensors, chunk: ChunkInputs, rgb: Tensor, xyz: Tensor, mask: Tensor) -> None:
        """Rasterise and shade one chunk of ``n`` hypotheses into the output views ``rgb`` (n, Hr, Wr, 3) f32,
        ``xyz`` (n, Hr, Wr, 3) f32 and ``mask`` (n, Hr, Wr) bool on ``self.device`` (every element written),
        row 0 = top of the image, i.e. the raster (row 0 = NDC y = -1) flipped vertically."""
        raise NotImplementedError

    def _stream_scope(self, caller_tensors: Sequence[Tensor]) -> contextlib.AbstractContextManager[object]:
        """Context in which the chunks are enqueued (a CUDA stream for GPU backends). ``caller_tensors`` were
        made on the caller's stream and are read or written inside it."""
        return contextlib.nullcontext()

    def _finish(self, out: RenderOutput) -> RenderOutput:
        """Called after the last chunk was enqueued; GPU backends record their ready event here."""
        return out

    def _crop_bounds(self, crop_from_img: Tensor, crop_size_px: int) -> Tensor:
        """(N, 4) crop bounds of spec §3.3 (:func:`foundationpose.render.projection.crop_bounds`)."""
        return crop_bounds(crop_from_img, crop_size_px, constants=self.constants)

    # -- public API ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def render(
        self,
        mesh: MeshTensors | RowMeshes,
        cam_from_centred: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        crop_from_img: Tensor,
        out: RenderOutput | None = None,
    ) -> RenderOutput:
        """See :meth:`foundationpose.render.base.Renderer.render`."""
        poses = self._poses(cam_from_centred)
        n = poses.shape[0]
        crop = torch.as_tensor(crop_from_img).to(device=self.device, dtype=torch.float32)
        if crop.shape != (n, 3, 3):
            raise ValueError(f"crop_from_img: expected ({n}, 3, 3) to match cam_from_centred; got {tuple(crop.shape)}")
        s = self.config.crop_size_px
        bounds = self._crop_bounds(crop, s) if n else crop.new_zeros((0, 4))
        return self._render(mesh, poses, K, img_hw, bounds, (s, s), out)

    @torch.no_grad()
    def render_full_frame(
        self,
        mesh: MeshTensors,
        cam_from_centred: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        *,
        pixel_centre_exact: bool = False,
        out: RenderOutput | None = None,
    ) -> RenderOutput:
        """See :meth:`foundationpose.render.base.Renderer.render_full_frame`."""
        poses = self._poses(cam_from_centred)
        h, w = _check_hw(img_hw)
        bounds = full_frame_exact_bounds(poses.shape[0], (h, w), self.device) if pixel_centre_exact else None
        return self._render(mesh, poses, K, (h, w), bounds, (h, w), out)

    # -- shared flow ---------------------------------------------------------------------------------------------

    def _poses(self, cam_from_centred: Tensor) -> Tensor:
        poses = torch.as_tensor(cam_from_centred).to(device=self.device, dtype=torch.float32)
        if poses.ndim != 3 or poses.shape[1:] != (4, 4):
            raise ValueError(f"cam_from_centred: expected (N, 4, 4); got {tuple(poses.shape)}")
        return poses

    def _render(
        self,
        mesh: MeshTensors | RowMeshes,
        poses: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        bounds: Tensor | None,
        size_hw: tuple[int, int],
        out: RenderOutput | None,
    ) -> RenderOutput:
        h, w = _check_hw(img_hw)
        n = poses.shape[0]
        if isinstance(mesh, RowMeshes):
            if tuple(mesh.row_mesh.shape) != (n,):
                raise ValueError(f"row_mesh: expected ({n},) to match cam_from_centred; got {tuple(mesh.row_mesh.shape)}")
            if not self.renders_groups:
                return self._render_split(mesh, poses, K, (h, w), bounds, size_hw, out)
            for m in mesh.group.meshes:
                _check_mesh(m, self.device)
        else:
            _check_mesh(mesh, self.device)
        if out is None:
            out = RenderOutput.empty(n, size_hw, self.device)  # allocated on the caller's stream
        else:
            _check_out(out, n, size_hw, self.device)
        if n == 0:
            return out
        if not isinstance(K, Tensor):
            K = np.asarray(K)
        if tuple(K.shape) not in ((3, 3), (n, 3, 3)):
            raise ValueError(f"K: expected (3, 3) or ({n}, 3, 3); got {tuple(K.shape)}")
        k_one = single_k(K, n)  # one K for every pose (also a host stack of equal K): the cached (4, 4) P
        cfg = self.config
        step = cfg.chunk_hypotheses
        caller_tensors = [poses, out.rgb, out.xyz_cam, out.mask, *_mesh_tensors(mesh)]
        if bounds is not None:
            caller_tensors.append(bounds)
        if isinstance(K, Tensor):
            caller_tensors.append(K)
        with self._stream_scope(caller_tensors):
            if k_one is not None:
                projection = projection_on_device(
                    k_one, (h, w), cfg.z_near_m, cfg.z_far_m, self.device, constants=self.constants
                )
            else:  # (N, 4, 4): one P per pose, each the (3, 3) call's P for its K
                projection = projections_on_device(K, (h, w), cfg.z_near_m, cfg.z_far_m, self.device)
            # (N, 2) scale, (N, 2) offset
            crop = None if bounds is None else crop_scale_offset(bounds, (h, w), constants=self.constants)
            if n <= step:
                chunk = self._chunk_inputs(mesh, poses, projection, crop, size_hw)
                self._draw(mesh, chunk, out.rgb, out.xyz_cam, out.mask)
            else:
                for start in range(0, n, step):
                    sl = slice(start, min(start + step, n))
                    crop_sl = None if crop is None else (crop[0][sl], crop[1][sl])
                    proj_sl = projection if projection.ndim == 2 else projection[sl]
                    mesh_sl = mesh.rows(sl) if isinstance(mesh, RowMeshes) else mesh
                    chunk = self._chunk_inputs(mesh_sl, poses[sl], proj_sl, crop_sl, size_hw)
                    self._draw(mesh_sl, chunk, out.rgb[sl], out.xyz_cam[sl], out.mask[sl])
        return self._finish(out)

    def _render_split(
        self,
        rows: RowMeshes,
        poses: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        bounds: Tensor | None,
        size_hw: tuple[int, int],
        out: RenderOutput | None,
    ) -> RenderOutput:
        """The reference form of a group render: the rows of each mesh rendered as one sub-batch of that mesh (row
        for row what a render of that mesh alone gives), then copied into their rows of ``out``. Reads the row
        indices on the host (``rows.row_mesh_host``, else a synchronisation), so it is not capturable."""
        n = poses.shape[0]
        if out is None:
            out = RenderOutput.empty(n, size_hw, self.device)
        else:
            _check_out(out, n, size_hw, self.device)
        index = rows.host_indices()
        if index.shape != (n,) or (n and (index.min() < 0 or index.max() >= len(rows.group))):
            raise ValueError(f"row_mesh: expected {n} indices in [0, {len(rows.group)}); got {index.tolist()}")
        if not isinstance(K, Tensor):
            K = np.asarray(K)
        per_pose_k = tuple(K.shape) != (3, 3)
        for k in np.unique(index):
            sel_host = np.flatnonzero(index == k)
            mesh = rows.group.meshes[int(k)]
            if sel_host.shape[0] == n:  # every row renders this mesh: straight into out
                return self._render(mesh, poses, K, img_hw, bounds, size_hw, out)
            sel = torch.as_tensor(sel_host, device=self.device)
            k_rows = (K[sel_host] if isinstance(K, np.ndarray) else K[sel.to(K.device)]) if per_pose_k else K
            part = self._render(mesh, poses[sel], k_rows, img_hw, None if bounds is None else bounds[sel], size_hw,
                                None)
            if part.ready is not None and not self.config.join_caller_stream:
                torch.cuda.current_stream(self.device).wait_event(part.ready)
            out.rgb[sel] = part.rgb  # on the caller's stream, after the part's render
            out.xyz_cam[sel] = part.xyz_cam
            out.mask[sel] = part.mask
        return out

    def _chunk_inputs(
        self,
        mesh: MeshTensors,
        poses: Tensor,
        projection: Tensor,
        crop: tuple[Tensor, Tensor] | None,
        size_hw: tuple[int, int],
    ) -> ChunkInputs:
        clip_from_centred_ = clip_from_centred(projection, poses, constants=self.constants)
        clip = vertices_to_clip(mesh.verts, clip_from_centred_)  # (n, V, 4), a new tensor
        if crop is not None:
            clip = apply_crop_to_clip_(clip, *crop)
        xyz_cam = vertices_in_cam(mesh.verts, poses)  # (n, V, 3)
        diffuse = vertex_diffuse(mesh.normals, poses)  # (n, V, 1)
        return ChunkInputs(clip, xyz_cam, diffuse, size_hw)

    def albedo_source(self, mesh: MeshTensors) -> str:
        """Which colour the mesh renders with: ``"texture"``, ``"vertex_colors"`` or ``"uniform"`` (grey 0.4)."""
        return albedo_source(mesh)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device={self.device} S={self.config.crop_size_px}>"


class SideStreamCore(RendererCore):
    """A CUDA backend that enqueues every render on a stream of its own (or the one given).

    ``render`` makes that stream wait for the caller's current stream (inputs are ready), marks the caller's
    tensors with ``record_stream``, enqueues the chunks, records ``RenderOutput.ready`` and, with
    ``RenderConfig.join_caller_stream`` (default), makes the caller's current stream wait for it. No call
    synchronises the host; under CUDA graph capture this fork and join are captured as graph edges.
    """

    def __init__(
        self,
        device: str | torch.device,
        config: RenderConfig | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        super().__init__(device, config)
        self._stream = stream if stream is not None else new_stream(self.device)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The CUDA stream every render is enqueued on."""
        return self._stream

    def _stream_scope(self, caller_tensors: Sequence[Tensor]) -> contextlib.AbstractContextManager[object]:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # GPU-side: inputs are ready
        for t in caller_tensors:
            if t.is_cuda:
                t.record_stream(self._stream)  # keep the allocator from reusing them while we read/write
        scope = contextlib.ExitStack()
        scope.enter_context(torch.cuda.device(self.device))  # kernels launch on the current device
        scope.enter_context(torch.cuda.stream(self._stream))
        return scope

    def _finish(self, out: RenderOutput) -> RenderOutput:
        ready = record_event(self._stream)
        if self.config.join_caller_stream:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return out.with_ready(ready)


def _mesh_tensors(mesh: MeshTensors | RowMeshes) -> list[Tensor]:
    if isinstance(mesh, RowMeshes):
        packed = mesh.group.packed
        return [mesh.row_mesh, *(t for t in (getattr(packed, f) for f in packed.__slots__) if isinstance(t, Tensor))]
    fields = ("verts", "faces", "normals", "uv", "uv_faces", "texture", "vertex_colors")
    return [t for t in (getattr(mesh, f, None) for f in fields) if isinstance(t, Tensor)]


def _check_hw(img_hw: tuple[int, int]) -> tuple[int, int]:
    h, w = (int(x) for x in img_hw)
    if h < 1 or w < 1:
        raise ValueError(f"img_hw: expected positive (H, W); got {tuple(img_hw)}")
    return h, w


def _check_mesh(mesh: MeshTensors, device: torch.device) -> None:
    verts, faces = mesh.verts, mesh.faces
    if verts.ndim != 2 or verts.shape[1] != 3 or faces.ndim != 2 or faces.shape[1] != 3:
        raise ValueError(f"mesh: expected verts (V, 3) and faces (F, 3); got {tuple(verts.shape)}, {tuple(faces.shape)}")
    if verts.device != device:
        raise ValueError(f"mesh: tensors are on {verts.device} but the renderer runs on {device}; call mesh.to(...)")


def _check_out(out: RenderOutput, n: int, size_hw: tuple[int, int], device: torch.device) -> None:
    h, w = size_hw
    expected = {"rgb": (n, h, w, 3), "xyz_cam": (n, h, w, 3), "mask": (n, h, w)}
    for field, shape in expected.items():
        t = getattr(out, field)
        if tuple(t.shape) != shape:
            raise ValueError(f"out.{field}: expected {shape}; got {tuple(t.shape)}")
    if out.rgb.dtype != torch.float32 or out.xyz_cam.dtype != torch.float32 or out.mask.dtype != torch.bool:
        raise ValueError("out: expected float32 rgb/xyz_cam and bool mask")
    for field in expected:
        t = getattr(out, field)
        if t.device != device:
            raise ValueError(f"out.{field}: expected a tensor on {device}; got one on {t.device}")
