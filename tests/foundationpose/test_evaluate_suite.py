"""The object suite's evaluation: flips, register / track / scenario figures from rows, pooling per split, the
weights cache's key and reuse, the command's refusals, and (slow) the command end to end on tiny settings."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from foundationpose.evaluate.cli import main
from foundationpose.evaluate.flip_views import LOOK_ALIKE_NCC, look_alike_ncc
from foundationpose.evaluate.runs import candidate_summary
from foundationpose.evaluate.suite import (
    SuiteEvaluation,
    SuiteTraining,
    is_flip,
    is_success,
    register_figures,
    scenario_figures,
    summarise,
    track_figures,
    train_objects,
    trained_weights,
    valid_flip_causes,
)
from foundationpose.mesh import ObjectModel, load_object
from foundationpose.symmetry import rotation_about
from foundationpose.synthetic.objects import SUITE, make_suite_mesh, write_objects
from foundationpose.synthetic.scenarios import demo_intrinsics
from foundationpose.train.loop import SUMMARY_FILE
from foundationpose.weights import load_refiner, load_scorer

D = 0.1  # diameter of the rows' object, metres


def _pose(add: float, adds: float, rot: float, add_sym: float | None = None) -> dict:
    return {"add_m": add, "adds_m": adds, "rot_deg": rot, "add_sym_m": add if add_sym is None else add_sym}


GOOD, FLIP, OFF = _pose(0.005, 0.003, 2.0), _pose(0.09, 0.004, 178.0), _pose(0.2, 0.05, 120.0)


def test_a_flip_is_a_large_rotation_error_whose_shape_still_fits_and_no_real_symmetry_excuses() -> None:
    assert is_flip(_pose(0.09, 0.004, 178.0), D) and is_flip(_pose(0.02, 0.0049, 91.0), D)
    assert not is_flip(_pose(0.05, 0.001, 89.0), D)  # not turned far enough
    assert not is_flip(_pose(0.09, 0.0051, 120.0), D)  # the shape does not fit (ADD-S over 0.05 diameter)
    assert not is_flip(_pose(0.09, 0.004, 178.0, add_sym=0.002), D)  # a real symmetry maps it onto the truth
    assert is_success(_pose(0.09, 0.004, 178.0, add_sym=0.002), D) and not is_success(_pose(0.09, 0.004, 178.0), D)
    assert not is_flip({"add_m": None, "adds_m": None, "rot_deg": None, "add_sym_m": None}, D)


def test_register_figures_count_failed_inputs_as_misses_and_flips_over_the_poses_given() -> None:
    views = {"frames": 4, "per_view": [GOOD, FLIP, OFF, {"id": "view_003", "error": "InputError", "success": False}]}
    diagnostics = [(True, 0, 0, 9), (True, 5, 3, 2), (False, 2, None, 0)]  # oracle, best rank, first success, converged
    views["per_view"][:3] = [row | {"success": row is GOOD, "oracle_success": oracle, "best_rank": best,
                                    "first_success_rank": first, "converged": n}
                             for row, (oracle, best, first, n) in zip(views["per_view"][:3], diagnostics, strict=True)]
    views["candidates"] = candidate_summary(views["per_view"], views["frames"])  # as evaluate_views reports them
    r = register_figures(views, D)
    assert (r["views"], r["posed"], r["failed_inputs"], r["successes"], r["flips"]) == (4, 3, 1, 1, 1)
    # GOOD was picked; FLIP had a refined hypothesis within 0.1 d that the scorer ranked 3rd; OFF had none
    assert (r["candidates"]["scorer_misses"], r["candidates"]["refiner_misses"]) == (1, 1)
    assert r["candidates"]["oracle_success_rate"] == 0.5 and r["candidates"]["chosen_success_rate"] == 0.25
    assert r["success_rate"] == 0.25 and r["flip_rate"] == pytest.approx(1 / 3)
    assert r["add_m"]["max"] == 0.2 and r["rot_deg"]["median"] == 120.0


def test_track_figures() -> None:
    rows = [GOOD | {"pose_valid": True}, FLIP | {"pose_valid": True}, FLIP | {"pose_valid": False},
            {"add_m": None, "adds_m": None, "rot_deg": None, "add_sym_m": None, "pose_valid": False}]
    t = track_figures(rows, D)
    assert (t["frames"], t["posed"], t["successes"], t["flips"]) == (4, 3, 1, 2)
    assert t["success_rate"] == 0.25 and t["flip_rate"] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def can() -> ObjectModel:
    return load_object(make_suite_mesh("can"), name="can")


def _turned(obj: ObjectModel, tilt_deg: float, turn_deg: float) -> tuple[list, list]:
    """(estimate, truth) cam_from_mesh: the can 0.5 m ahead, its axis tilted ``tilt_deg`` from the optical axis,
    the estimate turned ``turn_deg`` about the can's axis (which passes through the centre)."""
    truth = np.eye(4)
    truth[:3, :3], truth[:3, 3] = rotation_about((1.0, 0.0, 0.0), math.radians(tilt_deg))[:3, :3], (0.0, 0.0, 0.5)
    est = truth.copy()
    est[:3, :3] = truth[:3, :3] @ rotation_about((0.0, 0.0, 1.0), math.radians(turn_deg))[:3, :3]
    return (est @ obj.centred_from_mesh).tolist(), (truth @ obj.centred_from_mesh).tolist()


def test_scenario_figures_count_valid_flips_and_why_each_passed(can: ObjectModel) -> None:
    judged = {"appearance_cells": 70.0, "texture_contrast": 0.1, "appearance_ncc": 0.8}
    side_est, side_truth = _turned(can, -90.0, 180.0)  # seen from the side: the label shows where the can faces
    top_est, top_truth = _turned(can, 180.0, 120.0)  # seen from the top: the lid is round, no label in view
    flip, valid = FLIP | {"cam_from_mesh": side_est, "gt_cam_from_mesh": side_truth}, {"pose_valid": True}
    rows = [GOOD | valid, flip | valid | {"measurements": judged},
            flip | valid | {"measurements": judged | {"appearance_cells": 12.0}},  # too few cells to judge
            flip | valid | {"cam_from_mesh": top_est, "gt_cam_from_mesh": top_truth, "measurements": judged},
            flip | {"pose_valid": False}]
    metrics = {"frames": 5, "good_frames": 1, "false_alarms": 0, "false_alarm_rate": 0.0, "loss_detection_rate": None,
               "silent_failures": 1, "recovery_rate_1s": None, "unobserved_recoveries": 0, "reported_valid_frames": 4}
    K, hw = demo_intrinsics((240, 320)), (240, 320)
    s = scenario_figures(metrics | {"per_frame": rows, "confidence_roc": {}}, can, K, hw)
    # three flips reported valid (not the one judged invalid): one its print would show and the appearance passed,
    # one the appearance did not judge, one that looks like the truth from the top
    assert s == metrics | {"valid_flip_frames": 3, "valid_flip_look_alike": 1, "valid_flip_unjudged": 1,
                           "valid_flip_missed": 1}
    ncc = look_alike_ncc(can, K, hw, *(np.stack([np.asarray(p) @ np.linalg.inv(can.centred_from_mesh)])
                                       for p in (side_est, side_truth)))
    assert ncc[0] < LOOK_ALIKE_NCC  # the side view's flip is no look-alike: the label moved out of view
    assert valid_flip_causes([], can, K, hw) == {"valid_flip_look_alike": 0, "valid_flip_unjudged": 0,
                                                 "valid_flip_missed": 0}


def _object(split: str, successes: int, views: int, flips: int, add: float) -> dict:
    part = {"posed": views, "successes": successes, "flips": flips, "add_m": {"mean": add}, "adds_m": {"mean": add / 2}}
    scenario = {"silent_failures": 1, "valid_flip_frames": flips, "valid_flip_look_alike": 1,
                "valid_flip_unjudged": 0, "valid_flip_missed": flips - 1, "false_alarms": 2, "reported_valid_frames": 10}
    candidates = {"refiner_misses": views - successes - flips, "scorer_misses": flips}
    return {"register": part | {"views": views, "candidates": candidates}, "track": part | {"frames": views},
            "scenarios": {"clean": scenario}}


def test_splits_and_overall_pool_counts_and_average_the_objects_means() -> None:
    per_object = {"mug": _object("tune", 3, 4, 1, 0.01), "drill": _object("held_out", 0, 6, 6, 0.05)}
    out = summarise(per_object, SUITE)
    assert list(out) == ["tune", "held_out", "overall"]
    assert out["tune"]["objects"] == ["mug"] and out["held_out"]["objects"] == ["drill"]
    overall = out["overall"]["register"]
    assert overall["views"] == 10 and overall["success_rate"] == 0.3 and overall["flip_rate"] == 0.7
    assert (overall["refiner_misses"], overall["scorer_misses"]) == (0, 7)
    assert overall["add_m_mean"] == pytest.approx(0.03) and overall["adds_m_mean"] == pytest.approx(0.015)
    assert out["overall"]["scenarios"] == {"silent_failures": 2, "valid_flip_frames": 7, "valid_flip_look_alike": 2,
                                           "valid_flip_unjudged": 0, "valid_flip_missed": 5, "false_alarms": 4,
                                           "reported_valid_frames": 20}
    assert summarise({"mug": per_object["mug"]}, SUITE).keys() == {"tune", "overall"}
    assert "pick_within_rate" not in overall  # the objects' reports have no what-if of the pick


def test_the_pick_what_if_is_pooled_over_the_objects_views() -> None:
    per_object = {"mug": _object("tune", 3, 4, 1, 0.01), "can": _object("tune", 0, 6, 6, 0.05)}
    for name, picked, three in (("mug", 0.75, 1.0), ("can", 0.5, 0.0)):
        per_object[name]["register"]["candidates"] |= {"pick_within_rate": picked,
                                                       "pick_within_rate_by_iterations": {"3": three}}
    tune = summarise(per_object, SUITE)["tune"]["register"]
    assert tune["pick_within_rate"] == pytest.approx((0.75 * 4 + 0.5 * 6) / 10)
    assert tune["pick_within_rate_by_iterations"] == {"3": pytest.approx(0.4)}
    del per_object["can"]["register"]["candidates"]["pick_within_rate_by_iterations"]
    assert "pick_within_rate_by_iterations" not in summarise(per_object, SUITE)["tune"]["register"]


def test_the_weights_key_names_the_mesh_and_every_training_setting() -> None:
    base = SuiteTraining(minutes=1.0)
    assert base.key(b"mesh") == SuiteTraining(minutes=1.0).key(b"mesh") and len(base.key(b"mesh")) == 16
    assert base.key(b"mesh") != base.key(b"other mesh")
    assert base.key(b"mesh") != SuiteTraining(minutes=2.0).key(b"mesh")
    assert base.key(b"mesh") != SuiteTraining(minutes=1.0, crop_size=32).key(b"mesh")


def test_finished_weights_in_the_cache_are_reused_without_training(tmp_path) -> None:
    mesh = tmp_path / "can.glb"
    mesh.write_bytes(b"not read as a mesh: a finished run is not trained again")
    training = SuiteTraining(minutes=0.5)
    folder = tmp_path / "cache" / f"can-{training.key(mesh.read_bytes())}"
    folder.mkdir(parents=True)
    (folder / SUMMARY_FILE).write_text(json.dumps({"steps": 12}), encoding="utf-8")
    weights, info = trained_weights("can", mesh, tmp_path / "cache", training)
    assert weights == folder and info["reused"] and info["summary"] == {"steps": 12}


TINY_TRAINING = SuiteTraining(steps=2, batch=2, crop_size=32, frame_hw=(96, 128), scorer_sets=1, set_size=3,
                              device="cpu", renderer="cpu")


@pytest.mark.slow  # two worker processes start and train two steps each on 2 cores
def test_objects_trained_at_once_get_the_same_weights_as_one_after_the_other(tmp_path) -> None:
    catalogue = write_objects(tmp_path / "objects", ["can", "mug"])
    meshes = {name: tmp_path / "objects" / catalogue["objects"][name]["file"] for name in ("mug", "can")}
    apart = train_objects(meshes, tmp_path / "apart", TINY_TRAINING, jobs=1)
    together = train_objects(meshes, tmp_path / "together", TINY_TRAINING, jobs=2)
    assert list(together) == ["mug", "can"]  # the meshes' order, whichever finished first
    for name in meshes:
        weights, info, seconds = together[name]
        assert weights.parent == tmp_path / "together" and not info["reused"] and seconds > 0
        assert info["summary"]["steps"] == apart[name][1]["summary"]["steps"] == 2
        for load in (load_refiner, load_scorer):
            a, b = load(apart[name][0]).state_dict(), load(weights).state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (tmp_path / "mug.glb").write_bytes(meshes["mug"].read_bytes())  # the same bytes, another file: the same key
    again = train_objects({"mug": tmp_path / "mug.glb", "can": meshes["can"]}, tmp_path / "together",
                          TINY_TRAINING, jobs=2)
    assert all(info["reused"] for _, info, _ in again.values()) and again["mug"][0] == together["mug"][0]


def test_a_failed_training_names_its_object(tmp_path) -> None:
    broken = tmp_path / "broken.glb"
    broken.write_bytes(b"not a mesh")
    for jobs in (1, 2):
        with pytest.raises(RuntimeError, match=r"^training the weights of (also_)?broken failed: .*mesh"):
            train_objects({"broken": broken, "also_broken": broken}, tmp_path / "cache", TINY_TRAINING, jobs=jobs)
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        train_objects({"broken": broken}, tmp_path / "cache", TINY_TRAINING, jobs=0)


def test_the_evaluation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must include 'clean'"):
        SuiteEvaluation(scenarios=("jump",))
    with pytest.raises(ValueError, match="views must be >= 1"):
        SuiteEvaluation(views=0)
    with pytest.raises(ValueError, match="fewer_register_iterations must be >= 1"):
        SuiteEvaluation(fewer_register_iterations=(0,))


@pytest.mark.parametrize(("argv", "says"), [
    (["--objects", "mug", "teapot"], "mug, spray_bottle, cereal_box, can, drill, shoe, jar, book"),
    (["--objects", "mug", "--split", "held_out"], "at least one object of split 'held_out'"),
    (["--frames", "10"], "at least 30 frames"),
    (["--views", "0"], "a number of views >= 1"),
    (["--train-only", "--weights", "w"], "no --weights: it trains each object's own"),
    (["--train-jobs", "0"], "a number of objects >= 1"),
])
def test_the_command_refuses_bad_arguments_before_any_work(tmp_path, capsys, argv, says) -> None:
    assert main(["suite", "--out", str(tmp_path), "--device", "cpu", *argv]) == 1
    assert says in capsys.readouterr().err
    assert not (tmp_path / "weights").exists()


@pytest.mark.slow  # minutes on 2 cores: one training step, one view, the clean scenario's 30 frames
def test_the_suite_command_trains_evaluates_and_writes_the_record(tmp_path, capsys) -> None:
    out = tmp_path / "suite"
    argv = ["suite", "--objects", "can", "--steps", "1", "--batch", "2", "--crop-size", "32", "--frame-size", "96",
            "128", "--scorer-sets", "1", "--set-size", "3", "--views", "1", "--scenario", "clean", "--frames", "30",
            "--size", "180", "240", "--device", "cpu", "--renderer", "cpu", "--hypotheses", "2",
            "--register-iterations", "1", "--track-iterations", "1", "--no-progress", "--out", str(out), "--json"]
    assert main([*argv, "--train-only"]) == 0  # the weights alone: nothing evaluated
    weights_only = json.loads(capsys.readouterr().out)
    assert weights_only["objects"] == {} and not weights_only["weights"]["can"]["reused"]
    assert main(argv) == 0  # the same settings and cache: the weights are reused, then evaluated
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / "suite.json").read_text(encoding="utf-8"))
    can = report["objects"]["can"]
    assert can["weights"] == weights_only["weights"]["can"] | {"reused": True}
    assert can["split"] == "tune" and can["near_symmetries"][0]["broken_by"] == ["texture"]
    detected = {d["declaration"]: d for d in can["symmetries"]["detected"]}
    assert detected["z:inf"]["texture_breaks"] and not detected["z:inf"]["real"]
    assert can["symmetries"]["declared"] is None  # the label breaks every symmetry of the shape
    assert can["weights"]["summary"]["steps"] == 1 and not can["random_weights"]
    assert (out / "objects" / "can.glb").is_file() and can["weights"]["dir"].startswith(str(out / "weights"))
    assert can["register"]["views"] == 1 and can["track"]["frames"] == 30
    for part in ("register", "track"):
        assert 0.0 <= can[part]["success_rate"] <= 1.0
        assert can[part]["flip_rate"] is None or 0.0 <= can[part]["flip_rate"] <= 1.0
    assert list(can["scenarios"]) == ["clean"] and can["scenarios"]["clean"]["frames"] == 30
    assert list(report["splits"]) == ["tune", "overall"] and report["splits"]["overall"]["objects"] == ["can"]
    # the scorer's pick on the oracle's criterion, and the what-if with fewer iterations, pooled per split
    candidates = can["register"]["candidates"]
    pooled = report["splits"]["tune"]["register"]
    assert pooled["pick_within_rate"] == candidates["pick_within_rate"] in (0.0, 1.0)
    assert "pick_within_rate_by_iterations" not in candidates  # a CPU register of 2 iterations has no fewer 3
    assert report["settings"]["training"]["steps"] == 1 and report["settings"]["evaluation"]["views"] == 1
