"""Does the track step's validity see a flip? True poses against flipped ones on rendered views, on the CPU.

    python -m foundationpose.evaluate.flip_views                       # the suite's tune objects, 8 views each
    python -m foundationpose.evaluate.flip_views --objects can --views 3

For each object (:mod:`foundationpose.synthetic.objects`, or a plain cylinder for the untextured check) and each
seeded view: the object rendered at a random pose 0.45-0.6 m from the camera in front of a noisy background and a
plane 0.9 m away, with a sensor's colour and depth noise (:mod:`foundationpose.synthetic.sensor`). Then the
poses a track step could end at, judged as the step judges them (:func:`foundationpose.validity.measure_validity`
with the refiner's network inputs of that pose, :func:`~foundationpose.validity.judge_validity`), without a
refiner (the step's last iteration renders the pose it starts from, which a converged step barely moves):

* ``true``: the pose itself and two copies off by 2 degrees about a random axis and 2 mm in a random direction
  (a tracker's error);
* ``flip_x``, ``flip_y``, ``flip_z``: the pose turned 180 degrees about the centred frame's x, y and z axes (the
  suite's near-symmetry axes pass through the centre).

A flip is *depth-fit* when the depth-only verdict calls it valid (what the appearance must catch), and
*look-alike* when its clean render correlates with the true pose's clean render at least
:data:`LOOK_ALIKE_NCC` over the same cells (the texture shows no difference from that view: an equivalent pose
that must not be called invalid). Prints one JSON object: per object and pose kind the counts and the
appearance correlation's range, and per object the separation (true poses' lowest correlation against the
depth-fit, not look-alike flips' highest). Thresholds of :class:`~foundationpose.validity.ValidityConfig` are
chosen on the ``tune`` split only.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import trimesh
from torch import Tensor

from foundationpose.mesh import ObjectModel, load_object
from foundationpose.models.blocks import CROP_SIZE
from foundationpose.refine import build_refiner_inputs_per_frame
from foundationpose.render import make_renderer, render_full_frame
from foundationpose.sampling import bilateral_filter_depth, erode_depth
from foundationpose.sampling.backprojection import depth_to_xyz
from foundationpose.symmetry import rotation_about
from foundationpose.synthetic.objects import SPLITS, make_suite_mesh, select_objects
from foundationpose.synthetic.scenarios import demo_intrinsics
from foundationpose.synthetic.sensor import sensor_depth, sensor_rgb
from foundationpose.validity import (
    ValidityConfig,
    ValidityModel,
    column,
    judge_validity,
    measure_appearance,
    measure_validity,
)

__all__ = ["KINDS", "LOOK_ALIKE_NCC", "ViewJudgements", "clean_render_ncc", "judge_views", "look_alike_ncc", "main",
           "plain_cylinder", "summarise"]

HW = (240, 320)  # the demo's intrinsics at half size: the crops are what matter (160 x 160 whatever the image)
KINDS = ("true", "flip_x", "flip_y", "flip_z")
LOOK_ALIKE_NCC = 0.9  # clean renders of a flip and the true pose this alike: the texture shows no difference
_PLANE_M = 0.9
_ERROR_DEG, _ERROR_M = 2.0, 0.002
_AXES = {"flip_x": (1.0, 0.0, 0.0), "flip_y": (0.0, 1.0, 0.0), "flip_z": (0.0, 0.0, 1.0)}


def plain_cylinder() -> trimesh.Trimesh:
    """A 7 x 12 cm cylinder of one colour (no texture): symmetric, nothing orients it."""
    mesh = trimesh.creation.cylinder(radius=0.035, height=0.12, sections=48)
    mesh.visual.vertex_colors = np.tile(np.array([180, 60, 60, 255], np.uint8), (len(mesh.vertices), 1))
    return mesh


@dataclass(frozen=True, slots=True)
class ViewJudgements:
    """One view's poses. kinds: each row's kind (:data:`KINDS`); judged: (N, M + 2) float32 rows (measurements,
    confidence, valid); depth_valid: (N,) bool, the verdict without appearance; look_alike: (N,) bool."""

    kinds: tuple[str, ...]
    judged: np.ndarray
    depth_valid: np.ndarray
    look_alike: np.ndarray


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q = rng.standard_normal(4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def _observe(obj: ObjectModel, pose: np.ndarray, K: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(rgb (H, W, 3) uint8, depth (H, W) float32 metres) of the object at ``pose`` with a sensor's noise."""
    out = render_full_frame(obj.tensors, torch.as_tensor(pose)[None], K, HW, pixel_centre_exact=True)
    mask = out.mask[0].numpy().astype(bool)
    background = 110.0 + rng.standard_normal((*HW, 3)) * 25.0  # clutter: no print of its own to match
    rgb = np.where(mask[..., None], out.rgb[0].numpy() * 255.0, background)
    depth = np.where(mask, out.xyz_cam[0, ..., 2].numpy(), _PLANE_M).astype(np.float32)
    return sensor_rgb(np.clip(rgb, 0, 255).astype(np.uint8), rng), sensor_depth(depth, rng)


def _poses(gt: np.ndarray, rng: np.random.Generator) -> tuple[list[np.ndarray], list[str]]:
    poses, kinds = [gt.copy()], ["true"]
    for _ in range(2):
        off = gt.copy()
        off[:3, :3] = rotation_about(rng.standard_normal(3), math.radians(_ERROR_DEG))[:3, :3] @ gt[:3, :3]
        direction = rng.standard_normal(3)
        off[:3, 3] += _ERROR_M * direction / np.linalg.norm(direction)
        poses.append(off)
        kinds.append("true")
    for kind, axis in _AXES.items():
        flipped = gt.copy()
        flipped[:3, :3] = gt[:3, :3] @ rotation_about(axis, math.pi)[:3, :3]
        poses.append(flipped)
        kinds.append(kind)
    return [p.astype(np.float32) for p in poses], kinds


def clean_render_ncc(render_a: Tensor, render_b: Tensor, config: ValidityConfig) -> Tensor:
    """(N,) appearance correlation of two batches of clean renders (refiner render inputs, (N, S, S, 6)): row i of
    ``render_a`` judged against row i of ``render_b`` as the track step judges a render against an observation.
    At least :data:`LOOK_ALIKE_NCC`: the two poses look alike from that view (no print tells them apart)."""
    return measure_appearance(render_a, render_b, config)[:, 2]


def look_alike_ncc(obj: ObjectModel, K: np.ndarray, hw: tuple[int, int], cam_from_centred: np.ndarray,
                   truth_cam_from_centred: np.ndarray, config: ValidityConfig | None = None,
                   crop_size: int = CROP_SIZE) -> np.ndarray:
    """(N,) :func:`clean_render_ncc` of each pose's clean render against its true pose's (both (N, 4, 4), camera
    from centred mesh), each in the crop window of its own pose as the track step crops; rendered by the torch
    rasteriser on the object's device."""
    device = obj.tensors.device
    poses = torch.as_tensor(np.concatenate([cam_from_centred, truth_cam_from_centred]), dtype=torch.float32,
                            device=device)
    n = len(cam_from_centred)
    blank = torch.zeros(2 * n, *hw, 3, device=device)  # no observation: only the renders are compared
    Ks = np.repeat(np.asarray(K, dtype=np.float64)[None], 2 * n, axis=0)
    inputs = build_refiner_inputs_per_frame(poses, blank, blank, Ks, obj, make_renderer("cpu", device),
                                            crop_size=crop_size)
    ncc = clean_render_ncc(inputs.render_input[:n], inputs.render_input[n:], config or ValidityConfig())
    return ncc.float().cpu().numpy()


def judge_views(obj: ObjectModel, views: int, seed: int = 0, config: ValidityConfig | None = None,
                crop_size: int = CROP_SIZE) -> list[ViewJudgements]:
    """The judgements of ``views`` seeded views of ``obj`` (module docstring), on the CPU."""
    cfg = config or ValidityConfig()
    model = ValidityModel.from_object(obj, "cpu")
    renderer = make_renderer("cpu")
    K = demo_intrinsics(HW)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(views):
        gt = np.eye(4, dtype=np.float32)
        gt[:3, :3] = _random_rotation(rng)
        gt[:3, 3] = (rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03), rng.uniform(0.45, 0.6))
        rgb, depth = _observe(obj, gt, K, rng)
        poses, kinds = _poses(gt, rng)
        n = len(poses)
        depth_f = bilateral_filter_depth(erode_depth(torch.as_tensor(depth)[None]))
        k = torch.as_tensor(K)[None].expand(n, 3, 3).contiguous()
        xyz = depth_to_xyz(depth_f, k[:1]).expand(n, -1, -1, -1).contiguous()
        rgb_t = torch.as_tensor(rgb, dtype=torch.float32)[None].expand(n, -1, -1, -1).contiguous()
        pose_t = torch.as_tensor(np.stack(poses))
        inputs = build_refiner_inputs_per_frame(pose_t, rgb_t, xyz, k, obj, renderer, crop_size=crop_size)
        depths = depth_f.expand(n, -1, -1).contiguous()
        m = measure_validity(depths, k, pose_t, pose_t, model, cfg,
                             appearance=(inputs.render_input, inputs.transf_input))
        confidence, valid = judge_validity(m, cfg)
        _, depth_valid = judge_validity(measure_validity(depths, k, pose_t, pose_t, model, cfg), cfg)
        alike = clean_render_ncc(inputs.render_input, inputs.render_input[:1].expand(n, -1, -1, -1), cfg).numpy()
        alike = alike >= LOOK_ALIKE_NCC
        judged = torch.cat([m, confidence[:, None], valid[:, None].float()], 1).numpy()
        out.append(ViewJudgements(tuple(kinds), judged, depth_valid.numpy(), alike))
    return out


def summarise(views: list[ViewJudgements], config: ValidityConfig | None = None) -> dict[str, Any]:
    """Per kind: poses, valid, depth-valid, judged (the appearance is judged: enough cells and contrast),
    look-alike, and of the depth-valid ones those the appearance turns invalid (``appearance_rejects``: false
    alarms for true poses, catches for flips); ``separation``: the appearance correlation of the judged,
    depth-valid true poses (lowest, 1st percentile) and the highest of the judged, depth-valid flips that are no
    look-alikes (the ones to catch)."""
    cfg = config or ValidityConfig()
    ncc, cells, contrast = column("appearance_ncc"), column("appearance_cells"), column("texture_contrast")

    def judged(row: np.ndarray) -> bool:
        return bool(row[cells] >= cfg.min_appearance_cells and row[contrast] >= cfg.min_texture_contrast)

    report: dict[str, Any] = {}
    for kind in KINDS:
        rows = [(v.judged[i], bool(v.depth_valid[i]), bool(v.look_alike[i]))
                for v in views for i, k in enumerate(v.kinds) if k == kind]
        report[kind] = {
            "poses": len(rows), "valid": sum(int(r[-1] > 0.5) for r, _, _ in rows),
            "depth_valid": sum(int(d) for _, d, _ in rows), "judged": sum(int(judged(r)) for r, _, _ in rows),
            "look_alike": sum(int(a) for _, _, a in rows),
            "appearance_rejects": sum(int(d and r[-1] < 0.5) for r, d, _ in rows),
            "to_catch": sum(int(d and judged(r) and not a) for r, d, a in rows) if kind != "true" else None,
        }
    true_ncc = [float(v.judged[i][ncc]) for v in views for i, k in enumerate(v.kinds)
                if k == "true" and v.depth_valid[i] and judged(v.judged[i])]
    flips = [float(v.judged[i][ncc]) for v in views for i, k in enumerate(v.kinds)
             if k != "true" and v.depth_valid[i] and judged(v.judged[i]) and not v.look_alike[i]]
    report["separation"] = {
        "true_ncc_min": round(min(true_ncc), 3) if true_ncc else None,
        "true_ncc_p1": round(float(np.percentile(true_ncc, 1)), 3) if true_ncc else None,
        "flips_to_catch_ncc": sorted(round(f, 3) for f in flips)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foundationpose.evaluate.flip_views",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", nargs="*", default=None,
                        help="suite object names, or 'cylinder' (default: the split's objects)")
    parser.add_argument("--split", choices=(*SPLITS, "all"), default="tune", help="default: %(default)s")
    parser.add_argument("--views", type=int, default=8, help="views per object (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.views < 1:
        parser.error(f"--views must be >= 1, got {args.views}")
    names = args.objects if args.objects else [o.name for o in select_objects(None, args.split)]
    torch.set_grad_enabled(False)
    report = {"views": args.views, "seed": args.seed, "objects": {}}
    for name in names:
        obj = load_object(plain_cylinder() if name == "cylinder" else make_suite_mesh(name), name=name)
        report["objects"][name] = summarise(judge_views(obj, args.views, args.seed))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
