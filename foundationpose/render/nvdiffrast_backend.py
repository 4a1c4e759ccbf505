"""nvdiffrast (CUDA) backend: the reference's renderer (spec §3), on its own CUDA stream.

nvdiffrast is imported lazily, only here. Its CUDA plugin is JIT-built by ``torch.utils.cpp_extension.load``
on the first ``RasterizeCudaContext`` and then imported *by module name*; recent torch (seen with 2.11) no
longer registers JIT-loaded modules in ``sys.modules``, so that import fails with
``ModuleNotFoundError: nvdiffrast_plugin``. :func:`jit_modules_registered` works around it: while the context
is created, every module returned by ``load`` (and by torch's private ``_import_module_from_library``, for
callers that imported ``load`` by name) is registered in ``sys.modules`` under its own name. The patch is
scoped to the context creation, serialised by a lock, and restored afterwards.

Streams: the renderer owns one CUDA stream (or uses the one given), as described on
:class:`foundationpose.render._core.SideStreamCore`. No call synchronises the host.
Keep nvdiffrast out of CUDA graph capture (capturing ``rasterize`` crashes, see notes/device.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from deploy_core.cuda import as_device
from foundationpose.errors import RenderError
from foundationpose.render._core import ChunkInputs, SideStreamCore
from foundationpose.render.base import RenderConfig
from foundationpose.render.shading import shade

if TYPE_CHECKING:
    from foundationpose.mesh import MeshTensors

__all__ = ["NvdiffrastRenderer", "has_nvdiffrast", "jit_modules_registered"]

logger = logging.getLogger(__name__)

_PLUGIN_LOCK = threading.Lock()  # serialises the scoped patch of torch.utils.cpp_extension


def has_nvdiffrast() -> bool:
    """True when CUDA is usable and the ``nvdiffrast`` package can be found (its plugin may still fail to build)."""
    return torch.cuda.is_available() and importlib.util.find_spec("nvdiffrast") is not None


def _registering(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if isinstance(result, types.ModuleType):
            sys.modules.setdefault(result.__name__, result)
        return result

    return wrapper


@contextlib.contextmanager
def jit_modules_registered() -> Iterator[None]:
    """Within the block, modules loaded by ``torch.utils.cpp_extension`` are registered in ``sys.modules``.

    Wraps ``torch.utils.cpp_extension.load`` and, when present, ``_import_module_from_library``; both are restored
    on exit. Harmless on torch versions that register the module themselves.
    """
    import torch.utils.cpp_extension as cpp_extension

    names = [name for name in ("load", "_import_module_from_library") if hasattr(cpp_extension, name)]
    with _PLUGIN_LOCK:
        saved = {name: getattr(cpp_extension, name) for name in names}
        try:
            for name in names:
                setattr(cpp_extension, name, _registering(saved[name]))
            yield
        finally:
            for name, fn in saved.items():
                setattr(cpp_extension, name, fn)


def _start_nvdiffrast(device: torch.device) -> tuple[Any, Any]:
    """Import ``nvdiffrast.torch`` and create a ``RasterizeCudaContext`` on ``device`` (builds the plugin once)."""
    try:
        with jit_modules_registered():
            import nvdiffrast.torch as dr

            ctx = dr.RasterizeCudaContext(device=device)
    except Exception as exc:  # ImportError, build failures (RuntimeError, OSError, subprocess errors)
        raise RenderError(f"nvdiffrast could not start on {device}: {type(exc).__name__}: {exc}") from exc
    return dr, ctx


class NvdiffrastRenderer(SideStreamCore):
    """The reference renderer: ``dr.rasterize`` / ``dr.interpolate`` / ``dr.texture`` in chunks of 512.

    device: a CUDA device. stream: the CUDA stream to render on (default: a new stream owned by the renderer).
    Raises RenderError when nvdiffrast cannot be imported or its plugin cannot be built.
    """

    name = "nvdiffrast"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        config: RenderConfig | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        if as_device(device).type != "cuda":
            raise RenderError(f"the nvdiffrast renderer needs a CUDA device, got {device}")
        super().__init__(device, config, stream)
        self._dr, self._ctx = _start_nvdiffrast(self.device)
        logger.info("nvdiffrast renderer ready on %s", self.device)

    def _draw(self, mesh: MeshTensors, chunk: ChunkInputs, rgb: Tensor, xyz: Tensor, mask: Tensor) -> None:
        dr, cfg = self._dr, self.config
        faces = _int32(mesh.faces)
        try:
            rast, _ = dr.rasterize(self._ctx, chunk.clip, faces, resolution=chunk.size_hw)  # (n, Hr, Wr, 4)
            # Row 0 = top of the image. interpolate / texture (no derivatives, no mipmaps) are per pixel, so
            # running them on the flipped raster gives the flipped images without flipping each output.
            rast = rast.flip(1)
            xyz_img, _ = dr.interpolate(chunk.xyz_cam, rast, faces)
            diffuse, _ = dr.interpolate(chunk.diffuse, rast, faces)
            source = self.albedo_source(mesh)
            if source == "texture":
                uv_faces = _int32(mesh.uv_faces if mesh.uv_faces is not None else mesh.faces)
                uv, _ = dr.interpolate(mesh.uv.contiguous(), rast, uv_faces)
                albedo = dr.texture(
                    mesh.texture[None].contiguous(), uv, filter_mode="linear", boundary_mode="wrap"
                )
            elif source == "vertex_colors":
                albedo, _ = dr.interpolate(mesh.vertex_colors.contiguous(), rast, faces)
            else:
                albedo = torch.full_like(xyz_img, cfg.untextured_albedo)
        except RuntimeError as exc:
            raise RenderError(f"nvdiffrast failed on {self.device}: {exc}") from exc
        xyz.copy_(xyz_img)
        coverage = rast[..., 3:4].clamp(0.0, 1.0)
        torch.mul(shade(albedo, diffuse, cfg.ambient_weight, cfg.diffuse_weight), coverage, out=rgb)
        torch.gt(rast[..., 3], 0, out=mask)


def _int32(faces: Tensor) -> Tensor:
    return faces if faces.dtype == torch.int32 and faces.is_contiguous() else faces.to(torch.int32).contiguous()
