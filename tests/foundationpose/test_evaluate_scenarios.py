"""Robustness figures from per-frame rows, the ROC, the seed streams, a session driven by ground-truth poses through
real scenarios (real validity, states and recovery), and the scenarios / calibrate commands on tiny settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from foundationpose.errors import InputError
from foundationpose.estimator import RegisterResult, TrackResult
from foundationpose.evaluate.calibrate import CalibrationConfig
from foundationpose.evaluate.cli import main
from foundationpose.evaluate.scenarios import (
    SEED_STREAMS,
    check_disjoint,
    confidence_roc,
    run_scenario,
    scenario_metrics,
    scenario_seeds,
)
from foundationpose.synthetic.scenarios import SCENARIOS
from foundationpose.validity import FrameJudge

TINY = ["--device", "cpu", "--renderer", "cpu", "--hypotheses", "2", "--register-iterations", "1",
        "--track-iterations", "1", "--no-progress"]
HW = (180, 240)  # the smallest size at which the track step's depth filters leave the object enough support


def _rows(spec: str, visible: list[float] | None = None) -> list[dict]:
    """One row per character: T tracking + valid + correct, U uncertain, L lost, R recovering, W wrong but
    reported valid (tracking), G gone (visible 0) and lost; lower case = the pose is wrong."""
    rows = []
    for i, c in enumerate(spec):
        state = {"T": "tracking", "U": "uncertain", "L": "lost", "R": "recovering", "W": "tracking", "G": "lost"}[
            c.upper()]
        correct = c.isupper() and c != "W"
        vis = visible[i] if visible is not None else (0.0 if c.upper() == "G" else 1.0)
        rows.append({"visible_fraction": vis, "correct": correct, "state": state,
                     "pose_valid": state == "tracking", "confidence": 0.9 if state == "tracking" else 0.1,
                     "add_m": 0.001 if correct else 0.05, "adds_m": 0.001 if correct else 0.04})
    return rows


def test_clean_tracking_with_one_false_alarm() -> None:
    m = scenario_metrics(_rows("TTTTUTTTTT"))
    assert m["good_frames"] == 10 and m["false_alarms"] == 1 and m["false_alarm_rate"] == pytest.approx(0.1)
    assert m["confirmation_frames"] == 0 and m["false_invalid_rate"] == pytest.approx(0.1)
    assert m["losses"] == [] and m["silent_failures"] == 0 and m["reported_valid_frames"] == 9
    assert m["add_m_on_valid"]["mean"] == pytest.approx(0.001)


def test_a_loss_its_detection_delay_and_the_recovery() -> None:
    # the object goes at frame 3 (two uncertain frames, lost at 5), is back at 7, recovered (valid, correct) at 9
    rows = _rows("TTTuuGGrRT", visible=[1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    m = scenario_metrics(rows, fps=30)
    assert m["losses"] == [{"start": 3, "end": 8, "detected": True, "delay_frames": 2,
                            "first_invalid_delay_frames": 0, "observed": True}]
    assert m["loss_detection_rate"] == 1.0 and m["loss_detection_delay_frames"]["max"] == 2
    assert m["recoveries"] == [{"visible_again": 7, "recovered_at": 9, "frames_to_recover": 2, "within_1s": True,
                                "observed": True, "outcome": "within_1s", "window_ends": 37}]
    assert m["recovery_rate_1s"] == 1.0 and m["unobserved_recoveries"] == 0 and m["silent_failures"] == 0
    # frame 8 is good (in view, correct) but RECOVERING: the confirmation every recovery passes through
    assert m["confirmation_frames"] == 1 and m["false_alarms"] == 0 and m["false_alarm_rate"] == 0.0
    late = scenario_metrics(rows, fps=1)  # within "1 s" at 1 frame/s: 2 frames is too late, and observed
    assert late["recovery_rate_1s"] == 0.0 and late["recoveries"][0]["outcome"] == "late"


def test_a_good_frame_in_any_other_state_is_a_false_alarm() -> None:
    m = scenario_metrics(_rows("TTLRTTUTTT"))  # L: a correct pose judged invalid while lost; R: confirming
    assert m["good_frames"] == 10 and m["confirmation_frames"] == 1
    assert m["false_alarms"] == 2 and m["false_alarm_rate"] == pytest.approx(2 / 9)


def test_a_recovery_the_scenario_ends_too_early_to_judge_is_unobserved_not_failed() -> None:
    visible = [1.0] * 3 + [0.0] * 5 + [1.0] * 4  # back in view at frame 8, 3 frames before the end
    short = scenario_metrics(_rows("TTTGGGGGllll", visible=visible), fps=30)
    event = short["recoveries"][0]
    assert event == {"visible_again": 8, "recovered_at": None, "frames_to_recover": None, "within_1s": None,
                     "observed": False, "outcome": "unobserved", "window_ends": 38}
    assert short["unobserved_recoveries"] == 1 and short["recovery_rate_1s"] is None  # not 0: nothing judged
    assert short["losses"][0]["detected"] and short["unobserved_losses"] == 0
    # the same session 30 frames longer, still lost: now the 1 s window is observed, and it failed
    long = scenario_metrics(_rows("TTTGGGGG" + "l" * 31, visible=visible[:8] + [1.0] * 31), fps=30)
    assert long["recoveries"][0]["outcome"] == "not_recovered" and long["recoveries"][0]["within_1s"] is False
    assert long["unobserved_recoveries"] == 0 and long["recovery_rate_1s"] == 0.0
    # recovered just inside the window (30 frames after the reappearance) and just outside it (31)
    for frames, outcome in ((30, "within_1s"), (31, "late")):
        spec = "TTTGGGGG" + "l" * (frames - 1) + "RT"
        m = scenario_metrics(_rows(spec, visible=visible[:8] + [1.0] * (len(spec) - 8)), fps=30)
        assert m["recoveries"][0]["outcome"] == outcome and m["recoveries"][0]["frames_to_recover"] == frames


def test_a_loss_cut_off_by_the_end_before_it_could_be_detected_is_unobserved() -> None:
    cut = scenario_metrics(_rows("TTTTTTTTuu"))  # wrong from frame 8, two frames before the end: not yet lost
    assert cut["losses"][0]["observed"] is False and cut["unobserved_losses"] == 1
    assert cut["loss_detection_rate"] is None
    missed = scenario_metrics(_rows("TTTTTTTuuu"))  # three wrong frames and never lost: a missed detection
    assert missed["losses"][0]["observed"] is True and missed["loss_detection_rate"] == 0.0


def test_a_wrong_pose_reported_valid_is_a_silent_failure() -> None:
    m = scenario_metrics(_rows("TTTwwwwwww"))
    assert m["silent_failures"] == 7 and m["losses"][0]["detected"] is False
    assert m["losses"][0]["observed"] and m["loss_detection_rate"] == 0.0
    # never recovered, but the scenario ends 7 frames after: the 1 s window is not observed
    assert m["recoveries"][0]["outcome"] == "unobserved" and m["recovery_rate_1s"] is None


def test_metrics_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^fps and recover_within_s must be > 0 and detect_within >= 1"):
        scenario_metrics(_rows("TT"), fps=0)
    with pytest.raises(ValueError, match=r"detect_within >= 1, got 30.0, 1.0, 0$"):
        scenario_metrics(_rows("TT"), detect_within=0)


def test_roc_of_the_confidence() -> None:
    perfect = confidence_roc(np.array([0.9, 0.8, 0.2, 0.1]), np.array([True, True, False, False]))
    assert perfect["auc"] == 1.0 and perfect["positives"] == perfect["negatives"] == 2
    assert perfect["points"][0] == [0.0, 1.0, 1.0] and perfect["points"][-1] == [1.0, 0.0, 0.0]
    assert confidence_roc(np.array([0.1, 0.9]), np.array([True, False]))["auc"] == 0.0
    assert confidence_roc(np.array([0.5, 0.5]), np.array([True, False]))["auc"] == 0.5  # ties: the diagonal
    assert confidence_roc(np.array([0.5]), np.array([True]))["auc"] is None


def test_calibration_and_evaluation_draw_from_disjoint_seed_streams() -> None:
    (c_lo, c_hi), (s_lo, s_hi) = SEED_STREAMS["calibrate"], SEED_STREAMS["scenarios"]
    assert c_hi <= s_lo  # disjoint ranges
    calibrate, evaluate = scenario_seeds("calibrate", 0), scenario_seeds("scenarios", s_lo)
    assert list(calibrate.values()) == [0, 1, 2, 3, 4] and list(calibrate) == list(SCENARIOS)
    assert evaluate["clean"] == s_lo and evaluate["distractor"] == s_lo + 4
    assert scenario_seeds("scenarios", s_lo, ["jump"]) == {"jump": s_lo + 3}  # the same scene, run alone or not
    last = c_hi - len(SCENARIOS)
    assert max(scenario_seeds("calibrate", last).values()) == c_hi - 1
    for stream, first in (("calibrate", last + 1), ("calibrate", -1), ("scenarios", 0), ("scenarios", s_hi)):
        with pytest.raises(InputError) as caught:
            scenario_seeds(stream, first)
        message = str(caught.value)
        assert message.startswith("--seed: expected a first seed in ")
        assert f"[{c_lo}, {c_hi})" in message and f"[{s_lo}, {s_hi})" in message  # both ranges named
    with pytest.raises(ValueError, match=r"^stream must be one of calibrate, scenarios; got 'train'"):
        scenario_seeds("train", 0)
    with pytest.raises(InputError, match=r"^--seed: expected a first seed in \[0, 999995\]"):
        CalibrationConfig(seed=s_lo)
    check_disjoint([s_lo, s_lo + 1], [0, 1, 2, 3, 4], "the defaults")
    with pytest.raises(InputError, match=r"^--seed: expected scenario seeds disjoint from the calibration's 3-7 "
                                         r"\(cal.json\): .*; got scenario seeds 5-6$"):
        check_disjoint([5, 6], range(3, 8), "cal.json")


def _write_calibration(path, settings: dict) -> None:
    chosen = {"depth_tolerance_diameters": 0.04, "min_support": 0.23, "min_consistent": 0.42,
              "max_translation_m": 0.028, "max_rotation_deg": 11.0}
    path.write_text(json.dumps({"settings": settings, "default": {"chosen": chosen}}), encoding="utf-8")


def test_scenarios_refuse_seeds_outside_their_stream_or_a_calibration_used(tmp_path, capsys) -> None:
    out = str(tmp_path / "o")
    assert main(["scenarios", "--seed", "0", "--out", out, *TINY]) == 1  # the calibration's stream
    err = capsys.readouterr().err
    assert err.startswith("InputError: --seed: expected a first seed in [1000000, 1999995]")
    assert "calibrate's: [0, 1000000)" in err and "got 0 (scenario seeds 0-4)" in err
    cal = tmp_path / "calibration.json"
    _write_calibration(cal, {"seed": 0, "scenario_seeds": {"clean": 1000002, "occluder": 1000003}})
    assert main(["scenarios", "--calibration", str(cal), "--out", out, *TINY]) == 1
    err = capsys.readouterr().err
    assert err.startswith("InputError: --seed: expected scenario seeds disjoint from the calibration's "
                          f"1000002-1000003 ({cal})")
    assert err.rstrip().endswith("got scenario seeds 1000000-1000004")
    _write_calibration(cal, {"seed": 1000004})  # a file from before the streams: scenario k had seed + k
    assert main(["scenarios", "--calibration", str(cal), "--out", out, *TINY]) == 1
    assert "the calibration's 1000004-1000008" in capsys.readouterr().err
    cal.write_text("{}", encoding="utf-8")
    assert main(["scenarios", "--calibration", str(cal), "--out", out, *TINY]) == 1
    assert capsys.readouterr().err.startswith("InputError: --calibration: expected a calibration.json written by")


class _Oracle:
    """Answers every register and track of one scenario with its ground truth (``wrong_from``: from that frame on,
    the pose 1.5 diameters off instead: a tracker that lost the object for good) and the real validity of that
    pose on the frame's depth: the session, its states and its recovery run as they would on a perfect tracker."""

    def __init__(self, obj, scenario, wrong_from: int | None = None) -> None:
        self.obj, self.scenario, self.wrong_from = obj, scenario, wrong_from
        self.judge = FrameJudge(obj, obj.validity)

    def _pose(self, rgb) -> np.ndarray:
        i = next(k for k, f in enumerate(self.scenario.frames) if f.rgb is rgb)
        pose = self.scenario.frames[i].cam_from_centred.copy()
        if self.wrong_from is not None and i >= self.wrong_from:
            pose = self.scenario.frames[0].cam_from_centred.copy()
            pose[0, 3] += 1.5 * self.obj.diameter
        return pose

    def register(self, obj, rgb, depth, mask, K, iterations=None) -> RegisterResult:
        pose = self._pose(rgb)
        return RegisterResult(cam_from_mesh=pose.astype(np.float64) @ obj.centred_from_mesh, score=0.0,
                              timings_ms={}, cam_from_centred=pose, validity=self.judge.judge(depth, K, pose, pose))

    def track(self, obj, rgb, depth, K, prev, prev_frame="centred", iterations=None) -> TrackResult:
        pose = self._pose(rgb)
        return TrackResult(cam_from_mesh=pose.astype(np.float64) @ obj.centred_from_mesh, timings_ms={},
                           cam_from_centred=pose, validity=self.judge.judge(depth, K, prev, pose))


@pytest.fixture(scope="module")
def renderer():
    from foundationpose.render import make_renderer

    return make_renderer("cpu", "cpu")


@pytest.fixture(scope="module")
def points(textured_object) -> np.ndarray:
    from foundationpose.demo.metrics import model_points

    return model_points(textured_object.mesh, count=500).points


def _run(obj, renderer, points, name: str, frames: int, wrong_from: int | None = None):
    """The scenario ``name`` (the evaluation's seed for it), run by an :class:`_Oracle` session (no recovery
    registers when the oracle turns wrong: they could not help), and its rows and figures."""
    from foundationpose.synthetic.scenarios import make_scenario

    scenario = make_scenario(name, obj, renderer, frames=frames, hw=HW, seed=scenario_seeds("scenarios",
                             SEED_STREAMS["scenarios"][0])[name])
    rows = run_scenario(_Oracle(obj, scenario, wrong_from), obj, scenario, points_mesh=points,
                        recover=wrong_from is None)
    return scenario, rows, scenario_metrics(rows, fps=scenario.fps)


@pytest.mark.slow
def test_a_perfect_tracker_on_the_clean_scenario_raises_no_false_alarm(textured_object, renderer, points) -> None:
    _, rows, m = _run(textured_object, renderer, points, "clean", 30)
    assert m["good_frames"] == 30 and m["false_alarms"] == 0 and m["false_alarm_rate"] == 0.0
    assert m["losses"] == [] and m["silent_failures"] == 0 and m["reported_valid_frames"] == 30
    assert m["states"]["tracking"] == 30 and all(r["add_sym_m"] < 1e-6 for r in rows)


@pytest.mark.slow  # about 2 s: the track step's depth filters on 30 frames, a recovery search on the lost ones
def test_a_perfect_tracker_loses_the_hidden_object_within_3_frames_and_recovers_it(textured_object, renderer,
                                                                                   points) -> None:
    scenario, rows, m = _run(textured_object, renderer, points, "occluder", 30)
    first, last = scenario.events["full_cover"]
    (loss,) = m["losses"]  # the run of frames the object is hidden (visible < 10 %): the only bad frames
    assert loss["start"] <= first and loss["end"] >= last and loss["observed"]
    assert loss["detected"] and loss["delay_frames"] <= 2  # lost within 3 frames (often before: partly hidden)
    assert all(r["state"] == "lost" and not r["pose_valid"] for r in rows[first:last])
    (rec,) = m["recoveries"]
    assert rec["outcome"] == "within_1s" and rec["frames_to_recover"] <= 3 and m["recovery_rate_1s"] == 1.0
    # the recovery register is confirmed on the next frame: that frame is good but RECOVERING, by design ...
    (confirming,) = [r for r in rows if r["state"] == "recovering"]
    assert confirming["correct"] and confirming["visible_fraction"] >= 0.5 and m["confirmation_frames"] == 1
    # ... and no false alarm: those are the good frames judged invalid while the board hides part of the object
    alarms = [r for r in rows if r["correct"] and r["visible_fraction"] >= 0.5 and r["state"] in ("uncertain", "lost")]
    assert m["false_alarms"] == len(alarms) <= 3 and all(r["visible_fraction"] < 0.95 for r in alarms)
    assert m["silent_failures"] == 0


@pytest.mark.slow
def test_a_tracker_that_never_finds_the_object_again(textured_object, renderer, points) -> None:
    # the object leaves the image at frame ~20 and comes back ~5 frames later; the tracker stays wrong
    scenario, rows, m = _run(textured_object, renderer, points, "leave", 30, wrong_from=15)
    (rec,) = m["recoveries"]
    assert scenario.events["gone"][1] <= rec["visible_again"] < 30 - 5
    assert rec["outcome"] == "unobserved" and m["unobserved_recoveries"] == 1 and m["recovery_rate_1s"] is None
    assert m["losses"][0]["start"] == 15 and m["losses"][0]["detected"] and m["silent_failures"] == 0


@pytest.mark.slow
def test_the_default_length_observes_every_recovery_window(textured_object, renderer, points) -> None:
    from foundationpose.synthetic.scenarios import DEFAULT_FRAMES

    _, _, m = _run(textured_object, renderer, points, "leave", DEFAULT_FRAMES, wrong_from=15)
    (rec,) = m["recoveries"]
    assert rec["observed"] and rec["outcome"] == "not_recovered" and m["recovery_rate_1s"] == 0.0
    assert rec["window_ends"] <= DEFAULT_FRAMES - 1 - 8  # the margin after the window


@pytest.mark.slow
def test_scenarios_command(tmp_path, capsys) -> None:
    out = tmp_path / "sc"
    assert main(["scenarios", "--scenario", "jump", "--frames", "30", "--size", "120", "160", "--out", str(out),
                 "--symmetry", "z:2", *TINY]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Robustness scenarios: procedural_textured_asym (cpu)\n") and "RANDOM WEIGHTS" in printed
    assert "correct: ADD under the object's declared symmetries < 0.1 diameter" in printed
    report = json.loads((out / "scenarios.json").read_text(encoding="utf-8"))
    jump = report["scenarios"]["jump"]
    assert jump["events"] == {"jump": 10} and jump["depth"]["kind"] == "sensor" and jump["depth"]["flying_fraction"] > 0
    assert jump["colour"] == {"kind": "sensor", "noise_std": 2.0} and jump["seed"] == 1_000_003 and jump["fps"] == 30
    assert report["settings"]["scenario_seeds"] == {"jump": 1_000_003}
    assert report["calibration"]["scenario_seeds"] == "0-4"
    assert report["definitions"]["correct"] == "ADD under the object's declared symmetries < 0.1 diameter"
    assert len(jump["per_frame"]) == 30 and jump["per_frame"][0]["source"] == "register (client mask)"
    assert report["symmetry"] == {"declared": ["discrete z 2"], "transforms": 2}
    assert report["model_points"]["count"] == 2000
    # random weights: no pose is correct, so nothing is good, no alarm can be false, and no wrong pose passes
    rows = jump["per_frame"]
    assert jump["good_frames"] == sum(r["correct"] and r["visible_fraction"] >= 0.5 for r in rows)
    assert jump["false_alarms"] <= jump["good_frames"] and jump["silent_failures"] == sum(
        r["pose_valid"] and not r["correct"] for r in rows)
    for row in rows:
        assert row["state"] != "lost" or not row["pose_valid"]  # a lost session never reports a valid pose


@pytest.mark.slow
def test_calibrate_command(tmp_path, capsys) -> None:
    out = tmp_path / "cal"
    assert main(["calibrate", "--no-estimator", "--shapes", "L", "--frames", "30", "--size", "240", "320",
                 "--probes", "1", "--out", str(out), "--no-progress", "--device", "cpu", "--renderer", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("Validity thresholds chosen\n")
    report = json.loads((out / "calibration.json").read_text(encoding="utf-8"))
    assert report["command"].startswith("python -m foundationpose.evaluate calibrate --no-estimator")
    assert report["machine"]["cpu_count"] >= 1 and report["date"]
    assert report["settings"]["scenario_seeds"] == dict(zip(SCENARIOS, range(5), strict=True))
    chosen = report["default"]["chosen"]
    assert chosen == report["objects"]["L"]["chosen"]  # one object: the pooled choice is its own
    assert 0 < chosen["min_support"] < 1 and 0 < chosen["min_consistent"] < 1
    figures = report["default"]["per_object"]["L"]
    chosen_at = next(r for r in report["default"]["per_tolerance"]
                     if r["depth_tolerance_diameters"] == chosen["depth_tolerance_diameters"])
    assert chosen_at["false_alarm_on_good"] <= 0.01  # the support / consistency thresholds keep the target
    assert figures["false_alarm_on_good"] >= chosen_at["false_alarm_on_good"]  # motion limits may add some
    assert figures["by_kind"]["far"]["judged_valid"] < 0.1 and figures["by_kind"]["gone"]["judged_valid"] < 0.1
    capsys.readouterr()
    assert main(["calibrate", "--seed", "1000000", "--out", str(out), "--no-progress", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.startswith("InputError: --seed: expected a first seed in [0, 999995]")
