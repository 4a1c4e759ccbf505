"""Codecs, the error table, the metrics format, the config and the CLI, without an app."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError
from PIL import Image
from starlette.exceptions import HTTPException

from deploy_core.errors import (
    BrokenPipelineError,
    BusyError,
    CapacityError,
    ClosedError,
    DeadlineError,
    EngineError,
)
from foundationpose.errors import InputError, NonFinitePoseError, UnknownObjectError, UnknownSessionError
from foundationpose.estimator import EstimatorConfig
from foundationpose.service import ServiceConfig
from foundationpose.validate import validate_pose
from server import codecs, errors
from server.auth import bearer_token, key_matches
from server.cli import config_from_args
from server.config import ServerConfig, default_ingest_workers, parse_image_size
from server.flow.inputs import frame_number, parse_K, parse_pose
from server.metrics import Family, Metrics, format_families
from server.phases import Phases


# -- codecs ----------------------------------------------------------------------------------
def test_depth_png_round_trip_in_millimetres():
    depth = np.array([[0.0, 0.4567], [1.0, 65.535]], dtype=np.float32)
    decoded = codecs.decode_depth(codecs.encode_depth_png_mm(depth), (10, 10))
    assert decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, [[0.0, 0.457], [1.0, 65.535]], atol=1e-6)  # mm rounding


def test_depth_npy_round_trip_in_metres_and_bad_headers():
    depth = np.random.default_rng(0).uniform(0.3, 2.0, (4, 5)).astype(np.float32)
    np.testing.assert_array_equal(codecs.decode_depth(codecs.encode_depth_npy(depth), (10, 10)), depth)
    with pytest.raises(InputError, match=r"^depth: expected float32 metres \(H, W\); got an .npy of shape \(2, 3, 4\)"):
        codecs.decode_depth(codecs.encode_depth_npy(np.zeros((2, 3, 4))), (10, 10))
    with pytest.raises(InputError, match=r"^depth: .*corrupt .npy header"):
        codecs.decode_depth(b"\x93NUMPY\x01\x00garbage", (10, 10))
    objects = io.BytesIO()
    np.save(objects, np.array([[None, 1]], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match=r"^depth: .*Python objects"):
        codecs.decode_depth(objects.getvalue(), (10, 10))


def test_rgb_modes_are_converted_to_rgb_order():
    rgba = np.zeros((3, 4, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 10
    out = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(out, format="PNG")
    rgb = codecs.decode_rgb(out.getvalue(), (10, 10))
    assert rgb.shape == (3, 4, 3) and rgb.flags.writeable
    assert (rgb[..., 0] == 200).all() and (rgb[..., 1:] == 0).all()  # red stays in channel 0


def test_mask_bit_depths():
    mask = np.zeros((4, 6), bool)
    mask[1:3, 2:5] = True
    for array in (mask, mask.astype(np.uint8) * 7, mask.astype(np.uint16) * 300):
        out = io.BytesIO()
        Image.fromarray(array).save(out, format="PNG")
        np.testing.assert_array_equal(codecs.decode_mask(out.getvalue(), (10, 10)) > 0, mask)


def test_pose_and_K_parsing():
    np.testing.assert_array_equal(parse_pose("[[1,0,0,0.1],[0,1,0,0],[0,0,1,0.5],[0,0,0,1]]")[:3, 3], [0.1, 0, 0.5])
    bad = parse_pose("[[1,0,0,0],[0,1,0,0],[0,0,1,0],[0,0,1,1]]")  # JSON only: values are the request's
    with pytest.raises(InputError, match=r"^pose: expected bottom row"):
        validate_pose(bad)
    with pytest.raises(InputError, match=r"^K: expected .*got nothing"):
        parse_K("  ")
    with pytest.raises(InputError, match=r"^K: expected .*characters of text"):
        parse_K("[" * 5000)
    with pytest.raises(InputError, match=r"^K: expected .*rows of different lengths"):
        parse_K("[[1, 0], [0, 1, 0], [0, 0, 1]]")
    assert parse_K([[500, 0, 64], [0, 500, 48], [0, 0, 1]]).dtype == np.float64  # a header's nested lists


@pytest.mark.parametrize("entry", ["1" * 400, "1" * 5000, "-" + "9" * 400, "1e400", "NaN", "-Infinity"])
def test_numbers_float64_cannot_hold_are_refused_naming_the_field(entry):
    """An integer of hundreds or thousands of digits, a float beyond float64's range, NaN or inf: 422 naming the
    field, from JSON text (a form field) and from a header's parsed lists alike, never an overflow or a 500."""
    text = f"[[{entry}, 0, 64], [0, 500, 48], [0, 0, 1]]"
    with pytest.raises(InputError, match=r"^K: expected "):
        parse_K(text)
    with pytest.raises(InputError, match=r"^pose: expected "):
        parse_pose(text)
    try:
        value = json.loads(text)
    except ValueError:
        return  # beyond Python's digit limit: only ever text (a header refuses it as a whole: test_raw_frames)
    with pytest.raises(InputError, match=r"^K: expected "):
        parse_K(value)


@pytest.mark.parametrize("number", [2**63, -(2**63) - 1, 2**64, 10**400, 1.5, "7", True])
def test_a_stream_frame_number_is_a_64_bit_integer(number):
    with pytest.raises(InputError, match=r"^frame: expected an integer frame number"):
        frame_number(number)
    assert frame_number(2**63 - 1) == 2**63 - 1 and frame_number(-(2**63)) == -(2**63) and frame_number(None) is None


# -- the error table ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status", "type_", "field"),
    [
        (InputError("depth", "x", "y"), 422, "InputError", "depth"),
        (CapacityError("too big"), 413, "CapacityError", None),
        (errors.ImageTooLargeError("rgb", "rgb: too big"), 413, "ImageTooLargeError", "rgb"),
        (UnknownObjectError("object_id: no"), 404, "UnknownObjectError", "object_id"),
        (UnknownSessionError("session_id: no"), 404, "UnknownSessionError", "session_id"),
        (BusyError("full"), 503, "BusyError", None),
        (ClosedError("closed"), 503, "ClosedError", None),
        (BrokenPipelineError("dead"), 503, "BrokenPipelineError", None),
        (errors.NotReadyError("wait"), 503, "NotReadyError", None),
        (errors.AuthError("no key"), 401, "AuthError", None),
        (errors.PayloadTooLargeError("big"), 413, "PayloadTooLargeError", "body"),
        (errors.ConflictError("taken", field="object_id"), 409, "ConflictError", "object_id"),
        (errors.RequestTimeoutError("slow"), 504, "RequestTimeoutError", None),
        (errors.PoseDivergedError("nan"), 500, "PoseDivergedError", None),
        (NonFinitePoseError("the refined pose has 3 NaN or inf entries"), 500, "PoseDivergedError", None),
        (DeadlineError("dropped before render_0"), 504, "RequestTimeoutError", None),
        (HTTPException(405, "Method Not Allowed"), 405, "HTTPError", None),
        (RequestValidationError([{"loc": ("body", "rgb"), "msg": "Field required", "type": "missing"}]),
         422, "InputError", "rgb"),
        (EngineError("tensorrt blew up"), 500, "InternalError", None),
        (RuntimeError("bug"), 500, "InternalError", None),
    ],
)
def test_every_error_maps_to_one_answer(exc, status, type_, field):
    info = errors.classify(exc, retry_after_s=3)
    assert (info.status, info.type, info.field) == (status, type_, field)
    assert info.internal == (type_ == "InternalError")
    if type_ in ("BusyError", "ClosedError", "NotReadyError"):
        assert ("Retry-After", "3") in info.headers


def test_internal_errors_hide_their_message():
    response = errors.error_response(RuntimeError("password=hunter2"), "rid-1")
    assert response.status_code == 500 and b"hunter2" not in response.body and b"rid-1" in response.body


# -- metrics text -------------------------------------------------------------------------------
def test_exposition_format_histograms_and_escaping():
    m = Metrics(buckets_s=(0.1, 1.0))
    m.request_started()
    m.request_finished("/track", "POST", 200, 0.05)
    m.request_started()
    m.request_finished("/track", "POST", 200, 0.5)
    text = m.render([Family("fp_x", "gauge", 'a "quoted" help').add(1.5, lane='re"g\\ister')])
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/track",method="POST",status="200",le="0.1"} 1' in text
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/track",method="POST",status="200",le="1"} 2' in text
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/track",method="POST",status="200",le="+Inf"} 2' in text
    assert 'fp_http_request_duration_seconds_count{endpoint="/track",method="POST",status="200"} 2' in text
    assert 'fp_x{lane="re\\"g\\\\ister"} 1.5' in text
    assert "fp_http_requests_in_flight 0\n" in text
    assert format_families([Family("fp_nan", "gauge", "h").add(float("nan"))]).endswith("fp_nan NaN\n")



def test_histogram_buckets_are_le_bounds_at_the_edges():
    """A value equal to a bound counts in that bound's bucket (Prometheus' ``le``); above every bound or NaN only in
    +Inf (and in count)."""
    m = Metrics(buckets_s=(0.1, 1.0))
    for seconds in (0.1, 0.100001, 1.0, 7.0, float("nan"), 0.0):
        m.request_started()
        m.request_finished("/t", "GET", 200, seconds)
    text = m.render([])
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/t",method="GET",status="200",le="0.1"} 2' in text
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/t",method="GET",status="200",le="1"} 4' in text
    assert 'fp_http_request_duration_seconds_bucket{endpoint="/t",method="GET",status="200",le="+Inf"} 6' in text


def test_phases_become_timing_lines_only_when_the_timing_log_is_on(caplog):
    phases = Phases(request_id="rid-7")
    phases.add("decode", 1.5)
    phases.add("pipeline", 3.25)
    with caplog.at_level(logging.WARNING, logger="deploy_core.timing"):
        phases.log("/track")
    assert [r for r in caplog.records if r.name == "deploy_core.timing"] == []
    with caplog.at_level(logging.DEBUG, logger="deploy_core.timing"):
        phases.log("/track")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "deploy_core.timing"]
    assert [(d["stage"], d["package_id"], d["wall_ms"], d["endpoint"]) for d in lines] == [
        ("decode", "rid-7", 1.5, "/track"), ("pipeline", "rid-7", 3.25, "/track")]

# -- config, CLI and auth helpers -----------------------------------------------------------------
def test_cli_flags_override_environment_which_overrides_defaults(tmp_path):
    env = {"FP_OBJECTS": str(tmp_path), "FP_PORT": "9001", "FP_API_KEY": "key-XYZZY", "FP_MAX_IMAGE": "640x480",
           "FP_HYPOTHESES": "8"}
    config, level = config_from_args(["--port", "9002", "--max-upload-mb", "1.5", "--track-iterations", "3"], env)
    assert config.port == 9002 and config.api_key == "key-XYZZY" and config.max_image_hw == (480, 640)
    assert config.estimator.num_hypotheses == 8 and config.warmup is True and level == "INFO"
    assert config.estimator.track_iterations == 3 and config.service.max_image_hw == (480, 640)
    assert config.max_upload_bytes == int(1.5 * 1024 * 1024)
    assert "XYZZY" not in repr(config)  # the key never shows in logs of the config
    assert config.compile_cache is None and config.ingest_workers == 0
    cached, _ = config_from_args(["--compile-cache", str(tmp_path / "c.bin"), "--ingest-workers", "4"],
                                 {**env, "FP_INGEST_PORT": "7001"})
    assert cached.compile_cache == tmp_path / "c.bin"
    assert (cached.ingest_workers, cached.ingest_port) == (4, 7001)
    assert config_from_args([], {**env, "FP_COMPILE_CACHE": str(tmp_path / "e.bin")})[0].compile_cache == tmp_path / "e.bin"
    eager, _ = config_from_args(["--eager", "--no-compile"], env)
    assert (eager.eager, eager.compile, config.eager, config.compile) == (True, False, False, True)
    assert eager.runtime().capture is False and eager.runtime().compile is False
    with pytest.raises(SystemExit):
        config_from_args([], {})  # --objects is required
    with pytest.raises(SystemExit):
        config_from_args(["--objects", str(tmp_path), "--max-image", "big"], {})
    with pytest.raises(SystemExit):
        config_from_args(["--objects", str(tmp_path)], {"FP_PORT": "eighty"})  # a variable that does not parse


def test_the_settings_file_reaches_the_library_configs(tmp_path):
    path = tmp_path / "fp.toml"
    path.write_text("warmup = false\nframes_in_flight = 3\nmax_translation_m = 12\ningest_slots = 16\n")
    config, _ = config_from_args(["--objects", str(tmp_path), "--config", str(path), "--ingest-workers", "2"], {})
    assert config.warmup is False and config.ingest_slots == 16 and config.ingest_workers == 2
    assert config.estimator.max_translation_m == 12.0 and config.service.frames_in_flight == 3
    same, _ = config_from_args(["--objects", str(tmp_path)], {"FP_CONFIG": str(path)})  # its variable
    assert (same.warmup, same.ingest_slots) == (False, 16)
    assert config.service.track_batches_in_flight == ServiceConfig().track_batches_in_flight  # the library's


def test_ingest_workers_default_to_none_on_a_cpu_and_half_the_cores_on_cuda(monkeypatch):
    assert ServerConfig(objects_dir=".", device="cpu").ingest_workers == 0
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_ingest_workers("cuda") == 8  # the measured winner on the H200's 16-core host
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert default_ingest_workers("cuda:0") == 2
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert default_ingest_workers("cuda") == 8


def test_config_validation():
    assert parse_image_size("1920x1080") == (1080, 1920)
    with pytest.raises(ValueError, match="max_upload_bytes must be > 0"):
        ServerConfig(objects_dir=".", max_upload_bytes=0)
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerConfig(objects_dir=".", api_key=" ")
    with pytest.raises(ValueError, match="num_hypotheses"):
        ServerConfig(objects_dir=".", num_hypotheses=0)
    with pytest.raises(TypeError, match="hypotheses"):
        ServerConfig(objects_dir=".", hypotheses=4)
    config = ServerConfig(objects_dir=".", device="cpu", register_iterations=3, track_max_batch=4, num_hypotheses=16)
    assert config.estimator == EstimatorConfig(register_iterations=3, num_hypotheses=16)
    assert config.service == ServiceConfig(track_max_batch=4, max_image_hw=(1080, 1920))
    small = ServerConfig(objects_dir=".", device="cpu")
    assert (small.hypotheses, small.iterations) == (16, 2) and "small default config" in small.settings_note


def test_bearer_parsing_and_constant_time_compare():
    assert bearer_token("Bearer abc ") == "abc" and bearer_token("bearer abc") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer") is None
    assert key_matches("abc", "abc") and not key_matches("abd", "abc") and not key_matches(None, "abc")


# -- awaiting a pipeline future ------------------------------------------------------------------
def _result_of(future, timeout_s: float = 30.0):
    from server.flow.backend import result_of

    return result_of(future, timeout_s)


def test_result_of_gives_a_result_or_the_error_set_by_another_thread():
    import asyncio
    import threading
    from concurrent.futures import Future

    async def go():
        done_already: Future = Future()
        done_already.set_result("inline")
        ok, failed = Future(), Future()
        threading.Thread(target=lambda: (ok.set_result(7), failed.set_exception(InputError("rgb", "x", "y")))).start()
        first = await _result_of(done_already)
        second = await _result_of(ok)
        with pytest.raises(InputError, match="rgb"):
            await _result_of(failed)
        return first, second

    assert asyncio.run(go()) == ("inline", 7)


def test_result_of_times_out_as_504_and_a_cancelled_request_leaves_the_package_alone():
    import asyncio
    from concurrent.futures import Future

    async def go():
        never: Future = Future()
        with pytest.raises(errors.RequestTimeoutError, match=r"^no pose within 0.05 s"):
            await _result_of(never, timeout_s=0.05)
        running: Future = Future()
        task = asyncio.ensure_future(_result_of(running))
        await asyncio.sleep(0)  # the task now waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        running.set_result("late")  # the package finishes after its request went: dropped quietly
        await asyncio.sleep(0)
        return never.cancelled(), running.cancelled(), running.result()

    assert asyncio.run(go()) == (False, False, "late")


def test_jsonio_round_trips_floats_exactly_and_writes_numpy_numbers():
    from server import jsonio

    values = {"pose": [[0.1, 1e-05, -2.5e-300, 1 / 3]], "n": np.float64(0.2), "i": np.int64(3), "k": "é"}
    text = jsonio.dumps(values)
    assert isinstance(text, bytes) and b" " not in text  # compact
    back = json.loads(text)  # the standard library reads it back to the same floats, bit for bit
    assert back == {"pose": [[0.1, 1e-05, -2.5e-300, 1 / 3]], "n": 0.2, "i": 3, "k": "é"}
    assert jsonio.loads(text) == back
    assert jsonio.dumps({"t": float("nan")}) == b'{"t":null}'  # standard JSON has no NaN
    with pytest.raises(ValueError):
        jsonio.loads(b"{not json")
    with pytest.raises(TypeError):
        jsonio.dumps({"x": object()})
