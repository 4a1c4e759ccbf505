"""Skip marks shared by the Triton kernel tests (interpreter on CPU, compiled kernels on CUDA)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import pytest
import torch


def missing_triton(exc: ImportError) -> str:
    """The skip reason when a kernel module cannot be imported."""
    return f"triton is not installed ({exc}); pip install triton to run these"


def import_kernels(module: str) -> tuple[ModuleType | None, str]:
    """(the kernel module, "") or (None, the skip reason) when it cannot be imported (CPU CI without triton)."""
    try:
        return importlib.import_module(module), ""
    except ImportError as exc:
        return None, missing_triton(exc)


def skip_without_ptx_compiler(interpreted: bool) -> None:
    """Skip a test that compiles kernels for sm_90 offline where Triton has no NVIDIA backend, or where the kernel
    is interpreted (``interpreted``: TRITON_INTERPRET=1 gives no compiler)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: F401
    except ImportError:
        pytest.skip("triton without the NVIDIA backend")
    if interpreted:
        pytest.skip("TRITON_INTERPRET=1: no compiler")


# What Triton's CPU interpreter (3.6 and older) raises on numpy >= 2.4 when a kernel loops to a bound it loaded from
# memory: it turns the loaded one-element array into a Python int, which numpy 2.4 no longer allows.
_INTERPRETER_NUMPY_BREAK = "only 0-dimensional arrays can be converted to Python scalars"


def _interpreter_problem(what: str, probe: Callable[[], object]) -> str | None:
    """Why ``what``'s kernels cannot run under this Triton's CPU interpreter with this numpy: ``probe`` runs them
    once on a tiny input (None when it passes, or when it fails some other way: such a failure is the tests' to
    report)."""
    import numpy as np
    import triton

    try:
        probe()
    except Exception as exc:  # noqa: BLE001 - only the known break is a skip; the chain holds the numpy error
        chain, link = [], exc
        while link is not None:
            chain.append(repr(link))
            link = link.__cause__ or link.__context__
        if any(_INTERPRETER_NUMPY_BREAK in text for text in chain):
            return (f"Triton {triton.__version__}'s CPU interpreter cannot run {what} with numpy "
                    f"{np.__version__} (a loaded loop bound is converted with int(); numpy >= 2.4 refuses it); "
                    "the compiled kernels are tested on CUDA")
    return None


def _render_one_box() -> None:
    """The rasteriser's inline and tiled (queued) kernels on one small box."""
    from foundationpose.bench.render_parity import DEMO_HW, DEMO_K, random_poses
    from foundationpose.crop import crop_windows
    from foundationpose.mesh import MeshTensors
    from foundationpose.render import RenderConfig
    from foundationpose.render.triton_raster import LaunchConfig, TritonRasterizer
    from foundationpose.synthetic.pillow_box import pillow_box_arrays

    poses, config = random_poses(1, 0), RenderConfig(crop_size_px=8)
    mesh, windows = MeshTensors(**pillow_box_arrays(subdivisions=1)), crop_windows(poses, DEMO_K, 0.2, 1.2, S=8)
    queued = LaunchConfig(block_triangles=1024, small_area=1, tile_h=8, tile_w=8, large_programs=2, large_splits=2,
                          block_pixels=64)
    for launch in (None, queued):
        TritonRasterizer("cpu", config, launch=launch).render(mesh, poses, DEMO_K, DEMO_HW, windows)


def _measure_one_row() -> None:
    """The validity's per-row kernel (it loops over the object's point chunks, a bound it loads) on one pose."""
    from foundationpose.mesh import load_object
    from foundationpose.synthetic.meshes import make_procedural_mesh
    from foundationpose.validity import ValidityConfig, ValidityModel, measure_validity

    model = ValidityModel.from_object(load_object(make_procedural_mesh("textured_asym")), "cpu", count=64)
    pose = torch.eye(4)[None]
    pose[0, 2, 3] = 0.5
    K = torch.tensor([[[100.0, 0.0, 15.5], [0.0, 100.0, 15.5], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    measure_validity(torch.full((1, 32, 32), 0.5), K, pose, pose, model, ValidityConfig(), impl="triton")


@functools.cache
def raster_interpreter_problem() -> str | None:
    """Why the rasteriser's kernels cannot run under this Triton's CPU interpreter (None when they can)."""
    return _interpreter_problem("the rasteriser", _render_one_box)


@functools.cache
def validity_rows_interpreter_problem() -> str | None:
    """Why the validity's per-row kernel cannot run under this Triton's CPU interpreter (None when it can)."""
    return _interpreter_problem("the validity's per-row kernel", _measure_one_row)


def triton_marks(kernels: ModuleType | None, import_error: str, *,
                 problem_probe: Callable[[], str | None] | None = None,
                 ) -> tuple[pytest.MarkDecorator, pytest.MarkDecorator]:
    """(needs_interpreter, needs_cuda) for a kernel module (None when it did not import, with ``import_error``).
    problem_probe: for kernels the interpreter may fail to run (:func:`raster_interpreter_problem`,
    :func:`validity_rows_interpreter_problem`): interpreted, they also need it to answer None."""
    problem = None
    if problem_probe is not None and kernels is not None and kernels.interpreter_available():
        problem = problem_probe()
    needs_interpreter = pytest.mark.skipif(
        kernels is None or not kernels.interpreter_available() or problem is not None,
        reason=import_error or problem or "this triton has no interpreter (triton.runtime.interpreter)",
    )
    needs_cuda = pytest.mark.skipif(
        kernels is None or not torch.cuda.is_available(), reason=import_error or "needs a CUDA device"
    )
    return needs_interpreter, needs_cuda
