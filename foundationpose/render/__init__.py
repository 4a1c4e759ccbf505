"""Rendering of pose hypotheses straight into network crops (spec §3).

Backends: :class:`CpuRasterizer` (plain torch, any device; the fallback), :class:`NvdiffrastRenderer`
(CUDA, the reference's rasteriser; nvdiffrast is imported only when it is built) and
``foundationpose.render.triton_raster.TritonRasterizer`` (Triton kernels, capturable in a CUDA graph; triton is
imported only when it is asked for). Pick one with :func:`make_renderer`.
"""

from foundationpose.render.base import RenderConfig, Renderer, RenderOutput
from foundationpose.render.cpu_raster import CpuRasterizer
from foundationpose.render.factory import make_renderer, render_full_frame, triton_self_check
from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer, has_nvdiffrast

__all__ = [
    "CpuRasterizer",
    "NvdiffrastRenderer",
    "RenderConfig",
    "RenderOutput",
    "Renderer",
    "has_nvdiffrast",
    "make_renderer",
    "render_full_frame",
    "triton_self_check",
]
