"""Generate the bundled synthetic demo sequence in the official demo layout (rgb/ depth/ masks/ cam_K.txt mesh/).

The layout is the one of spec §7.1.

    python tools/make_demo_sequence.py --out foundationpose/data/demo_sequence --frames 40
    python tools/make_demo_sequence.py --out /tmp/seq_tee --shape tee   # the same trajectory, a second object

What it writes (deterministic: no random numbers at all; the same files on every run):

* ``mesh/textured_simple.obj`` (+ ``.mtl``, ``texture_map.png``): the asymmetric, textured L-shaped block of
  ``foundationpose.synthetic.meshes.make_procedural_mesh("textured_asym")`` (12 x 8 x 5 cm, metres; its origin
  is deliberately off the bounding-box centre).
* ``cam_K.txt``: the official demo intrinsics at 640 x 480 (non-square pixels, spec §7.1), so the demo
  exercises ``fx != fy`` like the reference data.
* ``rgb/<id>.png``, ``depth/<id>.png`` (uint16 mm), ``masks/<id>.png`` (0/255) and
  ``annotated_poses/<id>.txt`` (ground-truth cam_from_mesh, ``%.18e``) for every frame; ids are
  zero-padded frame numbers (``000000``, ...).
* ``info.json``: how the sequence was made (read by nobody; for people).

The object is rendered full-frame with the project's CPU rasteriser in the pixel-centre-exact OpenCV
convention (spec §3.3, last paragraph), so the ground truth is exact to the pixel. Behind it is a textured
plane about 1 m away, tilted, so depth and colour are not empty outside the object. Depth and colour are
noise-free (the renders are exact; noise would also inflate the PNGs).

The trajectory is smooth: the object centre moves within about +-6 cm sideways and 0.48-0.58 m in depth
while it turns up to about 70 degrees about the camera's y axis and 40 degrees about its view axis
(at most about 4 degrees and 1 cm per frame at 40 frames).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO))

from foundationpose.mesh import load_object  # noqa: E402
from foundationpose.render import make_renderer  # noqa: E402
from foundationpose.synthetic.meshes import make_procedural_mesh  # noqa: E402

DEMO_K = np.array(  # official demo intrinsics at 640 x 480 (spec §7.1)
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)
IMAGE_HW = (480, 640)
PLANE_DISTANCE_M = 1.0  # background plane depth along the optical axis
PLANE_TILT_DEG = 20.0  # rotation of the plane about the camera x axis (top further away)
CHECKER_M = 0.08  # background checker square side
PNG_COMPRESSION = 9
OWN_FILES = ("rgb/*.png", "depth/*.png", "masks/*.png", "annotated_poses/*.txt", "mesh/textured_simple.obj",
             "mesh/textured_simple.mtl", "mesh/texture_map.png", "cam_K.txt", "info.json")


def _rot(axis: str, angle_rad: float) -> np.ndarray:
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    if axis == "x":
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]], dtype=np.float64)
    if axis == "y":
        return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float64)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]], dtype=np.float64)


def trajectory_cam_from_centred(frames: int) -> np.ndarray:
    """(frames, 4, 4) float64 smooth poses of the centred object (its bounding-box centre at the translation)."""
    # Base view: tilt the block so its top, a long side and an end face the camera.
    base = _rot("x", math.radians(-125.0)) @ _rot("z", math.radians(25.0))
    poses = np.zeros((frames, 4, 4), dtype=np.float64)
    for i in range(frames):
        s = i / max(frames - 1, 1)  # 0 .. 1
        phase = 2.0 * math.pi * s
        yaw = math.radians(35.0) * math.sin(phase)  # about camera y
        pitch = math.radians(12.0) * math.sin(2.0 * phase)  # about camera x
        roll = math.radians(40.0) * (0.5 - 0.5 * math.cos(phase))  # about the view axis, out and back
        poses[i, :3, :3] = _rot("z", roll) @ _rot("y", yaw) @ _rot("x", pitch) @ base
        poses[i, :3, 3] = [0.06 * math.sin(phase), 0.035 * math.sin(2.0 * phase + 0.6),
                           0.53 + 0.05 * math.sin(phase + 1.2)]
        poses[i, 3, 3] = 1.0
    return poses


def background(K: np.ndarray, hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) uint8 RGB and (H, W) float64 depth (metres) of a tilted, textured plane.

    Each pixel centre's ray (integer pixel = centre) is intersected with the plane; the plane's own 2-D
    coordinates drive a checker with a soft colour gradient and a few stripes, lit by a gentle falloff.
    """
    h, w = hw
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    rays = np.stack([(u - K[0, 2] - K[0, 1] * (v - K[1, 2]) / K[1, 1]) / K[0, 0], (v - K[1, 2]) / K[1, 1],
                     np.ones_like(u)], axis=-1)  # (H, W, 3), z = 1
    tilt = math.radians(PLANE_TILT_DEG)
    normal = np.array([0.0, math.sin(tilt), math.cos(tilt)])  # plane: normal . X = d
    d = PLANE_DISTANCE_M * normal[2]
    z = d / (rays @ normal)  # (H, W) metres
    points = rays * z[..., None]
    axis_a = np.array([1.0, 0.0, 0.0])
    axis_b = np.cross(normal, axis_a)
    a, b = points @ axis_a, points @ axis_b  # plane coordinates, metres
    checker = ((np.floor(a / CHECKER_M) + np.floor(b / CHECKER_M)) % 2).astype(np.float64)
    base = np.stack([0.55 + 0.25 * np.tanh(a * 2.0), 0.50 + 0.15 * np.tanh(b * 3.0), 0.45 - 0.2 * np.tanh(a - b)],
                    axis=-1)
    stripes = (np.abs(((a + 0.5 * b) / 0.35) % 1.0 - 0.5) < 0.04).astype(np.float64)
    light = 1.0 - 0.25 * np.clip(np.hypot(a, b) / 0.8, 0.0, 1.0)
    colour = base * (0.75 + 0.25 * checker)[..., None] * light[..., None]
    colour = colour * (1.0 - 0.5 * stripes[..., None])
    rgb = np.clip(np.round(colour * 255.0), 0, 255).astype(np.uint8)
    return rgb, z


def _clear_own_files(out: Path) -> None:
    for pattern in OWN_FILES:
        for path in out.glob(pattern):
            if path.is_file():
                path.unlink()


def _write_mesh(mesh_dir: Path, shape: str = "L") -> Path:
    from trimesh.exchange.obj import export_obj

    mesh = make_procedural_mesh("textured_asym", shape=shape)
    text, files = export_obj(mesh, include_normals=False, include_texture=True, return_texture=True,
                             mtl_name="textured_simple.mtl")
    mesh_dir.mkdir(parents=True, exist_ok=True)
    texture_names = [name for name in files if name.endswith(".png")]
    assert len(texture_names) == 1, files.keys()
    mtl = files["textured_simple.mtl"].decode("utf-8").replace(texture_names[0], "texture_map.png")
    (mesh_dir / "textured_simple.mtl").write_text(mtl, encoding="utf-8")
    (mesh_dir / "texture_map.png").write_bytes(files[texture_names[0]])
    obj_path = mesh_dir / "textured_simple.obj"
    obj_path.write_text(text, encoding="utf-8")
    return obj_path


def _write_matrix(path: Path, matrix: np.ndarray) -> None:
    np.savetxt(path, matrix, fmt="%.18e", delimiter=" ")


def generate(out: Path, frames: int, shape: str = "L", device: str = "cpu") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    _clear_own_files(out)
    for sub in ("rgb", "depth", "masks", "annotated_poses"):
        (out / sub).mkdir(exist_ok=True)
    obj_path = _write_mesh(out / "mesh", shape)
    obj = load_object(obj_path, device=device)  # render exactly what readers of the files will load
    renderer = make_renderer("cpu", device)
    _write_matrix(out / "cam_K.txt", DEMO_K)
    bg_rgb, bg_depth_m = background(DEMO_K, IMAGE_HW)
    cam_from_centred = trajectory_cam_from_centred(frames)
    for i in range(frames):
        frame_id = f"{i:06d}"
        render = renderer.render_full_frame(
            obj.tensors, torch.as_tensor(cam_from_centred[i : i + 1], dtype=torch.float32, device=device), DEMO_K, IMAGE_HW,
            pixel_centre_exact=True,
        )
        mask = render.mask[0].cpu().numpy()  # (H, W) bool
        obj_rgb = np.clip(np.round(render.rgb[0].cpu().numpy().astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
        obj_depth_m = render.xyz_cam[0, :, :, 2].cpu().numpy().astype(np.float64)
        if not mask.any():
            raise RuntimeError(f"frame {frame_id}: the object is not visible; check the trajectory")
        rgb = np.where(mask[..., None], obj_rgb, bg_rgb)
        depth_mm = np.round(np.where(mask, obj_depth_m, bg_depth_m) * 1000.0).astype(np.uint16)
        cv2.imwrite(str(out / "rgb" / f"{frame_id}.png"), rgb[:, :, ::-1], [cv2.IMWRITE_PNG_COMPRESSION, PNG_COMPRESSION])
        cv2.imwrite(str(out / "depth" / f"{frame_id}.png"), depth_mm, [cv2.IMWRITE_PNG_COMPRESSION, PNG_COMPRESSION])
        cv2.imwrite(str(out / "masks" / f"{frame_id}.png"), mask.astype(np.uint8) * 255,
                    [cv2.IMWRITE_PNG_COMPRESSION, PNG_COMPRESSION])
        # Ground truth in the mesh file's frame: the float32 pose that was rendered, then centred -> mesh.
        rendered = cam_from_centred[i].astype(np.float32).astype(np.float64)
        _write_matrix(out / "annotated_poses" / f"{frame_id}.txt", rendered @ obj.centred_from_mesh)
    info = {
        "generator": "tools/make_demo_sequence.py",
        "frames": frames,
        "image_hw": list(IMAGE_HW),
        "intrinsics": "official FoundationPose demo intrinsics (non-square pixels), cam_K.txt",
        "object": "foundationpose.synthetic.meshes.make_procedural_mesh('textured_asym'"
                  + ("" if shape == "L" else f", shape={shape!r}") + "), metres",
        "render": "foundationpose CPU rasteriser, full frame, pixel_centre_exact=True (OpenCV pixel centres)",
        "depth": f"uint16 millimetres, noise-free; background plane ~{PLANE_DISTANCE_M:.1f} m tilted "
                 f"{PLANE_TILT_DEG:.0f} deg",
        "ground_truth": "annotated_poses/<id>.txt = cam_from_mesh (4x4, metres)",
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "foundationpose" / "data" / "demo_sequence",
                        help="output folder (default: foundationpose/data/demo_sequence); only files this script "
                             "writes are replaced")
    parser.add_argument("--frames", type=int, default=40, help="number of frames, >= 2 (default: 40)")
    parser.add_argument("--shape", choices=("L", "tee"), default="L",
                        help="procedural object: L (the bundled sequence) or tee (a second shape; default: L)")
    parser.add_argument("--device", default="cpu", help="torch device of the (CPU-rasteriser) renders (default: cpu)")
    args = parser.parse_args(argv)
    if args.frames < 2:
        parser.error("--frames must be >= 2")
    generate(args.out, args.frames, args.shape, args.device)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.frames} frames to {args.out} ({total / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
