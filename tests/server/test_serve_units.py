"""The parts of the Ray Serve application that need no Ray: settings, the command line, and the seams it
uses in the server (forwarded errors, object reloads, session ids drawn before the session exists)."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foundationpose import validate
from foundationpose.errors import InputError, UnknownObjectError
from foundationpose.synthetic.meshes import make_procedural_mesh
from server.errors import ErrorInfo, ForwardedError, classify, error_response
from server.flow.frames import FrameBytes
from server.flow.steps import check_finite_pose
from server.flow.validation import track_request
from server.objects import ObjectRegistry
from server.phases import Phases
from server.serve.calls import object_ref
from server.serve.cluster import warn_if_deprioritised
from server.serve.settings import ServeSettings, settings_from_args
from server.sessions import SessionStore
from tests.server._helpers import box_object, tiny_config, write_objects_dir

ROOT = Path(__file__).resolve().parents[2]


def test_serve_flags_and_the_server_flags_make_one_settings_object(tmp_path):
    (tmp_path / "fp.toml").write_text("max_queued_requests = 8\n")
    settings = settings_from_args(["--objects", str(tmp_path), "--replicas", "2", "--num-gpus", "0.5",
                                   "--device", "cpu", "--tiny", "--config", str(tmp_path / "fp.toml"), "--port", "8100"])
    assert (settings.replicas, settings.num_gpus, settings.max_queued_requests) == (2, 0.5, 8)
    est = settings.server.estimator
    assert (est.num_hypotheses, est.register_iterations, est.track_iterations) == (4, 1, 1)
    assert settings.server.port == 8100 and settings.server.device == "cpu"
    assert settings.server.ingest_workers == 0  # the ingress serves every port
    cpu_default = settings_from_args(["--objects", str(tmp_path), "--device", "cpu"])
    assert cpu_default.num_gpus == 0.0  # no GPU asked for on a CPU device
    with pytest.raises(SystemExit) as exit_info:
        settings_from_args(["--objects", str(tmp_path), "--replicas", "0"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("field, value, message", [
    ("replicas", 0, r"^replicas must be >= 1, got 0"),
    ("num_gpus", 1.5, r"^num_gpus above 1 must be a whole number, got 1.5"),
    ("num_cpus", -1.0, r"^num_cpus must be >= 0"),
    ("max_queued_requests", 0, r"^max_queued_requests must be >= 1 or -1"),
    ("route_prefix", "api", r"^route_prefix must start with '/'"),
])
def test_settings_validation(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(server=tiny_config(tmp_path), **{field: value})


def test_a_forwarded_error_is_answered_as_it_was_classified_after_pickling():
    info = classify(InputError("depth", "16-bit PNG", "a JPEG"), retry_after_s=2)
    forwarded = pickle.loads(pickle.dumps(ForwardedError(info)))  # InputError itself does not unpickle
    assert classify(forwarded) == info == ErrorInfo(422, "InputError", "depth: expected 16-bit PNG; got a JPEG", "depth")
    response = error_response(forwarded, "rid-1")
    assert response.status_code == 422 and b'"field":"depth"' in response.body
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(InputError("depth", "x", "y")))


def test_load_one_reloads_an_object_changed_on_disk(tmp_path):
    root = write_objects_dir(tmp_path / "objects")
    registry = ObjectRegistry(root)
    registry.load_all()
    old = registry.get("block")
    old_version = object_ref(root, old).version
    (root / "block.ply").unlink()
    make_procedural_mesh("plain_asym").export(root / "block.ply")
    entry = registry.load_one("block")
    assert entry is not old and registry.get("block") is entry
    assert object_ref(root, entry).version != old_version  # what a replica compares with the ingress' version
    fresh = ObjectRegistry(root)
    fresh.load_all()
    np.testing.assert_array_equal(entry.model.mesh.vertices, fresh.get("block").model.mesh.vertices)
    with pytest.raises(UnknownObjectError, match=r"^object_id: no object 'nothing'"):
        registry.load_one("nothing")
    with pytest.raises(InputError, match=r"^object_id: expected"):
        registry.load_one("../etc")


def test_session_ids_can_be_drawn_before_the_session_is_created():
    store = SessionStore(ttl_s=10.0, max_sessions=4)
    sid = store.new_id()
    assert sid not in store
    settings = dict(object_id="block", obj=box_object(), K=np.eye(3), image_hw=(4, 4), cam_from_centred=np.eye(4),
                    pose=np.eye(4), score=1.0)
    session = store.create(**settings, session_id=sid)
    assert session.session_id == sid and store.get(sid) is session and session.replica is None
    with pytest.raises(ValueError, match="already in use"):
        store.create(**settings, session_id=sid)


def test_track_request_is_the_one_decode_and_validate_of_both_servers(tmp_path):
    """flow.validation.track_request (of the local backend: the main port, the ingest hub, the Serve replicas): the
    session-K rule,
    raw frames equal to their PNGs, and the decode/validate phases it books."""
    from foundationpose.synthetic.scenes import synthetic_frame
    from server import codecs

    frame = synthetic_frame(96, 128)
    png = FrameBytes(codecs.encode_rgb_png(frame.rgb), codecs.encode_depth_png_mm(frame.depth_m))
    common = dict(max_hw=(120, 160), limits=validate.InputLimits(max_image_hw=(120, 160)))
    with pytest.raises(InputError, match=r"^K: expected a JSON 3x3 K \(required for stateless tracking\); got nothing"):
        track_request(png, None, np.eye(4), "mesh", session_K=None, session_hw=None, phases=Phases(), **common)
    with pytest.raises(InputError, match=r"^K: expected the K of this 128x96 frame \(the session's K is for 64x48"):
        track_request(png, None, np.eye(4), "centred", session_K=frame.K, session_hw=(48, 64), phases=Phases(),
                      **common)
    phases = Phases()
    request = track_request(png, None, np.eye(4), "centred", session_K=frame.K, session_hw=(96, 128), phases=phases,
                            **common)
    np.testing.assert_array_equal(request.K, frame.K)
    assert set(phases.ms) == {"decode", "validate"}
    raw = FrameBytes(frame.rgb.tobytes(), request.depth.astype("<f4").tobytes(), rgb_shape="96,128,3",
                     depth_shape="96,128", depth_dtype="float32")
    from_raw = track_request(raw, None, np.eye(4), "centred", session_K=frame.K, session_hw=(96, 128),
                             phases=Phases(), **common)
    np.testing.assert_array_equal(from_raw.rgb, request.rgb)
    np.testing.assert_array_equal(from_raw.depth, request.depth)
    bad = np.eye(4)
    bad[0, 3] = np.nan
    with pytest.raises(Exception, match=r"^track produced a pose with NaN or inf entries"):
        check_finite_pose(bad, "track")


def test_serve_help_is_answered_without_importing_torch_or_ray():
    probe = ("import runpy, sys\nsys.argv = ['server.serve', '--help']\n"
             "try:\n    runpy.run_module('server.serve', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('heavy:', sorted(m for m in ('torch', 'ray', 'fastapi') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert "--replicas" in done.stdout and "--objects" in done.stdout
    assert done.stdout.rstrip().endswith("heavy: []"), done.stdout[-300:] + done.stderr[-2000:]


def test_a_replica_below_normal_cpu_priority_says_so_and_how_to_start_ray(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="server.serve.cluster"):
        assert warn_if_deprioritised(15) is True  # Ray's default niceness for its workers
        assert warn_if_deprioritised(0) is False
    (record,) = caplog.records
    assert "nice 15" in record.getMessage() and "RAY_worker_niceness=0 ray start" in record.getMessage()
