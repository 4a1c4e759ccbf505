"""Rigid-transform naming and the few frame conversions the package needs.

Glossary
--------
A rigid transform is named ``<dst>_from_<src>``: ``cam_from_mesh`` maps points given in the
mesh frame into the camera frame, ``p_cam = R @ p_mesh + t``. Products then read left to
right with matching inner names (``cam_from_centred @ centred_from_mesh`` -> ``cam_from_mesh``).

Frames (one word each):

=========  ==============================================================================
``mesh``    the mesh file's own frame (spec "M"); what the public API speaks.
``centred`` the mesh translated by ``-c``, ``c`` = centre of the vertices' axis-aligned
            bounding box (spec "C"); every internal pose uses it.
``cam``     OpenCV camera: x right, y down, z forward, metres.
``gl``      OpenGL camera (y up, looking down -z); renderer only.
``img``     input image pixels (integer coordinates are pixel centres).
``crop``    S x S network-crop pixels (S = 160).
=========  ==============================================================================

Upstream FoundationPose names (for readers of the reference code):

* ``ob_in_cam`` / ``pose`` (centred frame, internal)  == our ``cam_from_centred``
* the returned pose ``ob_in_cam @ tf_to_center``       == our ``cam_from_mesh``
* ``tf_to_center`` (translation ``-c``)                == our ``centred_from_mesh``
* ``tf_to_crops`` / ``tf_to_crop``                     == our ``crop_from_img``

The public API converts once, at the edge (spec §0: ``T_M = T_C · Tc``)::

    cam_from_mesh = cam_from_centred @ centred_from_mesh
    cam_from_centred = cam_from_mesh @ mesh_from_centred
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "invert_rigid",
    "centred_from_mesh",
    "mesh_from_centred",
    "cam_from_mesh_from_centred",
    "cam_from_centred_from_mesh",
]

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def invert_rigid(transform: ArrayT) -> ArrayT:
    """Invert rigid transforms without a general matrix inverse: ``(R, t) -> (R^T, -R^T t)``.

    transform: (..., 4, 4) numpy array or torch tensor (any float dtype, any device); the
    bottom row is assumed to be ``0 0 0 1`` and ``R`` orthonormal (not checked here; user
    poses are checked by ``foundationpose.validate.validate_pose``).
    Returns the same type, dtype, device and shape; ``b_from_a`` becomes ``a_from_b``.
    """
    if transform.shape[-2:] != (4, 4):
        raise ValueError(f"invert_rigid expects (..., 4, 4); got shape {tuple(transform.shape)}")
    rot = transform[..., :3, :3]
    trans = transform[..., :3, 3:4]
    if isinstance(transform, torch.Tensor):
        rot_t = rot.transpose(-1, -2)
        out = torch.zeros_like(transform)
        out[..., :3, :3] = rot_t
        out[..., :3, 3:4] = -(rot_t @ trans)
        out[..., 3, 3] = 1
        return out
    rot_t = np.swapaxes(rot, -1, -2)
    out_np = np.zeros_like(transform)
    out_np[..., :3, :3] = rot_t
    out_np[..., :3, 3:4] = -(rot_t @ trans)
    out_np[..., 3, 3] = 1
    return out_np


def centred_from_mesh(mesh_centre: np.ndarray) -> np.ndarray:
    """(4, 4) float64 translation by ``-c`` (spec ``Tc``); ``mesh_centre``: (3,) metres, mesh frame."""
    centre = np.asarray(mesh_centre, dtype=np.float64).reshape(3)
    out = np.eye(4, dtype=np.float64)
    out[:3, 3] = -centre
    return out


def mesh_from_centred(mesh_centre: np.ndarray) -> np.ndarray:
    """(4, 4) float64 translation by ``+c``; the inverse of :func:`centred_from_mesh`."""
    centre = np.asarray(mesh_centre, dtype=np.float64).reshape(3)
    out = np.eye(4, dtype=np.float64)
    out[:3, 3] = centre
    return out


def _as_like(matrix: np.ndarray, like: ArrayT) -> ArrayT:
    if isinstance(like, torch.Tensor):
        return torch.as_tensor(matrix, dtype=like.dtype, device=like.device)
    return matrix.astype(like.dtype, copy=False)


def cam_from_mesh_from_centred(cam_from_centred: ArrayT, centred_from_mesh_tf: np.ndarray) -> ArrayT:
    """Pose of the original mesh from a centred-frame pose: ``cam_from_centred @ centred_from_mesh``.

    cam_from_centred: (..., 4, 4) numpy array or tensor (upstream ``ob_in_cam``).
    centred_from_mesh_tf: (4, 4) float64 (``ObjectModel.centred_from_mesh``), cast to the pose's
    dtype/device before the product (the reference multiplies a float32 pose by ``Tc``).
    Returns (..., 4, 4), same type/dtype/device as the pose.
    """
    return cam_from_centred @ _as_like(np.asarray(centred_from_mesh_tf, dtype=np.float64), cam_from_centred)


def cam_from_centred_from_mesh(cam_from_mesh: ArrayT, mesh_from_centred_tf: np.ndarray) -> ArrayT:
    """Centred-frame pose from a mesh-frame pose: ``cam_from_mesh @ mesh_from_centred`` (API input edge).

    cam_from_mesh: (..., 4, 4) numpy array or tensor; mesh_from_centred_tf: (4, 4) float64
    (``ObjectModel.mesh_from_centred``). Returns the same type/dtype/device as the pose.
    """
    return cam_from_mesh @ _as_like(np.asarray(mesh_from_centred_tf, dtype=np.float64), cam_from_mesh)
