"""Choosing and building a renderer backend: :func:`make_renderer`, with the Triton rasteriser's start-up self-check.

``auto`` picks, on a CUDA device, the fastest backend that works there: the Triton rasteriser when
:func:`triton_self_check` passes (it renders a test mesh like the CPU rasteriser; it is the backend whose renders can
be captured in CUDA graphs), else nvdiffrast when it is installed and its plugin builds, else the CPU rasteriser;
the choice is logged once per device and reason. On a CPU device ``auto`` is the CPU rasteriser (the reference).
"""

from __future__ import annotations

import functools
import logging
import math
import threading

import torch

from foundationpose.errors import RenderError
from foundationpose.render.base import RenderConfig, Renderer, RenderOutput

__all__ = ["RENDERER_NAMES", "make_renderer", "render_full_frame", "triton_self_check"]

logger = logging.getLogger(__name__)

RENDERER_NAMES = ("auto", "cpu", "nvdiffrast", "triton")

# self-check tolerances against the CPU rasteriser (a sanity check of the compiled kernels, not a precision test:
# the parity tests hold the backends to 1e-6 m): covered pixels that disagree, and the 99th percentile of the
# differences where both cover the pixel
_SELF_CHECK_MASK_MISMATCH = 0.01  # fraction of covered pixels
_SELF_CHECK_XYZ_M = 1e-4
_SELF_CHECK_RGB = 1e-3

_choices: set[tuple[str, str]] = set()  # (device, outcome) pairs already logged
_choices_lock = threading.Lock()


def make_renderer(
    name: str = "auto",
    device: str | torch.device = "cpu",
    config: RenderConfig | None = None,
) -> Renderer:
    """Build a renderer backend.

    name: ``"auto"`` (see the module docstring), ``"cpu"`` (the torch rasteriser, on any device), ``"nvdiffrast"``
        (CUDA only) or ``"triton"`` (the CUDA-graph-capturable Triton rasteriser; on a CPU device it runs under
        Triton's interpreter, for tests).
    Raises RenderError when the requested backend is unavailable, ValueError for an unknown name.
    """
    config = config or RenderConfig()
    device = torch.device(device)
    if name not in RENDERER_NAMES:
        raise ValueError(f"renderer name must be one of {', '.join(RENDERER_NAMES)}; got {name!r}")
    if name == "triton":
        from foundationpose.render.triton_raster import TritonRasterizer

        return TritonRasterizer(device, config)
    if name == "auto" and device.type == "cuda":
        why_not = triton_self_check(device, config)
        if why_not is None:
            from foundationpose.render.triton_raster import TritonRasterizer

            _log_choice(device, "triton", "renderer: the Triton rasteriser on %s (self-check passed)", device)
            return TritonRasterizer(device, config)
        _log_choice(device, "no-triton", "renderer: the Triton rasteriser failed its self-check on %s (%s); steps "
                    "will not be captured in CUDA graphs", device, why_not, level=logging.WARNING)
    if name in ("auto", "nvdiffrast") and device.type == "cuda":
        from foundationpose.render.nvdiffrast_backend import NvdiffrastRenderer, has_nvdiffrast

        if has_nvdiffrast():
            try:
                renderer = NvdiffrastRenderer(device, config)
            except RenderError as exc:
                if name == "nvdiffrast":
                    raise
                _log_choice(device, "no-nvdiffrast", "renderer: nvdiffrast unavailable on %s (%s)", device, exc,
                            level=logging.WARNING)
            else:
                if name == "auto":
                    _log_choice(device, "nvdiffrast", "renderer: nvdiffrast on %s", device)
                return renderer
        elif name == "nvdiffrast":
            raise RenderError("nvdiffrast is not installed (pip install diffrp-nvdiffrast)")
        _log_choice(device, "cpu", "renderer: the CPU rasteriser on %s (slow on a GPU)", device, level=logging.WARNING)
    elif name == "nvdiffrast":
        raise RenderError(f"the nvdiffrast renderer needs a CUDA device, got {device}")
    from foundationpose.render.cpu_raster import CpuRasterizer

    return CpuRasterizer(device, config)


def triton_self_check(device: torch.device, config: RenderConfig | None = None) -> str | None:
    """Render a small textured test mesh at four poses with the Triton rasteriser and the CPU rasteriser on
    ``device`` and compare: None when they agree (mask, points and colours within the self-check tolerances), else
    one sentence saying why not (triton missing, a kernel that fails to compile or launch, renders that differ).
    Checked once per device and config in a process (the answer is remembered)."""
    return _self_check(str(torch.device(device)), config or RenderConfig())


@functools.cache
def _self_check(device_name: str, config: RenderConfig) -> str | None:
    device = torch.device(device_name)
    try:
        from foundationpose.render.triton_raster import TritonRasterizer

        triton = TritonRasterizer(device, config)
    except RenderError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever stops the backend from loading is the reason
        return f"{type(exc).__name__}: {exc}"
    from foundationpose.crop import crop_windows
    from foundationpose.mesh import MeshTensors
    from foundationpose.render.cpu_raster import CpuRasterizer
    from foundationpose.synthetic.pillow_box import pillow_box_arrays

    mesh = MeshTensors(**pillow_box_arrays(subdivisions=2)).to(device)
    diameter = float(torch.cdist(mesh.verts.double(), mesh.verts.double()).max())
    poses = _self_check_poses().to(device)
    K = torch.tensor([[500.0, 0.0, 320.0], [0.0, 500.0, 240.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    hw = (480, 640)
    try:
        windows = crop_windows(poses, K.numpy(), diameter, 1.2, S=config.crop_size_px)
        got = triton.render(mesh, poses, K.numpy(), hw, windows)
        want = CpuRasterizer(device, config).render(mesh, poses, K.numpy(), hw, windows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to compile or launch is the reason
        return f"test render failed: {type(exc).__name__}: {exc}"
    return _compare(got, want)


def _self_check_poses() -> torch.Tensor:
    """(4, 4, 4) float32 cam_from_centred: the test mesh 0.5 m ahead, turned four ways."""
    poses = []
    for i, (a, b) in enumerate(((0.3, 0.5), (1.2, -0.4), (2.5, 0.9), (-0.8, 2.2))):
        ca, sa, cb, sb = math.cos(a), math.sin(a), math.cos(b), math.sin(b)
        rot = torch.tensor([[ca, -sa, 0.0], [sa, ca, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64) @ torch.tensor(
            [[1.0, 0.0, 0.0], [0.0, cb, -sb], [0.0, sb, cb]], dtype=torch.float64)
        pose = torch.eye(4, dtype=torch.float64)
        pose[:3, :3] = rot
        pose[:3, 3] = torch.tensor([0.01 * (i - 1.5), -0.005 * i, 0.5], dtype=torch.float64)
        poses.append(pose)
    return torch.stack(poses).to(torch.float32)


def _compare(got: RenderOutput, want: RenderOutput) -> str | None:
    covered = int(want.mask.sum())
    if covered == 0:
        return "the CPU rasteriser rendered nothing of the test mesh"
    mismatch = int((got.mask != want.mask).sum())
    if mismatch > _SELF_CHECK_MASK_MISMATCH * covered:
        return f"masks differ in {mismatch} of {covered} covered pixels"
    both = got.mask & want.mask
    for label, a, b, tol in (("points", got.xyz_cam, want.xyz_cam, _SELF_CHECK_XYZ_M),
                             ("colours", got.rgb, want.rgb, _SELF_CHECK_RGB)):
        diff = (a[both] - b[both]).abs().amax(dim=-1).float()
        if not torch.isfinite(diff).all():
            return f"{label} are not finite"
        p99 = float(torch.quantile(diff, 0.99)) if diff.numel() else 0.0
        if p99 > tol:
            return f"{label} differ by {p99:.3g} at the 99th percentile (tolerance {tol:g})"
    return None


def _log_choice(device: torch.device, outcome: str, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log a renderer choice once per (device, outcome)."""
    key = (str(device), outcome)
    with _choices_lock:
        if key in _choices:
            return
        _choices.add(key)
    logger.log(level, message, *args)


def render_full_frame(
    mesh: object,
    cam_from_centred: torch.Tensor,
    K: object,
    img_hw: tuple[int, int],
    *,
    pixel_centre_exact: bool = False,
    renderer: Renderer | None = None,
) -> RenderOutput:
    """Full-resolution render (see :meth:`Renderer.render_full_frame`) with ``renderer`` or, when omitted,
    ``make_renderer("auto", <device of mesh.verts>)``. Returns (N, H, W, ...) buffers."""
    if renderer is None:
        renderer = make_renderer("auto", mesh.verts.device)  # type: ignore[attr-defined]
    return renderer.render_full_frame(mesh, cam_from_centred, K, img_hw,  # type: ignore[arg-type]
                                      pixel_centre_exact=pixel_centre_exact)
