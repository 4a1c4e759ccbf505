"""The server prepares each object's track steps per image size in the background (server.track_prepare): once per
(object, size) after a register or a stateless track succeeds, never on a request's path; failures warn once and
are not retried; ``--no-prepare-track`` schedules nothing; shutdown does not wait past its timeout for a prepare.

On CPU the track lane runs its steps eagerly: a prepare builds one entry per padded batch
size (nothing is captured, so ``fp_track_graph_captures_total`` stays 0)."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
from fastapi.testclient import TestClient

from foundationpose.estimator import PoseEstimator
from foundationpose.service import PoseService
from foundationpose.synthetic.scenes import synthetic_frame
from foundationpose.track_graph import graph_batch_sizes
from server import create_app
from server.track_prepare import TrackPreparer
from tests.server._helpers import FRAME_HW, READY_TIMEOUT_S, encode, register, tiny_config, write_objects_dir

SIZES = len(graph_batch_sizes(8))  # tiny_config's track_max_batch=8: batch sizes 1, 2, 3, 4, 6, 8
OTHER_HW = (80, 112)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def graphed(tiny_estimator) -> PoseEstimator:
    return PoseEstimator(tiny_estimator.networks, tiny_estimator.renderer, device="cpu", config=tiny_estimator.config)


@pytest.fixture(scope="module")
def enc_other():
    return encode(synthetic_frame(*OTHER_HW, seed=2))


def _counter(client: TestClient, name: str, labels: str = "") -> float:
    text = client.get("/metrics").text
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def _started(app) -> TestClient:
    client = TestClient(app)
    client.__enter__()
    assert app.state.fp.wait_ready(READY_TIMEOUT_S), app.state.fp.failure
    return client


@pytest.mark.slow
def test_each_object_and_size_is_prepared_once(graphed, enc, enc_other, tmp_path) -> None:
    app = create_app(tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False), estimator=graphed)
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(READY_TIMEOUT_S), state.failure
        prep = state.track_preparer
        first = register(client, enc)
        assert prep.wait_idle(WAIT_S)
        # the object's steps and those of the group of both loaded objects (a batch mixing them finds its step)
        assert (prep.ok, prep.failed, prep.built, prep.key_count) == (1, 0, 2 * SIZES, 1)
        # the same object and size again (a register, a session track, a stateless track): nothing scheduled
        register(client, enc)
        assert client.post("/track", data={"session_id": first["session_id"]}, files=enc.track_files()).status_code == 200
        stateless = client.post("/track", data={"object_id": "block", "pose": json.dumps(first["pose"]), "K": enc.K_json},
                                files=enc.track_files())
        assert stateless.status_code == 200, stateless.text
        assert prep.wait_idle(WAIT_S)
        assert (prep.ok, prep.built, prep.key_count) == (1, 2 * SIZES, 1)
        # another size of the same object: prepared once more
        register(client, enc_other)
        assert prep.wait_idle(WAIT_S)
        assert (prep.ok, prep.failed, prep.built, prep.key_count) == (2, 0, 4 * SIZES, 2)
        # a stateless track of another object: its own B=1 step ran for the track, the prepare builds the others
        # (the group of both at this size exists already)
        track = client.post("/track", data={"object_id": "block2", "pose": json.dumps(first["pose"]), "K": enc.K_json},
                            files=enc.track_files())
        assert track.status_code == 200, track.text
        assert prep.wait_idle(WAIT_S)
        assert (prep.ok, prep.built, prep.key_count) == (3, 5 * SIZES - 1, 3)
        assert _counter(client, "fp_track_prepares_total", '{outcome="ok"}') == 3
        assert _counter(client, "fp_track_prepares_total", '{outcome="failed"}') == 0
        assert _counter(client, "fp_track_graph_captures_total") == 0  # CPU: eager entries, no graphs
        assert _counter(client, "fp_track_graph_capture_failures_total") == 0  # and none tried
        assert _counter(client, "fp_track_graphs") == 5 * SIZES  # block and the group at two sizes, block2 at one
        # deleting an object drops its keys and frees its steps (the group's too)
        assert client.delete("/objects/block").status_code == 200
        assert prep.key_count == 1
        assert _counter(client, "fp_track_graphs") == SIZES  # block2's only


@pytest.mark.slow
def test_an_upload_after_ready_prepares_the_new_group_at_the_largest_size(graphed, tmp_path) -> None:
    """An upload schedules its steps and those of the group of every loaded object at --max-image at once (before
    any register of it), so a batch mixing it with the others finds its step."""
    import io

    from foundationpose.synthetic.meshes import make_procedural_mesh

    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False)
    app = create_app(config, estimator=graphed)
    with TestClient(app) as client:
        state = app.state.fp
        assert state.wait_ready(READY_TIMEOUT_S), state.failure
        mesh = io.BytesIO()
        make_procedural_mesh("textured_asym", shape="tee").export(mesh, file_type="ply")
        upload = client.post("/objects", data={"object_id": "tee"}, files={"mesh": ("tee.ply", mesh.getvalue())})
        assert upload.status_code == 201, upload.text
        assert state.track_preparer.wait_idle(WAIT_S)
        assert (state.track_preparer.ok, state.track_preparer.built) == (1, 2 * SIZES)
        runner = state.service._track_runner
        all_three = frozenset(id(e.model) for e in state.objects.entries())
        assert len(all_three) == 3
        assert sorted(k[1] for k in runner.keys() if k[0] == all_three
                      and k[2:4] == tuple(config.max_image_hw)) == list(runner.config.batch_sizes)


class _FailingPrepare(PoseService):
    """A service whose track preparation always fails (the rest is the real service)."""

    def prepare_track(self, obj, hw, iterations=None) -> int:
        raise RuntimeError("capture refused by the test")


@pytest.mark.slow
def test_a_failed_prepare_warns_once_and_is_not_retried(graphed, enc, tmp_path, caplog) -> None:
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False)
    service = _FailingPrepare(graphed, config.service)
    try:
        app = create_app(config, service=service)
        with TestClient(app) as client, caplog.at_level(logging.WARNING, logger="server.track_prepare"):
            state = app.state.fp
            assert state.wait_ready(READY_TIMEOUT_S), state.failure
            register(client, enc)  # the request succeeds whatever the prepare does
            assert state.track_preparer.wait_idle(WAIT_S)
            register(client, enc)
            assert state.track_preparer.wait_idle(WAIT_S)
            assert (state.track_preparer.ok, state.track_preparer.failed) == (0, 1)
            assert _counter(client, "fp_track_prepares_total", '{outcome="failed"}') == 1
        warnings = [r.getMessage() for r in caplog.records if r.name == "server.track_prepare"]
        h, w = FRAME_HW
        assert len(warnings) == 1, warnings
        assert re.match(rf"^track prepare of object 'block' at {w}x{h} \(WxH\) failed, not retried: "
                        r"RuntimeError: capture refused by the test$", warnings[0]), warnings[0]
    finally:
        service.close()


class _GatedPrepare(PoseService):
    """A service whose track preparation parks until the test opens the gate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.opened = threading.Event()

    def prepare_track(self, obj, hw, iterations=None) -> int:
        self.entered.set()
        assert self.opened.wait(WAIT_S), "the test never opened the gate"
        return super().prepare_track(obj, hw, iterations)


@pytest.mark.slow
def test_shutdown_does_not_wait_for_a_running_prepare(graphed, enc, tmp_path, caplog) -> None:
    config = tiny_config(write_objects_dir(tmp_path / "objects"), warmup=False, shutdown_timeout_s=0.2)
    service = _GatedPrepare(graphed, config.service)
    try:
        app = create_app(config, service=service)
        client = _started(app)
        state = app.state.fp
        register(client, enc)
        assert service.entered.wait(WAIT_S)  # the prepare runs (parked) ...
        queued = state.track_preparer.schedule(state.objects.get("block2").model, FRAME_HW)  # ... and one waits
        assert queued is not None and not queued.done()
        with caplog.at_level(logging.WARNING, logger="server.state"):
            client.__exit__(None, None, None)  # returns although the prepare is still parked
        assert state.phase == "stopped" and not service.opened.is_set()
        assert queued.cancelled()
        assert any("a track preparation is still running" in r.getMessage() for r in caplog.records)
        assert state.track_preparer.schedule(state.objects.get("block2").model, OTHER_HW) is None  # closed
    finally:
        service.opened.set()
        service.close()


# -- the preparer alone ----------------------------------------------------------------------------------------------
class _Model:
    def __init__(self, name: str) -> None:
        self.name = name


def test_preparer_keys_are_bounded_and_forgotten() -> None:
    calls: list[tuple[str, tuple[int, int]]] = []

    def prepare(obj: _Model, hw: tuple[int, int]) -> int:
        calls.append((obj.name, hw))
        return 2

    prep = TrackPreparer(prepare, max_keys=2)
    a, b, c = _Model("a"), _Model("b"), _Model("c")
    try:
        for obj in (a, b, a, c):  # a again: known (and now the most recent); c: evicts b, the least recent
            prep.schedule(obj, (4, 6))
        assert prep.wait_idle(WAIT_S)
        assert calls == [("a", (4, 6)), ("b", (4, 6)), ("c", (4, 6))] and (prep.ok, prep.built) == (3, 6)
        assert prep.schedule(a, (4, 6)) is None and prep.key_count == 2
        assert prep.schedule(b, (4, 6)).result(WAIT_S) == 2  # evicted: prepared again
        prep.forget(b)
        assert prep.key_count == 1 and prep.schedule(b, (4, 6)) is not None
    finally:
        assert prep.close(WAIT_S)
