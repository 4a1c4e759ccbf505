"""Draw the README's overview picture: an RGB-D frame of the bundled sequence in, its object pose out.

    python tools/make_overview_figure.py [--out docs/images/overview.png] [--frame 12] [--pose FILE]
    python tools/make_overview_figure.py --pose benchmarks/records/<id>/demo.json   # the committed picture

Three panels of one frame of ``foundationpose/data/demo_sequence``: the colour image, the depth map (metres,
colour-mapped, black = no reading) and what register / track answer, drawn as the demo draws it (the object's
oriented box and axes at its pose). ``--pose FILE`` draws an estimated pose (a 4x4 cam_from_mesh text file in
metres, as the demo writes them to ``ob_in_cam/<frame>.txt``), or the frame's pose from a record's ``demo.json``
(the demo's poses, ``ob_in_cam``, which ``python tools/gpu_run.py record --part accuracy`` keeps), with its ADD error
against the annotation; without it the annotated pose is drawn. ADD is over the evaluation's model points (uniform
surface samples, :func:`foundationpose.demo.metrics.model_points`). The committed picture shows the pose the demo
estimated with trained weights in the record it names.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cv2
import numpy as np

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence, read_pose
from foundationpose.demo.metrics import add_error, model_points
from foundationpose.demo.overlay import draw_pose, draw_text
from foundationpose.mesh import load_object

ROOT = Path(__file__).resolve().parents[1]


def overview(frame_index: int, pose_file: Path | None = None) -> np.ndarray:
    """The (H, 3 W + 2 gaps, 3) uint8 RGB picture of one frame, with ``pose_file``'s pose if given, else the
    annotated one."""
    seq = RecordedSequence(BUNDLED_SEQUENCE_DIR)
    frame = seq.read(frame_index)
    obj = load_object(seq.mesh_path)
    valid = frame.depth > 0
    near, far = np.percentile(frame.depth[valid], [2, 98]) if valid.any() else (0.0, 1.0)
    scaled = np.clip((frame.depth - near) / max(far - near, 1e-6), 0.0, 1.0)
    depth = cv2.applyColorMap((255 * (1.0 - scaled)).astype(np.uint8), cv2.COLORMAP_VIRIDIS)[..., ::-1].copy()
    depth[~valid] = 0
    if pose_file is None:
        pose, note = frame.gt_pose, "the annotated pose"
    else:
        pose = read_estimated_pose(pose_file, frame_index)
        error_mm = 1000 * add_error(pose, frame.gt_pose, model_points(obj.mesh).points)
        note = f"estimated: ADD {error_mm:.1f} mm"
    posed = draw_pose(frame.rgb, pose, seq.K, obj.oriented_bounds)
    panels = []
    for image, lines in ((frame.rgb.copy(), ["RGB in"]), (depth, ["depth in (metres)"]),
                         (posed, ["6D pose out: cam_from_mesh", note])):
        draw_text(image, lines)
        panels.append(image)
    gap = np.full((frame.rgb.shape[0], 8, 3), 255, np.uint8)
    return np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1)


def read_estimated_pose(path: Path, frame_index: int) -> np.ndarray:
    """(4, 4) float64 cam_from_mesh of ``frame_index`` from a 4x4 text file or a record's ``demo.json``."""
    if path.suffix != ".json":
        return read_pose(path)
    poses = json.loads(path.read_text(encoding="utf-8")).get("ob_in_cam") or {}
    key = f"{frame_index:06d}"
    if key not in poses:
        raise SystemExit(f"{path}: no pose of frame {key} under 'ob_in_cam' (it has {len(poses)} frames)")
    pose = np.asarray(poses[key], dtype=np.float64)
    if pose.shape != (4, 4) or not np.isfinite(pose).all():
        raise SystemExit(f"{path}: the pose of frame {key} is not a finite 4x4 matrix")
    return pose


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "overview.png")
    parser.add_argument("--frame", type=int, default=12, help="frame of the bundled sequence (default 12)")
    parser.add_argument("--pose", type=Path, default=None, help="the frame's estimated pose: a 4x4 cam_from_mesh "
                        "text file (metres, e.g. a demo's ob_in_cam/000012.txt) or a record's demo.json")
    args = parser.parse_args(argv)
    picture = overview(args.frame, args.pose)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(args.out), picture[..., ::-1])
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
