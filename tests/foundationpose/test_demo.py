"""``python -m foundationpose.demo`` end to end on 2 frames of the bundled sequence, at reduced cost
(4 hypotheses, 1 refine iteration each), on the CPU, with random weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from foundationpose.demo import main
from foundationpose.weights import write_random_weights

REPO = Path(__file__).resolve().parents[2]
FAST = ["--max-frames", "2", "--hypotheses", "4", "--register-iterations", "1", "--track-iterations", "1",
        "--device", "cpu", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return write_random_weights(tmp_path_factory.mktemp("weights"), seed=0)


def _capture_main(args: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, weights):
    """Both paths once: --sync (reference) and the default pipelined service."""
    results = {}
    for mode, extra in (("sync", ["--sync", "--no-video"]), ("pipelined", [])):
        out = tmp_path_factory.mktemp(f"demo_{mode}")
        (out / "ob_in_cam").mkdir()
        (out / "ob_in_cam" / "999999.txt").write_text("stale")  # an earlier run's file: replaced
        (out / "notes.txt").write_text("mine")  # not the demo's: kept
        rc, stdout, stderr = _capture_main([*FAST, "--weights", str(weights), "--out", str(out), *extra])
        results[mode] = (out, rc, stdout, stderr)
    return results


def _poses(out: Path) -> dict[str, np.ndarray]:
    return {p.stem: np.loadtxt(p) for p in sorted((out / "ob_in_cam").glob("*.txt"))}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_demo_writes_outputs(runs, mode):
    out, rc, stdout, stderr = runs[mode]
    assert rc == 0, stderr
    assert "RANDOM WEIGHTS: poses are meaningless" in stderr
    summary = json.loads(stdout)
    assert summary["frames"] == 2 and summary["mode"] == mode and summary["random_weights"] is True
    assert summary["device"] == "cpu"

    poses = _poses(out)
    assert sorted(poses) == ["000000", "000001"]  # the stale 999999.txt is gone
    assert (out / "notes.txt").read_text() == "mine"
    for pose in poses.values():
        assert pose.shape == (4, 4) and np.isfinite(pose).all()
        np.testing.assert_allclose(pose[3], [0, 0, 0, 1])
        np.testing.assert_allclose(pose[:3, :3] @ pose[:3, :3].T, np.eye(3), atol=1e-5)
        assert np.linalg.det(pose[:3, :3]) == pytest.approx(1.0, abs=1e-5)
    text = (out / "ob_in_cam" / "000000.txt").read_text().splitlines()
    assert len(text) == 4 and all(len(line.split()) == 4 for line in text) and "e" in text[0]

    for frame_id in poses:
        vis = cv2.imread(str(out / "track_vis" / f"{frame_id}.png"))
        assert vis is not None and vis.shape == (480, 640, 3)
        b, g, r = (vis[-40:, :300, c].astype(int) for c in range(3))
        assert ((r > 200) & (g < 80) & (b < 80)).sum() > 50  # "random weights: poses meaningless" in red
        magenta = (vis[..., 2] > 200) & (vis[..., 1] < 60) & (vis[..., 0] > 200)
        assert magenta.sum() > 100  # the ground-truth box

    lines = (out / "timing.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is JSON
    stage_records = [r for r in records if "stage" in r]
    assert stage_records and all(isinstance(r["wall_ms"], float) and r["wall_ms"] >= 0 for r in stage_records)
    stages = {r["stage"] for r in stage_records}
    assert {"read", "demo_register", "demo_track", "write"} <= stages
    assert "refine_score" in stages  # the estimator's / service's own stages are in the same log

    rows = (out / "errors.csv").read_text().splitlines()
    assert rows[0] == "frame_id,add_m,adds_m" and len(rows) == 3
    values = np.array([[float(x) for x in row.split(",")[1:]] for row in rows[1:]])
    assert np.isfinite(values).all() and (values >= 0).all() and (values[:, 1] <= values[:, 0] + 1e-9).all()
    assert summary["mean_add_m"] == pytest.approx(values[:, 0].mean(), abs=1e-6)
    metrics = summary["metrics"]  # the same report as python -m foundationpose.evaluate
    assert metrics["frames"] == 2 and metrics["add_m"]["mean"] == pytest.approx(values[:, 0].mean(), abs=1e-6)
    assert metrics["adds_m"]["max"] == pytest.approx(values[:, 1].max(), abs=1e-6)
    assert 0.0 <= metrics["success_rate"] <= 1.0 and metrics["rot_deg"]["max"] >= 0.0
    assert json.loads((out / "summary.json").read_text())["frames"] == 2


def test_pipelined_and_sync_give_the_same_poses(runs):
    sync, pipelined = _poses(runs["sync"][0]), _poses(runs["pipelined"][0])
    assert sorted(sync) == sorted(pipelined)
    for frame_id in sync:
        # same functions on the same inputs; float32 reductions differ in order (measured ~1e-6 on CPU)
        np.testing.assert_allclose(pipelined[frame_id], sync[frame_id], atol=1e-4)


@pytest.mark.parametrize(("mode", "titles"), [
    ("sync", ["Estimator: register and track steps\nstage ", "Demo loop: frame reads, each frame's step end to end "
                                                              "(demo_register, demo_track), output writes\nstage "]),
    ("pipelined", ["Register lane: pipeline stages\nstage ", "\n\nTrack lane: pipeline stages\nstage ",
                   "\n\nDemo loop: frame reads, each frame's step end to end (demo_register, demo_track), output "
                   "writes\nstage "]),
])
def test_every_timing_table_has_a_title(runs, mode, titles):
    stderr = runs[mode][3]  # --json: the timing tables go to stderr
    heads = [line for line in stderr.splitlines() if line.startswith("stage ")]
    assert len(heads) == len(titles), stderr
    at = [stderr.index(title) for title in titles]
    assert at == sorted(at), stderr  # in this order
    demo_table = stderr[at[-1]:]
    assert all(stage in demo_table for stage in ("read ", "demo_register ", "demo_track ", "write "))


def test_video_written_or_skipped_with_a_note(runs):
    out, _, stdout, _ = runs["pipelined"]
    summary = json.loads(stdout)
    if summary["video"] is None:
        assert any("video" in note for note in summary["notes"])
    else:
        assert Path(summary["video"]).stat().st_size > 0
    assert not (runs["sync"][0] / "track_vis.mp4").exists()  # --no-video


@pytest.mark.slow
def test_bad_data_path_exits_1_with_a_clear_message(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "foundationpose.demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"DatasetError: data: expected a sequence folder with cam_K.txt, rgb/, depth/, masks/; got '{tmp_path / 'missing'}'"
    )
    assert "Traceback" not in proc.stderr


def test_out_is_a_file_exits_1(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    rc, _, stderr = _capture_main(["--out", str(target), "--max-frames", "1"])
    assert rc == 1 and stderr.strip().startswith("InputError: --out: expected a folder")
    assert target.read_text() == "x"


def test_help_gives_units_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--data", "--mesh", "--weights", "--device", "--backend", "--precision", "--out", "--max-frames",
                 "--sync", "--hypotheses", "--register-iterations", "--track-iterations", "--no-video", "--json"):
        assert flag in text
    assert "default: 252" in text and "default: ./demo_out" in text and "metres" in text


def test_summary_repeats_the_random_weights_warning_next_to_add(capsys):
    from foundationpose.demo.cli import DemoSummary, _print_summary

    summary = DemoSummary(frames=2, mode="sync", device="cpu", backend="torch", precision="fp32", random_weights=True,
                          wall_s=1.0, fps=2.0, register_ms=10.0, track_ms_mean=5.0, mean_add_m=0.1738,
                          mean_adds_m=0.1278, out_dir="demo_out", video=None, notes=[], timing={}, timing_table="",
                          metrics=None)
    _print_summary(summary, as_json=False)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mean ADD"))
    assert line.startswith("mean ADD 17.38 cm, mean ADD-S 12.78 cm")
    assert line.endswith("-- RANDOM WEIGHTS: poses meaningless, so are these errors")


def test_summary_tables_are_titled(runs):
    from foundationpose.demo.cli import DemoSummary
    from foundationpose.demo.summary import summary_tables

    summary = DemoSummary(**{k: v for k, v in json.loads(runs["sync"][2]).items()}, timing_table="(timing)")
    text = summary_tables(summary)
    for title in ("Run\n===\n", "Accuracy against ground truth\n", "Trust: session state per frame\n",
                  "Timing per stage (ms)\n"):
        assert title in text
    assert "RANDOM WEIGHTS: poses meaningless" in text and "ADD under symmetries" not in text
    trust = summary.trust
    assert trust["frames"] == 2 and sum(trust["states"].values()) == 2 and 0 <= trust["confidence_min"] <= 1


def test_a_bad_symmetry_declaration_exits_1(tmp_path):
    rc, _, stderr = _capture_main(["--symmetry", "z:1", "--out", str(tmp_path / "o"), "--max-frames", "1"])
    assert rc == 1 and stderr.strip().startswith("InputError: --symmetry: expected an order >= 2")


@pytest.mark.slow
def test_symmetric_object_declared(tmp_path, weights):
    out = tmp_path / "sym"
    rc, stdout, stderr = _capture_main([*FAST, "--sync", "--no-video", "--weights", str(weights), "--out", str(out),
                                        "--symmetry", "z:2", "--max-frames", "2"])
    assert rc == 0, stderr
    summary = json.loads(stdout)
    assert summary["trust"]["symmetry"] == {"declared": ["discrete z 2"], "transforms": 2}
    metrics = summary["metrics"]
    assert metrics["add_sym_m"]["max"] <= metrics["add_m"]["max"] + 1e-12  # the flip is forgiven, never added
