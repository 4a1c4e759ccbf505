"""Renderer interface: the output record, the backend protocol and the config (backends are built by
:mod:`foundationpose.render.factory`).

Every backend renders the centred mesh at N poses straight into S x S crops (spec §3): the crop-adjusted
OpenGL projection of :mod:`foundationpose.render.projection`, a z-buffer on ``z/w`` (nearest wins), no
culling, perspective-correct barycentrics, vertical flip, the shading of spec §3.4 and background 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from foundationpose.models.blocks import CROP_SIZE

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors
    from foundationpose.render.groups import RowMeshes

__all__ = ["RenderConfig", "RenderOutput", "Renderer"]

@dataclass(frozen=True, slots=True, kw_only=True)
class RenderConfig:
    """Numbers of the renderer; defaults are the reference's (spec §3)."""

    crop_size_px: int = CROP_SIZE  # S, side of the rendered crop = the networks' input side (spec §0)
    z_near_m: float = 0.001  # near plane (spec §3.2)
    z_far_m: float = 100.0  # far plane (spec §3.2)
    ambient_weight: float = 0.8  # colour = albedo * 0.8 + diffuse * albedo * 0.5 (spec §3.4)
    diffuse_weight: float = 0.5
    untextured_albedo: float = 102.0 / 255.0  # trimesh's default grey, used when a mesh has no colour at all (§8.22)
    chunk_hypotheses: int = 512  # hypotheses per rasterisation call (spec §1.4: the reference renders 512 at a time)
    cpu_fragment_budget: int = 1 << 19  # CPU rasteriser: candidate fragments evaluated per step (bounds memory)
    cpu_pair_budget: int = 1 << 20  # CPU rasteriser: (hypothesis, face) pairs set up per step
    join_caller_stream: bool = True  # CUDA: make the caller's current stream wait for the render (no host sync)
    # memoise P per host K (a service's few cameras); False for a new camera per call (training's random K), which
    # would only fill the memo
    cache_intrinsics: bool = True

    def __post_init__(self) -> None:
        if self.crop_size_px < 1:
            raise ValueError(f"crop_size_px must be >= 1, got {self.crop_size_px}")
        if not 0.0 < self.z_near_m < self.z_far_m:
            raise ValueError(f"need 0 < z_near_m < z_far_m, got {self.z_near_m}, {self.z_far_m}")
        for name in ("chunk_hypotheses", "cpu_fragment_budget", "cpu_pair_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RenderOutput:
    """Rendered hypotheses, row 0 = top of the crop (after the vertical flip of spec §3.2).

    rgb: (N, Hr, Wr, 3) float32 in [0, 1], shaded (spec §3.4), 0 on background.
    xyz_cam: (N, Hr, Wr, 3) float32 camera-frame (OpenCV) surface points in metres, 0 on background;
        ``xyz_cam[..., 2]`` is the rendered depth.
    mask: (N, Hr, Wr) bool coverage.
    ready: CUDA event recorded on the renderer's stream after the last write, or ``None`` (CPU, or the
        work was enqueued on the caller's current stream). Consumers on another stream wait on it.
    ``Hr = Wr = S`` for crop renders; ``(Hr, Wr) = (H, W)`` for full-frame renders.
    """

    rgb: Tensor
    xyz_cam: Tensor
    mask: Tensor
    ready: torch.cuda.Event | None = None

    @property
    def depth(self) -> Tensor:
        """(N, Hr, Wr) float32 metres, 0 on background (a view of ``xyz_cam``)."""
        return self.xyz_cam[..., 2]

    @classmethod
    def empty(cls, n: int, size_hw: tuple[int, int], device: str | torch.device) -> RenderOutput:
        """Uninitialised buffers for ``n`` renders of ``size_hw``; every element is overwritten by a render."""
        h, w = size_hw
        return cls(
            rgb=torch.empty((n, h, w, 3), dtype=torch.float32, device=device),
            xyz_cam=torch.empty((n, h, w, 3), dtype=torch.float32, device=device),
            mask=torch.empty((n, h, w), dtype=torch.bool, device=device),
        )

    def with_ready(self, ready: torch.cuda.Event | None) -> RenderOutput:
        """The same buffers with ``ready`` replaced."""
        return dataclasses.replace(self, ready=ready)


@runtime_checkable
class Renderer(Protocol):
    """A rendering backend (``CpuRasterizer``, ``NvdiffrastRenderer``, ``TritonRasterizer``)."""

    name: str
    device: torch.device
    config: RenderConfig

    def render(
        self,
        mesh: MeshTensors | RowMeshes,
        cam_from_centred: Tensor,
        K: np.ndarray | Tensor,
        img_hw: tuple[int, int],
        crop_from_img: Tensor,
        out: RenderOutput | None = None,
    ) -> RenderOutput:
        """Render the centred mesh at each pose straight into its S x S crop (spec §3.3).

        mesh: tensors of the centred mesh on ``self.device``, or a
            :class:`~foundationpose.render.groups.RowMeshes` (row i renders mesh ``row_mesh[i]`` of a group, as
            a render of that mesh alone would).
        cam_from_centred: (N, 4, 4) float32 poses of the centred mesh (upstream ``ob_in_cam``).
        K: (3, 3) intrinsics in pixels (float64 numpy recommended; the projection is built in float64), or
            (N, 3, 3): one per pose (each pose renders exactly as a (3, 3) call with its K would).
        img_hw: (H, W) of the full input image; the projection uses them (spec §3.2).
        crop_from_img: (N, 3, 3) float32 image-to-crop pixel transforms (spec §2.5).
        out: optional (N, S, S, ...) buffers on ``self.device``, fully overwritten.
        Returns ``out`` (or new buffers) with ``ready`` set as documented on :class:`RenderOutput`.
        """
        ...

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
        """Render at the full image resolution (H, W), no crop.

        ``pixel_centre_exact=False`` is the reference's convention: pixel (j, i) samples the image plane at
        ``(j + 0.5, i + 0.5)``. ``True`` uses the OpenCV integer-centre convention (pixel (j, i) samples
        ``(j, i)``), for generating ground-truth scenes (spec §3.3, last paragraph).
        """
        ...
