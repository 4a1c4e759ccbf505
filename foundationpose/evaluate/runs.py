"""Register + track a recorded sequence, and register held-out synthetic views, against ground truth.

Both return the report of :func:`foundationpose.demo.metrics.error_report` (ADD, ADD-S, ADD under the declared
symmetries, rotation and translation errors: mean / median / max; success rate = ADD < 0.1 diameter; drift) plus
one row per frame holding the estimated pose (``cam_from_mesh``) beside the ground truth and its errors, so that
anyone can recompute them. Errors are measured on ``points``, uniform surface samples (the report states how
many). The sequence run also reports each frame's validity and session state (:mod:`foundationpose.validity`,
:mod:`foundationpose.session_state`). Overlay PNGs (oriented box + axes, state and confidence) go to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from foundationpose import validate
from foundationpose.demo.dataset import RecordedSequence
from foundationpose.demo.metrics import error_report, pose_errors
from foundationpose.demo.overlay import draw_pose
from foundationpose.errors import InputError
from foundationpose.estimator import PoseEstimator, RegisterCandidates, Tracker
from foundationpose.mesh import ObjectModel
from foundationpose.session_state import State
from foundationpose.surface import SurfaceSamples
from foundationpose.synthetic.sensor import SensorDepthConfig, sensor_depth
from foundationpose.train.config import TRAIN_SEED_LIMIT
from foundationpose.train.scenes import DEMO_K, SceneConfig, sample_scenes
from foundationpose.train.scorer_ranking import add_per_hypothesis
from foundationpose.validity import ValidityConfig

__all__ = ["HELD_OUT_SEED_BASE", "candidate_diagnostics", "candidate_summary", "evaluate_sequence", "evaluate_views",
           "held_out_seeds"]

logger = logging.getLogger(__name__)

# Held-out views draw from torch generators seeded at or above 2**63; training seeds its generators with seed and
# seed + 1 below TRAIN_SEED_LIMIT = 2**62 (foundationpose.train.config checks it), so no held-out stream can be a
# training stream, whatever --seed either run is given.
HELD_OUT_SEED_BASE = 2**63
MAX_EVAL_SEED = 2**62  # 2 seed + 1 + 2**63 stays below 2**64, torch's largest seed
assert TRAIN_SEED_LIMIT <= HELD_OUT_SEED_BASE


def held_out_seeds(seed: int) -> tuple[int, int]:
    """(host generator seed, device generator seed) of the held-out views for ``seed`` in [0, 2**62)."""
    if not 0 <= seed < MAX_EVAL_SEED:
        raise InputError("--seed", "an integer in [0, 2**62)", str(seed))
    return HELD_OUT_SEED_BASE + 2 * seed, HELD_OUT_SEED_BASE + 2 * seed + 1


def _save_overlay(path: Path, rgb: np.ndarray, pose: np.ndarray, K: np.ndarray, obj: ObjectModel,
                  status: dict[str, Any] | None = None) -> None:
    overlay = draw_pose(rgb, pose, K, obj.oriented_bounds, status=status)
    cv2.imwrite(str(path), np.ascontiguousarray(overlay[:, :, ::-1]))


def _row(frame_id: str, err, diameter: float, est: np.ndarray, gt: np.ndarray) -> dict[str, Any]:
    """One frame's errors beside the estimated and the ground-truth cam_from_mesh (4 x 4 nested lists, metres)."""
    return {"id": frame_id, "add_m": err.add_m, "adds_m": err.adds_m, "add_sym_m": err.add_sym_m,
            "rot_deg": err.rot_deg, "trans_m": err.trans_m, "success": bool(err.add_sym_m < 0.1 * diameter),
            "cam_from_mesh": np.asarray(est, np.float64).tolist(), "gt_cam_from_mesh": np.asarray(gt, np.float64).tolist()}


def candidate_diagnostics(candidates: RegisterCandidates, gt_cam_from_centred: torch.Tensor, points_centred: torch.Tensor,
                          diameter: float) -> dict[str, Any]:
    """Where one register went wrong: ``oracle_success`` (some refined hypothesis has ADD < 0.1 d: the refiner
    did its job), ``oracle_add_m`` (the smallest ADD among them), ``converged`` (how many are within 0.1 d),
    ``best_rank`` (the scorer's rank of the smallest-ADD hypothesis, 0 = picked) and ``first_success_rank``
    (the scorer's rank of its best-scored hypothesis within 0.1 d; None when there is none) and ``pick_within``
    (the scorer's pick has plain ADD < 0.1 d, the oracle's criterion)."""
    add = add_per_hypothesis(candidates.cam_from_centred.float(), gt_cam_from_centred.to(points_centred.device)[None],
                             points_centred)  # (N,) metres
    order = torch.argsort(candidates.scores.float(), descending=True, stable=True)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(len(order), device=order.device)
    within = add < 0.1 * diameter
    ranks = rank_of[within]
    row = {"oracle_success": bool(within.any()), "oracle_add_m": float(add.min()), "converged": int(within.sum()),
           "best_rank": int(rank_of[add.argmin()]), "first_success_rank": int(ranks.min()) if len(ranks) else None,
           "pick_within": bool(within[candidates.best])}
    return row


def candidate_summary(rows: list[dict[str, Any]], n_views: int) -> dict[str, Any]:
    """Refiner vs scorer failures over the views: ``oracle_success_rate`` (the best the scorer could have done)
    next to ``chosen_success_rate``, ``refiner_misses`` (no hypothesis within 0.1 d), ``scorer_misses`` (one was,
    the pick was not), the medians of ``best_rank`` / ``first_success_rank`` / ``converged``, ``pick_within_rate``
    (the scorer's pick on the oracle's criterion) and, when the views were registered again with fewer refine
    iterations, ``pick_within_rate_by_iterations``."""
    done = [r for r in rows if "oracle_success" in r]
    firsts = [r["first_success_rank"] for r in done if r["first_success_rank"] is not None]
    what_if = {}
    if done and all("pick_within" in r for r in done):
        what_if["pick_within_rate"] = sum(r["pick_within"] for r in done) / n_views
    if done and all("pick_within_by_iterations" in r for r in done):
        what_if["pick_within_rate_by_iterations"] = {
            key: sum(r["pick_within_by_iterations"][key] for r in done) / n_views
            for key in done[0]["pick_within_by_iterations"]}
    return what_if | {
        "oracle_success_rate": sum(r["oracle_success"] for r in done) / n_views,
        "chosen_success_rate": sum(r["success"] for r in done) / n_views,
        "refiner_misses": sum(not r["oracle_success"] for r in done),
        "scorer_misses": sum(r["oracle_success"] and not r["success"] for r in done),
        "best_rank_median": float(np.median([r["best_rank"] for r in done])) if done else None,
        "first_success_rank_median": float(np.median(firsts)) if firsts else None,
        "converged_median": float(np.median([r["converged"] for r in done])) if done else None,
    }


def evaluate_sequence(estimator: PoseEstimator, obj: ObjectModel, seq: RecordedSequence, out_dir: Path | None, *,
                      points: SurfaceSamples, depth: SensorDepthConfig | None = None, seed: int = 0,
                      validity: ValidityConfig | None = None,
                      progress=None) -> dict[str, Any]:
    """Register frame 0 (with its mask), track the rest from the last estimate; errors against
    ``annotated_poses`` on ``points`` (mesh frame).

    depth: the sensor model applied to the recorded depth (seeded with ``seed``), None = the depth as recorded.
    The object's declared symmetries (``obj.symmetry``) shape the register grid, ADD-S and the canonical poses.
    Every frame's validity and session state are reported; overlays go to ``out_dir/<id>.png`` when given.
    """
    if not seq.has_ground_truth:
        raise ValueError(f"{seq.root} has no annotated_poses/: nothing to evaluate against")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    if validity is not None:
        obj = dataclasses.replace(obj, validity=validity)
    symmetry = obj.symmetry
    tracker = Tracker(estimator, obj, recovery=None)  # the sequence: track from the last estimate
    rng = np.random.default_rng(seed)
    errors, rows = [], []
    for index in range(len(seq)):
        frame = seq.read(index)
        observed = frame.depth if depth is None else sensor_depth(frame.depth, rng, depth)
        if index == 0:
            result = tracker.register(frame.rgb, observed, frame.mask, seq.K)
        else:
            result = tracker.track(frame.rgb, observed, seq.K)
        report = result.session
        cam_from_mesh = np.asarray(result.cam_from_mesh, dtype=np.float64)
        status = {"state": report.state.value, "confidence": report.confidence, "pose_valid": report.pose_valid}
        if out_dir is not None:
            _save_overlay(out_dir / f"{frame.id}.png", frame.rgb, cam_from_mesh, seq.K, obj, status)
        if frame.gt_pose is not None:
            err = pose_errors(cam_from_mesh, frame.gt_pose, points.points,
                              None if symmetry is None else symmetry.tfs_mesh)
            errors.append(err)
            rows.append(_row(frame.id, err, obj.diameter, cam_from_mesh, frame.gt_pose) | status)
        if progress is not None:
            progress.update(1)
    report = error_report(errors, obj.diameter)
    report["register"] = rows[0] if rows and rows[0]["id"] == seq.ids[0] else None
    report["states"] = {s.value: sum(r["state"] == s.value for r in rows) for s in State}
    report["pose_valid_frames"] = sum(r["pose_valid"] for r in rows)
    report["per_frame"] = rows
    return report


def evaluate_views(estimator: PoseEstimator, obj: ObjectModel, n_views: int, seed: int, out_dir: Path | None, *,
                   points: SurfaceSamples, K: np.ndarray = DEMO_K, hw: tuple[int, int] = (480, 640),
                   overlays: int = 8, chunk: int = 10, scene: SceneConfig | None = None,
                   fewer_iterations: Sequence[int] = (), progress=None) -> dict[str, Any]:
    """Register ``n_views`` held-out synthetic views (random pose, clutter, sensor-like depth; intrinsics ``K``,
    size ``hw``).

    The views come from :func:`foundationpose.train.scenes.sample_scenes` with generators seeded by
    :func:`held_out_seeds` (never a training seed). The first ``overlays`` views go to ``out_dir/view_<i>.png``.
    fewer_iterations: refine-iteration counts below the estimator's at which each view is registered again, the
    scorer's pick judged on the oracle's criterion (``pick_within_by_iterations`` per view,
    ``candidates.pick_within_rate_by_iterations``): what fewer iterations would cost in accuracy.
    """
    configured = estimator.config.register_iterations
    if any(not 1 <= k < configured for k in fewer_iterations):
        raise ValueError(f"fewer_iterations must be in [1, {configured}), got {list(fewer_iterations)}")
    host_seed, device_seed = held_out_seeds(seed)
    gen = torch.Generator().manual_seed(host_seed)
    device_gen = torch.Generator(device=estimator.device).manual_seed(device_seed)
    points_centred = torch.as_tensor(points.points @ obj.centred_from_mesh[:3, :3].T + obj.centred_from_mesh[:3, 3],
                                     dtype=torch.float32, device=estimator.device)  # the same points, centred frame
    symmetry = obj.symmetry
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    errors, rows = [], []
    for start in range(0, n_views, chunk):
        count = min(chunk, n_views - start)
        views = sample_scenes(obj, estimator.renderer, count, hw, gen, device_gen, scene or SceneConfig(), fixed_K=K)
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
            err = pose_errors(result.cam_from_mesh, gt, points.points, None if symmetry is None else symmetry.tfs_mesh)
            errors.append(err)
            rows.append(_row(f"view_{index:03d}", err, obj.diameter, result.cam_from_mesh, gt)
                        | candidate_diagnostics(candidates, views.cam_from_centred[i], points_centred, obj.diameter))
            if fewer_iterations:
                again = {k: estimator.register_candidates(obj, dataclasses.replace(request, iterations=k))
                         for k in fewer_iterations}
                rows[-1]["pick_within_by_iterations"] = {
                    str(k): candidate_diagnostics(c, views.cam_from_centred[i], points_centred, obj.diameter)["pick_within"]
                    for k, c in again.items()}
            if out_dir is not None and index < overlays:
                _save_overlay(out_dir / f"view_{index:03d}.png", rgb[i], result.cam_from_mesh, K, obj)
            if progress is not None:
                progress.update(1)
    if not errors:
        return {"frames": n_views, "register_success_rate": 0.0, "failed_inputs": n_views,
                "candidates": candidate_summary(rows, n_views), "per_view": rows}
    report = error_report(errors, obj.diameter)
    report.pop("drift")  # independent views: no sequence to drift along
    report["failed_inputs"] = n_views - len(errors)
    report["register_success_rate"] = sum(r["success"] for r in rows) / n_views  # failed inputs count as misses
    report["candidates"] = candidate_summary(rows, n_views)
    report["frames"] = n_views
    report["seeds"] = {"host": host_seed, "device": device_seed}
    report["per_view"] = rows
    return report
