"""``python -m server.client stream|track --frames N``: N frames tracked after the register's, through a live tiny
server (a 160x120 copy of the bundled sequence's first frames, so the tiny CPU estimator answers in moments)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from server import create_app
from server.client import main
from tests.server._helpers import MAX_IMAGE_HW, live_uvicorn, tiny_config

SEQUENCE_FRAMES = 4  # the register's and three more


def _small_sequence(out: Path, frames: int) -> Path:
    """The bundled sequence's first ``frames`` frames at 160x120 (K scaled with them), in the same layout."""
    h, w = MAX_IMAGE_HW
    src = BUNDLED_SEQUENCE_DIR
    for folder in ("rgb", "depth", "masks"):
        (out / folder).mkdir(parents=True)
    ids = sorted(p.stem for p in (src / "rgb").glob("*.png"))[:frames]
    for i, frame_id in enumerate(ids):
        rgb = cv2.imread(str(src / "rgb" / f"{frame_id}.png"), cv2.IMREAD_UNCHANGED)
        depth = cv2.imread(str(src / "depth" / f"{frame_id}.png"), cv2.IMREAD_UNCHANGED)
        scale = w / rgb.shape[1]
        cv2.imwrite(str(out / "rgb" / f"{frame_id}.png"), cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA))
        cv2.imwrite(str(out / "depth" / f"{frame_id}.png"), cv2.resize(depth, (w, h), interpolation=cv2.INTER_NEAREST))
        if i == 0:
            mask = cv2.imread(str(src / "masks" / f"{frame_id}.png"), cv2.IMREAD_UNCHANGED)
            cv2.imwrite(str(out / "masks" / f"{frame_id}.png"),
                        cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST))
    K = np.loadtxt(src / "cam_K.txt")
    K[:2, :2] *= scale
    K[:2, 2] = (K[:2, 2] + 0.5) * scale - 0.5  # pixel centres
    np.savetxt(out / "cam_K.txt", K)
    shutil.copytree(src / "mesh", out / "mesh")
    return out


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Path:
    return _small_sequence(tmp_path_factory.mktemp("client_sequence"), SEQUENCE_FRAMES)


@pytest.fixture(scope="module")
def host(tiny_estimator, tmp_path_factory) -> Iterator[str]:
    objects = tmp_path_factory.mktemp("client_objects")
    app = create_app(tiny_config(objects, warmup=False, track_latency_budget_s=0), estimator=tiny_estimator)
    with live_uvicorn(app) as address:
        yield address


def _summary(capsys, argv: list[str]) -> dict:
    code = main([*argv, "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert code == 0, summary
    return summary


@pytest.mark.slow  # a live server, two registers and up to five tracks: several seconds on 2 CPU cores
@pytest.mark.parametrize("command", ["stream", "track"])
def test_frames_n_tracks_n_frames_after_the_register(command, host, sequence, capsys):
    url = f"ws://{host}" if command == "stream" else f"http://{host}"
    summary = _summary(capsys, [command, "--url", url, "--data", str(sequence), "--frames", "2"])
    assert (summary["frames"], summary["answered"], summary["errors"]) == (2, 2, 0)
    # more than the sequence holds: every frame after the register's
    summary = _summary(capsys, [command, "--url", url, "--data", str(sequence), "--frames", "10"])
    assert (summary["frames"], summary["answered"]) == (SEQUENCE_FRAMES - 1, SEQUENCE_FRAMES - 1)


@pytest.mark.parametrize("frames", ["0", "-3"])
def test_frames_below_one_is_refused_naming_the_option(frames, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["stream", "--url", "ws://127.0.0.1:9", "--frames", frames])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"--frames: the number of frames to track after the register, at least 1 (got {frames})" in err


def test_the_help_says_frames_counts_the_tracked_frames(capsys):
    with pytest.raises(SystemExit):
        main(["track", "--help"])
    assert "track N frames after the register's" in " ".join(capsys.readouterr().out.split())
