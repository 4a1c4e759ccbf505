"""Shared synthetic scene and a tiny-config estimator (random weights).

``FP_TEST_DEVICE=cuda`` runs the estimator and service tests that use these fixtures on the GPU
(scenes are still generated on the CPU): ``FP_TEST_DEVICE=cuda pytest tests/foundationpose/test_service*.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from foundationpose.mesh import ObjectModel, load_object
from foundationpose.synthetic.meshes import make_procedural_mesh


@dataclass(frozen=True)
class Scene:
    obj: ObjectModel
    rgb: np.ndarray  # (H, W, 3) uint8
    depth: np.ndarray  # (H, W) float32 metres
    mask: np.ndarray  # (H, W) bool
    K: np.ndarray  # (3, 3) float64
    cam_from_centred: np.ndarray  # (4, 4) float32, ground truth
    cam_from_mesh: np.ndarray  # (4, 4) float64, ground truth


def rotation_xyz(rx: float, ry: float, rz: float) -> np.ndarray:
    cx, sx, cy, sy, cz, sz = np.cos(rx), np.sin(rx), np.cos(ry), np.sin(ry), np.cos(rz), np.sin(rz)
    rot_x = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    rot_y = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    rot_z = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return rot_z @ rot_y @ rot_x


def pose_xyz(rx: float, ry: float, rz: float, t: tuple[float, float, float]) -> np.ndarray:
    """(4, 4) float32: :func:`rotation_xyz` (radians) and the translation ``t`` (metres)."""
    pose = np.eye(4, dtype=np.float32)
    pose[:3, :3] = rotation_xyz(rx, ry, rz)
    pose[:3, 3] = t
    return pose


def render_scene(obj: ObjectModel, cam_from_centred: np.ndarray, K: np.ndarray, hw: tuple[int, int]) -> Scene:
    """Render ``obj`` with the OpenCV pixel-centre convention (ground truth, spec §3.3) on the CPU."""
    from foundationpose.render import render_full_frame

    pose = torch.as_tensor(cam_from_centred, dtype=torch.float32, device=obj.tensors.verts.device)[None]
    out = render_full_frame(obj.tensors, pose, K, hw, pixel_centre_exact=True)
    rgb = (out.rgb[0].cpu().numpy() * 255.0).round().astype(np.uint8)
    depth = out.xyz_cam[0, ..., 2].cpu().numpy().astype(np.float32)
    mask = out.mask[0].cpu().numpy().astype(bool)
    cam_from_mesh = cam_from_centred.astype(np.float64) @ obj.centred_from_mesh
    return Scene(obj, rgb, depth, mask, K, cam_from_centred.astype(np.float32), cam_from_mesh)


TEST_DEVICE = os.environ.get("FP_TEST_DEVICE", "cpu")


def assert_same_pose(got: np.ndarray, want: np.ndarray) -> None:
    """Pipelined vs reference poses: bit-identical on CPU. On CUDA the fp16 refiner's kernels depend on the
    batch size (a batched track runs at 4 or 8 rows, the reference at 1), so the poses agree to fp16
    tolerance instead: max abs difference 1.2e-3 measured on the H200 (2 iterations, random weights)."""
    if TEST_DEVICE == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2)


def on_test_device(obj: ObjectModel) -> ObjectModel:
    """``obj`` with its render tensors on the device the estimator fixtures run on."""
    if TEST_DEVICE == "cpu":
        return obj
    return dataclasses.replace(obj, tensors=obj.tensors.to(TEST_DEVICE))


@pytest.fixture(scope="session")
def textured_object() -> ObjectModel:
    return load_object(make_procedural_mesh("textured_asym"))


@pytest.fixture(scope="session")
def scene(textured_object: ObjectModel) -> Scene:
    K = np.array([[150.0, 0.0, 79.5], [0.0, 150.0, 59.5], [0.0, 0.0, 1.0]])
    pose = np.eye(4, dtype=np.float32)
    pose[:3, :3] = rotation_xyz(0.6, -0.4, 0.3)
    pose[:3, 3] = (0.01, -0.005, 0.5)
    scene = render_scene(textured_object, pose, K, (120, 160))
    return dataclasses.replace(scene, obj=on_test_device(scene.obj))


@pytest.fixture(scope="session")
def tiny_estimator():
    from foundationpose.estimator import EstimatorConfig, PoseEstimator

    config = EstimatorConfig(num_hypotheses=6, register_iterations=2, track_iterations=2)
    renderer = "cpu" if TEST_DEVICE == "cpu" else "auto"
    return PoseEstimator.create(device=TEST_DEVICE, renderer=renderer, config=config)


@pytest.fixture(scope="session")
def cuda_triton_estimator():
    """The captured runners' CUDA tests: the Triton renderer, 2 track iterations. Skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from foundationpose.estimator import EstimatorConfig, PoseEstimator

    config = EstimatorConfig(num_hypotheses=6, register_iterations=2, track_iterations=2)
    return PoseEstimator.create(device="cuda", renderer="triton", config=config)
