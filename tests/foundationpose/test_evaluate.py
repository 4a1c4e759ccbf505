"""python -m foundationpose.evaluate on the CPU: JSON report, overlays, held-out views, errors."""

from __future__ import annotations

import json

import cv2
import pytest

from foundationpose.evaluate.cli import main

TINY = ["--device", "cpu", "--renderer", "cpu", "--hypotheses", "2", "--register-iterations", "1",
        "--track-iterations", "1", "--no-progress"]


@pytest.mark.slow
def test_evaluate_sequence_and_views(tmp_path, capsys) -> None:
    out = tmp_path / "ev"
    assert main(["--max-frames", "2", "--views", "2", "--overlays", "1", "--out", str(out), *TINY]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert printed == saved
    assert saved["random_weights"] is True  # no --weights: random networks, the numbers are meaningless
    seq, views = saved["sequence"], saved["views"]
    assert seq["frames"] == 2 and [r["id"] for r in seq["per_frame"]] == ["000000", "000001"]
    assert seq["register"]["id"] == "000000"
    for key in ("add_m", "adds_m", "rot_deg", "trans_m"):
        assert seq[key]["max"] >= seq[key]["median"] >= 0 and views[key]["max"] >= 0
    assert set(seq["drift"]) == {"add_last_minus_first_m", "trans_last_minus_first_m", "add_slope_m_per_frame"}
    assert seq["success_threshold_m"] == pytest.approx(0.1 * saved["object"]["diameter_m"])
    assert views["frames"] == 2 and len(views["per_view"]) == 2 and 0.0 <= views["register_success_rate"] <= 1.0
    cands = views["candidates"]
    assert cands["chosen_success_rate"] == views["register_success_rate"] <= cands["oracle_success_rate"]
    assert cands["refiner_misses"] + cands["scorer_misses"] == 2 - round(2 * cands["chosen_success_rate"])
    for row in views["per_view"]:  # two hypotheses: ranks 0 or 1; the pick's ADD is never below the oracle's
        assert row["best_rank"] in (0, 1) and 0 <= row["converged"] <= 2
        assert row["oracle_add_m"] <= row["add_m"] * (1 + 1e-4) + 1e-7
        assert (row["first_success_rank"] is None) == (not row["oracle_success"])
    assert cv2.imread(str(out / "sequence" / "000001.png")).shape == (480, 640, 3)
    assert (out / "views" / "view_000.png").is_file() and not (out / "views" / "view_001.png").exists()


@pytest.mark.slow
def test_the_report_says_what_it_measured_and_can_be_recomputed(tmp_path, capsys) -> None:
    import numpy as np

    from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence
    from foundationpose.demo.metrics import model_points, pose_errors
    from foundationpose.mesh import load_object

    out = tmp_path / "ev"
    assert main(["--max-frames", "2", "--views", "1", "--overlays", "0", "--out", str(out), *TINY]) == 0
    saved = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert saved["model_points"] == {"kind": "uniform surface samples (area-weighted)", "count": 2000, "seed": 0}
    assert saved["sequence"]["depth"]["kind"] == "sensor" and saved["sequence"]["depth"]["seed"] == 0
    assert saved["views"]["seeds"]["host"] >= 2**63
    obj = load_object(RecordedSequence(BUNDLED_SEQUENCE_DIR).mesh_path)
    points = model_points(obj.mesh, count=2000, seed=0).points
    for row in saved["sequence"]["per_frame"] + saved["views"]["per_view"]:
        again = pose_errors(np.array(row["cam_from_mesh"]), np.array(row["gt_cam_from_mesh"]), points)
        assert again.add_m == pytest.approx(row["add_m"], rel=1e-9) and again.adds_m == pytest.approx(row["adds_m"])
    first, second = saved["sequence"]["per_frame"]
    assert first["state"] in ("tracking", "lost") and 0.0 <= second["confidence"] <= 1.0
    assert sum(saved["sequence"]["states"].values()) == 2
    capsys.readouterr()
    recorded = tmp_path / "rec"
    assert main(["--max-frames", "1", "--views", "0", "--depth", "as-recorded", "--out", str(recorded), *TINY]) == 0
    assert json.loads((recorded / "eval.json").read_text(encoding="utf-8"))["sequence"]["depth"] == {"kind": "as-recorded"}


def test_held_out_views_never_share_a_seed_with_training() -> None:
    import torch

    from foundationpose.errors import InputError
    from foundationpose.evaluate.runs import MAX_EVAL_SEED, held_out_seeds
    from foundationpose.train.config import TRAIN_SEED_LIMIT, TrainConfig

    # training draws its data from generators seeded with seed and seed + 1, for seeds TrainConfig accepts
    largest_training_seed = TRAIN_SEED_LIMIT - 2
    TrainConfig(mesh="m.obj", out_dir="o", seed=largest_training_seed)
    for bad in (-1, TRAIN_SEED_LIMIT - 1, 2**63):
        with pytest.raises(ValueError, match=r"^seed must be in \[0, 2\*\*62 - 1\)"):
            TrainConfig(mesh="m.obj", out_dir="o", seed=bad)
    training_max = largest_training_seed + 1
    for seed in (0, 1, 12345, MAX_EVAL_SEED - 1):
        host, device = held_out_seeds(seed)
        assert min(host, device) > training_max and device == host + 1
        torch.Generator().manual_seed(device)  # within torch's seed range
    assert len({held_out_seeds(s)[i] for s in range(50) for i in (0, 1)}) == 100  # distinct streams per seed
    for bad in (-1, MAX_EVAL_SEED):
        with pytest.raises(InputError, match=r"^--seed: expected an integer in \[0, 2\*\*62\)"):
            held_out_seeds(bad)


def test_evaluate_reports_bad_input(tmp_path, capsys) -> None:
    assert main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), *TINY]) == 1
    assert capsys.readouterr().err.startswith("DatasetError: data: ")
    assert main(["--views", "-1", "--no-sequence", "--mesh", "x.obj", "--out", str(tmp_path / "o"), *TINY]) == 1
    assert capsys.readouterr().err.startswith("InputError: --views: ")


def test_candidate_diagnostics_separate_refiner_and_scorer_misses() -> None:
    import torch

    from foundationpose.estimator import RegisterCandidates
    from foundationpose.evaluate.runs import candidate_diagnostics, candidate_summary

    points = torch.tensor([[0.05, 0, 0], [0, 0.05, 0], [0, 0, 0.05], [-0.05, 0, 0]])
    gt = torch.eye(4)
    gt[2, 3] = 0.5
    poses = gt.repeat(4, 1, 1)
    poses[:, 0, 3] += torch.tensor([0.05, 0.002, 0.008, 0.03])  # ADD 50, 2, 8, 30 mm (diameter 0.1: 10 mm)
    scored = RegisterCandidates(cam_from_centred=poses, scores=torch.tensor([3.0, 1.0, 2.0, 0.0]), best=0, timings_ms={})
    row = candidate_diagnostics(scored, gt, points, diameter=0.1)
    assert row == {"oracle_success": True, "oracle_add_m": pytest.approx(0.002), "converged": 2, "best_rank": 2,
                   "first_success_rank": 1, "pick_within": False}
    far = RegisterCandidates(cam_from_centred=poses[[0, 3]], scores=torch.tensor([0.0, 1.0]), best=1, timings_ms={})
    miss = candidate_diagnostics(far, gt, points, diameter=0.1)
    assert not miss["oracle_success"] and miss["first_success_rank"] is None and miss["best_rank"] == 0
    summary = candidate_summary([row | {"success": False}, miss | {"success": False}, {"error": "x", "success": False}], 3)
    assert summary["oracle_success_rate"] == pytest.approx(1 / 3) and summary["chosen_success_rate"] == 0.0
    assert summary["refiner_misses"] == 1 and summary["scorer_misses"] == 1 and summary["best_rank_median"] == 1.0


def test_views_registered_again_with_fewer_iterations_report_that_pick(tiny_estimator) -> None:
    from foundationpose.demo.metrics import model_points
    from foundationpose.evaluate.runs import evaluate_views
    from foundationpose.mesh import load_object
    from foundationpose.synthetic.objects import make_suite_mesh
    from foundationpose.synthetic.scenarios import demo_intrinsics

    can = load_object(make_suite_mesh("can"), device=tiny_estimator.device)
    hw = (120, 160)
    assert tiny_estimator.config.register_iterations == 2
    report = evaluate_views(tiny_estimator, can, 2, 0, None, points=model_points(can.mesh), K=demo_intrinsics(hw),
                            hw=hw, overlays=0, fewer_iterations=(1,))
    posed = [r for r in report["per_view"] if "oracle_success" in r]
    assert posed and all(set(r["pick_within_by_iterations"]) == {"1"} for r in posed)
    rate = report["candidates"]["pick_within_rate_by_iterations"]["1"]
    assert rate == sum(r["pick_within_by_iterations"]["1"] for r in posed) / 2
    with pytest.raises(ValueError, match=r"fewer_iterations must be in \[1, 2\), got \[2\]"):
        evaluate_views(tiny_estimator, can, 1, 0, None, points=model_points(can.mesh), fewer_iterations=(2,))


def test_candidate_diagnostics_judge_the_scorers_pick_on_the_oracles_criterion() -> None:
    import torch

    from foundationpose.estimator import RegisterCandidates
    from foundationpose.evaluate.runs import candidate_diagnostics, candidate_summary

    points = torch.tensor([[0.05, 0, 0], [0, 0.05, 0], [0, 0, 0.05], [-0.05, 0, 0]])
    gt = torch.eye(4)
    gt[2, 3] = 0.5
    poses = gt.repeat(3, 1, 1)
    poses[:, 0, 3] += torch.tensor([0.05, 0.002, 0.03])  # ADD 50, 2, 30 mm: only index 1 within 0.1 d (10 mm)
    scored = RegisterCandidates(cam_from_centred=poses, scores=torch.tensor([3.0, 2.0, 1.0]), best=0, timings_ms={})
    missed = candidate_diagnostics(scored, gt, points, 0.1)
    assert missed["pick_within"] is False and missed["oracle_success"] is True and missed["first_success_rank"] == 1
    picked = candidate_diagnostics(RegisterCandidates(cam_from_centred=poses, scores=torch.tensor([1.0, 3.0, 2.0]),
                                                      best=1, timings_ms={}), gt, points, 0.1)
    assert picked["pick_within"] is True and picked["best_rank"] == 0
    summary = candidate_summary([missed | {"success": False}, picked | {"success": True},
                                 {"error": "x", "success": False}], 3)
    assert summary["pick_within_rate"] == pytest.approx(1 / 3) and summary["scorer_misses"] == 1
    assert "pick_within_rate_by_iterations" not in summary
    assert "pick_within_rate" not in candidate_summary([{"error": "x", "success": False}], 1)  # no view posed


@pytest.mark.slow
def test_two_precisions_compared_on_the_same_frames(tmp_path, capsys) -> None:
    out = tmp_path / "ev"
    assert main(["--max-frames", "1", "--views", "1", "--overlays", "0", "--out", str(out), "--precision",
                 "fp32,bf16", *TINY]) == 0
    saved = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    fp32, bf16 = saved["by_precision"]["fp32"], saved["by_precision"]["bf16"]
    comparison = saved["precision_comparison"]
    assert comparison["baseline"] == "fp32" and list(comparison["precisions"]) == ["bf16"]
    expected = 1000 * (bf16["views"]["adds_m"]["mean"] - fp32["views"]["adds_m"]["mean"])
    assert comparison["precisions"]["bf16"]["views_adds_mean_mm"] == pytest.approx(expected)
    assert fp32["precision"] == "fp32" and bf16["precision"] == "bf16"
    assert fp32["views"]["per_view"][0]["gt_cam_from_mesh"] == bf16["views"]["per_view"][0]["gt_cam_from_mesh"]
    assert (out / "fp32" / "sequence" / "000000.png").is_file() and (out / "bf16" / "sequence" / "000000.png").is_file()
    capsys.readouterr()
    assert main(["--precision", "fp32,fp32", "--views", "0", "--out", str(out), *TINY]) == 1
    assert capsys.readouterr().err.startswith("InputError: --precision: expected one of auto, fp32")
