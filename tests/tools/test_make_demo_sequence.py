"""``tools/make_demo_sequence.py``: it regenerates the bundled sequence (its first frame, pixel for pixel), writes the
official layout, and replaces only its own files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import cv2
import numpy as np
import pytest

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR, RecordedSequence

_PATH = Path(__file__).resolve().parents[2] / "tools" / "make_demo_sequence.py"
_spec = importlib.util.spec_from_file_location("fp_make_demo_sequence", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _pixels(path: Path) -> np.ndarray:
    return cv2.imread(str(path), cv2.IMREAD_UNCHANGED)


def test_the_first_frame_equals_the_bundled_one(tmp_path: Path, capsys) -> None:
    out = tmp_path / "seq"
    out.mkdir()
    (out / "notes.txt").write_text("not the tool's")
    assert tool.main(["--out", str(out), "--frames", "2"]) == 0  # frame 0 is the trajectory's start at any length
    assert "wrote 2 frames" in capsys.readouterr().out
    for sub in ("depth", "masks"):  # decoded pixels: PNG bytes depend on the zlib build
        assert np.array_equal(_pixels(out / sub / "000000.png"), _pixels(BUNDLED_SEQUENCE_DIR / sub / "000000.png")), sub
    # colour: a texture sample that falls on a texel boundary may round the other way with another build of the
    # image and tensor libraries (seen on a fresh install: 2 of 921,600 values, 1 level apart)
    diff = np.abs(_pixels(out / "rgb" / "000000.png").astype(int) - _pixels(BUNDLED_SEQUENCE_DIR / "rgb" / "000000.png"))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= 20, (diff.max(), np.count_nonzero(diff))
    assert np.array_equal(np.loadtxt(out / "annotated_poses" / "000000.txt"),
                          np.loadtxt(BUNDLED_SEQUENCE_DIR / "annotated_poses" / "000000.txt"))
    assert np.array_equal(np.loadtxt(out / "cam_K.txt"), np.loadtxt(BUNDLED_SEQUENCE_DIR / "cam_K.txt"))
    assert (out / "notes.txt").read_text() == "not the tool's"
    seq = RecordedSequence(out)  # the demo's reader takes it: the official layout
    assert len(seq) == 2 and seq[1].rgb.shape == (480, 640, 3) and seq[1].mask.any()


def test_fewer_than_two_frames_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        tool.main(["--out", str(tmp_path), "--frames", "1"])
    assert exc.value.code == 2
