"""``python -m foundationpose.evaluate``: a --weights folder or a runtime it cannot use is refused before anything
is drawn (no empty progress bar above the error) and before the output folder is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundationpose.evaluate.cli import main
from foundationpose.weights import CHECKPOINT_NAME, REFINER_RUN, SCORER_RUN

QUICK = ["--views", "0", "--max-frames", "2", "--hypotheses", "6", "--register-iterations", "1",
         "--track-iterations", "1", "--overlays", "0"]


def _refused(capsys, tmp_path: Path, *options: str) -> str:
    out = tmp_path / "eval_out"
    assert main([*options, "--out", str(out), *QUICK]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "evaluate:" not in captured.err and "frame/s" not in captured.err, captured.err  # no progress bar
    assert not out.exists()
    return captured.err


def test_a_missing_weights_folder_is_refused_before_any_progress_output(tmp_path, capsys):
    missing = tmp_path / "no_weights"
    err = _refused(capsys, tmp_path, "--weights", str(missing))
    assert err == (f"InputError: --weights: expected a weights folder in the official layout (<root>/<run>/"
                   f"{CHECKPOINT_NAME}); got '{missing}' (no such folder). Give the folder that holds both runs, "
                   "or leave --weights out for random weights\n")


def test_a_file_given_as_the_weights_folder_is_refused(tmp_path, capsys):
    a_file = tmp_path / "weights.pth"
    a_file.write_bytes(b"\0" * 16)
    assert f"got '{a_file}' (a file). " in _refused(capsys, tmp_path, "--weights", str(a_file))


def test_a_weights_folder_without_the_scorer_run_names_the_missing_checkpoint(tmp_path, capsys):
    root = tmp_path / "weights"
    (root / REFINER_RUN).mkdir(parents=True)
    (root / REFINER_RUN / CHECKPOINT_NAME).write_bytes(b"\0" * 16)
    err = _refused(capsys, tmp_path, "--weights", str(root))
    assert f"got '{root}' without {SCORER_RUN}/{CHECKPOINT_NAME}. " in err
    assert REFINER_RUN not in err


def test_cuda_asked_for_without_it_is_refused_before_any_progress_output(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = _refused(capsys, tmp_path, "--device", "cuda")
    assert err.startswith("InputError: options: expected a runtime this machine can run; got ")
    assert "CUDA" in err
