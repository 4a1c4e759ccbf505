"""Per-vertex camera-frame attributes and the reference's shading (spec §3.1, §3.4)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["vertices_in_cam", "vertex_diffuse", "shade"]

_NORMALISE_EPS = 1e-12  # torch.nn.functional.normalize default


def vertices_in_cam(verts_centred: Tensor, cam_from_centred: Tensor) -> Tensor:
    """``R v + t`` per vertex and pose (the xyz attribute).

    verts_centred: (V, 3) float32 metres. cam_from_centred: (N, 4, 4) float32.
    Returns (N, V, 3) float32 contiguous, camera frame (OpenCV), metres.
    """
    rot = cam_from_centred[:, :3, :3]  # (N, 3, 3)
    trans = cam_from_centred[:, None, :3, 3]  # (N, 1, 3)
    return (verts_centred @ rot.transpose(1, 2) + trans).contiguous()


def vertex_diffuse(normals_centred: Tensor, cam_from_centred: Tensor) -> Tensor:
    """Lambert term per vertex for a light along the camera's +z (``L = (0, 0, 1)``, spec §3.4).

    normals_centred: (V, 3) float32 vertex normals (trimesh-recomputed, spec §1.1).
    cam_from_centred: (N, 4, 4) float32.
    Returns (N, V, 1) float32 contiguous: ``clamp(-n_cam.z / |n_cam|, 0, 1)`` with ``n_cam = R n``
    (``|n|`` floored at 1e-12 like ``F.normalize``).
    """
    n_cam = normals_centred @ cam_from_centred[:, :3, :3].transpose(1, 2)  # (N, V, 3)
    norm = n_cam.norm(dim=-1).clamp_min(_NORMALISE_EPS)
    return (-(n_cam[..., 2] / norm)).clamp(0.0, 1.0)[..., None].contiguous()


def shade(albedo: Tensor, diffuse: Tensor, ambient_weight: float = 0.8, diffuse_weight: float = 0.5) -> Tensor:
    """``clamp(albedo * 0.8 + diffuse * albedo * 0.5, 0, 1)`` (before the coverage mask).

    albedo: (..., 3) float32 in [0, 1]. diffuse: (..., 1) float32 interpolated Lambert term.
    Returns (..., 3) float32.
    """
    return (albedo * ambient_weight + diffuse * albedo * diffuse_weight).clamp(0.0, 1.0)
