"""Register + track a recorded sequence, and register held-out synthetic views, against ground truth.

Both return the report of :func:`foundationpose.demo.metrics.error_report` (ADD, ADD-S, rotation and translation
errors per frame: mean / median / max; success rate = ADD < 0.1 diameter; drift) plus the per-frame rows,
and write overlay PNGs (:func:`foundationpose.demo.overlay.draw_pose`: oriented box + axes) into ``out_dir``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from foundationpose import validate
from foundationpose.demo.dataset import RecordedSequence
from foundationpose.demo.metrics import error_report, model_points, pose_errors
from foundationpose.demo.overlay import draw_pose
from foundationpose.errors import InputError
from foundationpose.estimator import PoseEstimator, RegisterCandidates
from foundationpose.mesh import ObjectModel
from foundationpose.train.scenes import DEMO_K, SceneConfig, sample_scenes
from foundationpose.train.scorer_ranking import add_per_hypothesis

__all__ = ["HELD_OUT_SEED_OFFSET", "candidate_diagnostics", "candidate_summary", "evaluate_sequence", "evaluate_views"]

logger = logging.getLogger(__name__)

# Synthetic evaluation views draw from generators seeded with seed + this, a stream training never uses
# (training seeds its generators with seed and seed + 1, and renders other sizes and intrinsics).
HELD_OUT_SEED_OFFSET = 1_000_003


def _save_overlay(path: Path, rgb: np.ndarray, pose: np.ndarray, K: np.ndarray, obj: ObjectModel) -> None:
    overlay = draw_pose(rgb, pose, K, obj.oriented_bounds)
    cv2.imwrite(str(path), np.ascontiguousarray(overlay[:, :, ::-1]))


def _row(frame_id: str, err, diameter: float) -> dict[str, Any]:
    return {"id": frame_id, "add_m": err.add_m, "adds_m": err.adds_m, "rot_deg": err.rot_deg, "trans_m": err.trans_m,
            "success": bool(err.add_m < 0.1 * diameter)}


def candidate_diagnostics(candidates: RegisterCandidates, gt_cam_from_centred: torch.Tensor, points_centred: torch.Tensor,
                          diameter: float) -> dict[str, Any]:
    """Where one register went wrong: ``oracle_success`` (some refined hypothesis has ADD < 0.1 d: the refiner
    did its job), ``oracle_add_m`` (the smallest ADD among them), ``converged`` (how many are within 0.1 d),
    ``best_rank`` (the scorer's rank of the smallest-ADD hypothesis, 0 = picked) and ``first_success_rank``
    (the scorer's rank of its best-scored hypothesis within 0.1 d; None when there is none)."""
    add = add_per_hypothesis(candidates.cam_from_centred.float(), gt_cam_from_centred.to(points_centred.device)[None],
                             points_centred)  # (N,) metres
    order = torch.argsort(candidates.scores.float(), descending=True, stable=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(len(order), device=order.device)
    within = add < 0.1 * diameter
    ranks = rank_of[within]
    return {"oracle_success": bool(within.any()), "oracle_add_m": float(add.min()), "converged": int(within.sum()),
            "best_rank": int(rank_of[add.argmin()]), "first_success_rank": int(ranks.min()) if len(ranks) else None}


def candidate_summary(rows: list[dict[str, Any]], n_views: int) -> dict[str, Any]:
    """Refiner vs scorer failures over the views: ``oracle_success_rate`` (the best the scorer could have done)
    next to ``chosen_success_rate``, ``refiner_misses`` (no hypothesis within 0.1 d), ``scorer_misses`` (one was,
    the pick was not) and the medians of ``best_rank`` / ``first_success_rank`` / ``converged``."""
    done = [r for r in rows if "oracle_success" in r]
    firsts = [r["first_success_rank"] for r in done if r["first_success_rank"] is not None]
    return {
        "oracle_success_rate": sum(r["oracle_success"] for r in done) / n_views,
        "chosen_success_rate": sum(r["success"] for r in done) / n_views,
        "refiner_misses": sum(not r["oracle_success"] for r in done),
        "scorer_misses": sum(r["oracle_success"] and not r["success"] for r in done),
        "best_rank_median": float(np.median([r["best_rank"] for r in done])) if done else None,
        "first_success_rank_median": float(np.median(firsts)) if firsts else None,
        "converged_median": float(np.median([r["converged"] for r in done])) if done else None,
    }


def evaluate_sequence(estimator: PoseEstimator, obj: ObjectModel, seq: RecordedSequence, out_dir: Path | None,
                      progress=None) -> dict[str, Any]:
    """Register frame 0 (with its mask), track the rest from the registered pose; errors against
    ``annotated_poses``. Overlays go to ``out_dir/<id>.png`` when ``out_dir`` is given."""
    if not seq.has_ground_truth:
        raise ValueError(f"{seq.root} has no annotated_poses/: nothing to evaluate against")
    points = model_points(np.asarray(obj.mesh.vertices))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    errors, rows, state = [], [], None
    for index in range(len(seq)):
        frame = seq.read(index)
        if index == 0:
            result = estimator.register(obj, frame.rgb, frame.depth, frame.mask, seq.K)
        else:
            result = estimator.track(obj, frame.rgb, frame.depth, seq.K, state, prev_frame="centred")
        state = result.cam_from_centred
        if out_dir is not None:
            _save_overlay(out_dir / f"{frame.id}.png", frame.rgb, result.cam_from_mesh, seq.K, obj)
        if frame.gt_pose is not None:
            err = pose_errors(result.cam_from_mesh, frame.gt_pose, points)
            errors.append(err)
            rows.append(_row(frame.id, err, obj.diameter))
        if progress is not None:
            progress.update(1)
    report = error_report(errors, obj.diameter)
    report["register"] = rows[0] if rows and rows[0]["id"] == seq.ids[0] else None
    report["per_frame"] = rows
    return report


def evaluate_views(estimator: PoseEstimator, obj: ObjectModel, n_views: int, seed: int, out_dir: Path | None, *,
                   K: np.ndarray = DEMO_K, hw: tuple[int, int] = (480, 640), overlays: int = 8, chunk: int = 10,
                   scene: SceneConfig = SceneConfig(), progress=None) -> dict[str, Any]:
    """Register ``n_views`` held-out synthetic views (random pose, clutter, noise; intrinsics ``K``, size ``hw``).

    The views come from :func:`foundationpose.train.scenes.sample_scenes` with generators seeded from
    ``seed + HELD_OUT_SEED_OFFSET``. The first ``overlays`` views are written to ``out_dir/view_<i>.png``.
    """
    gen = torch.Generator().manual_seed(seed + HELD_OUT_SEED_OFFSET)
    device_gen = torch.Generator(device=estimator.device).manual_seed(seed + HELD_OUT_SEED_OFFSET + 1)
    points = model_points(np.asarray(obj.mesh.vertices))
    points_centred = torch.as_tensor(points @ obj.centred_from_mesh[:3, :3].T + obj.centred_from_mesh[:3, 3],
                                     dtype=torch.float32, device=estimator.device)  # the same points, centred frame
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    errors, rows = [], []
    for start in range(0, n_views, chunk):
        count = min(chunk, n_views - start)
        views = sample_scenes(obj, estimator.renderer, count, hw, gen, device_gen, scene, fixed_K=K)
        rgb, depth, mask = views.rgb.cpu().numpy(), views.depth.cpu().numpy(), views.mask.cpu().numpy()
        gt_centred = views.cam_from_centred.cpu().numpy().astype(np.float64)
        for i in range(count):
            index = start + i
            gt = gt_centred[i] @ obj.centred_from_mesh
            try:
                request = validate.register_request(rgb[i], depth[i], mask[i], K, limits=estimator.limits)
                candidates = estimator.register_candidates(obj, request)
            except InputError as exc:  # e.g. the view left fewer than 4 valid masked depth pixels: a failure
                rows.append({"id": f"view_{index:03d}", "error": f"{type(exc).__name__}: {exc}", "success": False})
                continue
            result = candidates.result(obj)
            err = pose_errors(result.cam_from_mesh, gt, points)
            errors.append(err)
            rows.append(_row(f"view_{index:03d}", err, obj.diameter)
                        | candidate_diagnostics(candidates, views.cam_from_centred[i], points_centred, obj.diameter))
            if out_dir is not None and index < overlays:
                _save_overlay(out_dir / f"view_{index:03d}.png", rgb[i], result.cam_from_mesh, K, obj)
            if progress is not None:
                progress.update(1)
    if not errors:
        return {"frames": n_views, "register_success_rate": 0.0, "failed_inputs": n_views, "per_view": rows}
    report = error_report(errors, obj.diameter)
    report.pop("drift")  # independent views: no sequence to drift along
    report["failed_inputs"] = n_views - len(errors)
    report["register_success_rate"] = sum(r["success"] for r in rows) / n_views  # failed inputs count as misses
    report["candidates"] = candidate_summary(rows, n_views)
    report["frames"] = n_views
    report["per_view"] = rows
    return report
