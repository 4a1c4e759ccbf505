"""``tools/make_overview_figure.py``: three panels of one bundled frame, the last with the pose drawn on it; the
committed picture is what the tool draws."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, DatasetError, RecordedSequence

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp_make_overview_figure", ROOT / "tools" / "make_overview_figure.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


DEMO_RECORD = ROOT / "benchmarks" / "records" / "2026-12-06-h100-80gb-hbm3" / "demo.json"
README_FRAME = 5  # the frame of the README's picture (its command passes --frame 5)


def test_the_picture_is_three_panels_and_the_committed_one_is_current(tmp_path: Path) -> None:
    """The committed picture is the tool's drawing of the pose that the record's demo estimated with trained
    weights."""
    out = tmp_path / "overview.png"
    assert f"--frame {README_FRAME} --pose" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert tool.main(["--out", str(out), "--frame", str(README_FRAME), "--pose", str(DEMO_RECORD)]) == 0
    picture = cv2.imread(str(out))[..., ::-1]
    frame = RecordedSequence(BUNDLED_SEQUENCE_DIR).read(README_FRAME)
    h, w = frame.rgb.shape[:2]
    assert picture.shape == (h, 3 * w + 16, 3)
    posed = picture[:, 2 * w + 16:]
    changed = np.any(posed != frame.rgb, axis=2)  # the box, the axes and the title drawn over the colour image
    assert changed[40:].sum() > 500  # more than the title: the pose is drawn
    committed = cv2.imread(str(ROOT / "docs" / "images" / "overview.png"))[..., ::-1]
    np.testing.assert_array_equal(committed, picture)


def test_an_estimated_pose_is_drawn_where_it_is_and_a_broken_file_is_refused(tmp_path: Path) -> None:
    frame = RecordedSequence(BUNDLED_SEQUENCE_DIR).read(12)
    shifted = frame.gt_pose.copy()
    shifted[0, 3] += 0.02  # 2 cm along the camera x axis
    pose_file = tmp_path / "000012.txt"
    np.savetxt(pose_file, shifted)
    annotated, estimated = tool.overview(12), tool.overview(12, pose_file)
    w = frame.rgb.shape[1]
    assert np.array_equal(annotated[:, :2 * w + 16], estimated[:, :2 * w + 16])  # the inputs are the same
    moved = np.any(annotated[60:, 2 * w + 16:] != estimated[60:, 2 * w + 16:], axis=2)  # below the two title lines
    assert moved.sum() > 200
    np.savetxt(pose_file, np.eye(4)[:3])
    with pytest.raises(DatasetError, match="pose"):
        tool.overview(12, pose_file)


def test_a_record_pose_is_read_by_frame_and_a_missing_or_broken_one_is_refused(tmp_path: Path) -> None:
    frame = RecordedSequence(BUNDLED_SEQUENCE_DIR).read(12)
    record = tmp_path / "demo.json"
    record.write_text(json.dumps({"ob_in_cam": {"000012": frame.gt_pose.tolist()}}))
    np.testing.assert_array_equal(tool.read_estimated_pose(record, 12), frame.gt_pose)
    with pytest.raises(SystemExit, match="no pose of frame 000013 under 'ob_in_cam' \\(it has 1 frames\\)"):
        tool.read_estimated_pose(record, 13)
    record.write_text(json.dumps({"ob_in_cam": {"000012": [[1.0, 0.0], [0.0, 1.0]]}}))
    with pytest.raises(SystemExit, match="not a finite 4x4 matrix"):
        tool.read_estimated_pose(record, 12)
