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

Point sets carry their frame as a suffix: ``verts_centred`` (V, 3), ``xyz_cam`` (H, W, 3) for the
back-projected depth (``PreparedFrame.xyz_cam``) and the rendered surface (``RenderOutput.xyz_cam``),
``uv_img`` (M, 2).

Upstream FoundationPose names (for readers of the reference code):

* ``ob_in_cam`` / ``pose`` (centred frame, internal)  == our ``cam_from_centred``
* the returned pose ``ob_in_cam @ tf_to_center``       == our ``cam_from_mesh``
* ``tf_to_center`` (translation ``-c``)                == our ``centred_from_mesh``
* ``tf_to_crops`` / ``tf_to_crop``                     == our ``crop_from_img``

The public API converts once, at the edge (spec §0: ``T_M = T_C · Tc``), with :func:`to_mesh_frame`
and :func:`to_centred_frame` (the only conversion pair)::

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
    "to_centred_frame",
    "to_mesh_frame",
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


def to_mesh_frame(cam_from_centred: np.ndarray, centred_from_mesh_tf: np.ndarray) -> np.ndarray:
    """The public pose of a centred-frame pose (spec §0 ``T_M = T_C · Tc``), at the API's output edge.

    cam_from_centred: (4, 4) (upstream ``ob_in_cam``; float32 tracking state).
    centred_from_mesh_tf: (4, 4) float64 (``ObjectModel.centred_from_mesh``).
    Returns ``cam_from_mesh = cam_from_centred @ centred_from_mesh``, (4, 4) float64 (product in float64).
    """
    return np.asarray(cam_from_centred, dtype=np.float64) @ centred_from_mesh_tf


def to_centred_frame(cam_from_mesh: np.ndarray, mesh_from_centred_tf: np.ndarray) -> np.ndarray:
    """The internal pose of a public one, at the API's input edge (the inverse of :func:`to_mesh_frame`).

    cam_from_mesh: (4, 4); mesh_from_centred_tf: (4, 4) float64 (``ObjectModel.mesh_from_centred``).
    Returns ``cam_from_centred = cam_from_mesh @ mesh_from_centred``, (4, 4) float32 (product in float64,
    then rounded: the reference keeps its poses in float32).
    """
    return (np.asarray(cam_from_mesh, dtype=np.float64) @ mesh_from_centred_tf).astype(np.float32)
