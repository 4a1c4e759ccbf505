"""Helpers shared by the server tests (fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from foundationpose.estimator import PoseEstimator
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenes import SyntheticFrame
from server import ServerConfig, codecs
from server.api.stream import uvicorn_ws_options
from tools.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(num_hypotheses=4, register_iterations=1, track_iterations=1)
MAX_IMAGE_HW = (120, 160)
FRAME_HW = (96, 128)
# The safety net of every wait that guards a test's set-up (an app's start-up, ingest workers connecting, uvicorn
# bound): each returns as soon as its state holds (normally < 2 s); the limit only bounds a hang. In the full suite on
# a loaded 2-core machine a set-up took over 30 s (Ray, worker processes and the tests' own servers share the cores).
SETUP_WAIT_S = 600.0
READY_TIMEOUT_S = SETUP_WAIT_S  # an app's start-up (state.wait_ready), and other waits for a state of the tests


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = SETUP_WAIT_S, poll_s: float = 0.01) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` (the state awaited) past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(poll_s)


def assert_ready(state, what: str = "the app's start-up", timeout: float = SETUP_WAIT_S) -> None:
    """Wait for an app's start-up (``state``: ``app.state.fp``) to end ready; fail naming ``what`` and why."""
    if not state.wait_ready(timeout):
        reason = state.failure or f"still {state.phase!r} after {timeout:.0f} s"
        raise AssertionError(f"not ready: {what} ({reason})")


@functools.cache
def box_object():
    """A 6 x 6 x 10 cm box, loaded once: the object of sessions made without a server."""
    import trimesh

    from foundationpose.mesh import load_object

    return load_object(trimesh.creation.box(extents=(0.06, 0.06, 0.10)), name="box")


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tiny_config(objects_dir: Path, **overrides) -> ServerConfig:
    # recovery off: these servers run random weights, so every session is lost and each track would re-register
    settings = dict(objects_dir=objects_dir, max_image_hw=MAX_IMAGE_HW, track_max_batch=8, recovery="off", **TINY)
    settings.update(overrides)
    return ServerConfig.from_settings(**settings)


@contextlib.contextmanager
def live_uvicorn(app, **uvicorn_options) -> Iterator[str]:
    """``host:port`` of ``app`` served by uvicorn on 127.0.0.1 in a thread, with the options of
    ``python -m server`` unless overridden; stopped (lifespan shutdown included) at the end."""
    import uvicorn

    port = free_port()
    options = {"lifespan": "on", **uvicorn_ws_options(app.state.fp.config.max_upload_bytes), **uvicorn_options}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, name="test-uvicorn")
    thread.start()
    try:
        assert_ready(app.state.fp, "the app served by uvicorn")
        # ready can come before uvicorn has bound its socket
        wait_for(lambda: server.started or not thread.is_alive(), "uvicorn listening on its port")
        assert server.started, "uvicorn's thread ended before it listened (its log says why)"
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(READY_TIMEOUT_S)
    assert not thread.is_alive()


@contextlib.contextmanager
def local_ray_serve() -> Iterator[str]:
    """A local Ray (2 CPUs, no dashboard) with Serve's HTTP proxy on a free 127.0.0.1 port: the proxy's URL; Serve
    and Ray are shut down at the end. Applications are run on it with :func:`serve_app`."""
    import os

    import ray
    from ray import serve

    from server.serve.cluster import init_ray

    # the replicas' worker processes import this checkout (they inherit the environment of ray.init)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved) if p)
    # Serve's controller gives its HTTP proxy 5 s to answer the readiness check and kills it after that; on a
    # loaded 2-core machine the proxy's process can take longer to start (serve.start then fails with "killed
    # by ray.kill"). The controller inherits these from ray.init's environment.
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
    init_ray(None, num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 * 1024, log_to_driver=False)
    if saved is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = saved
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def serve_app(serve_url: str, settings) -> Iterator[str]:
    """The Ray Serve application of ``settings`` (a ServeSettings) on the Serve of :func:`local_ray_serve` at
    ``serve_url``, routed at ``/``: that URL; the application (its replicas) is deleted at the end, so the next
    one starts from nothing but the running Ray and proxy."""
    from ray import serve

    from server.serve.app import build_app

    serve.run(build_app(settings), name=settings.app_name, route_prefix="/", blocking=False)
    try:
        yield serve_url
    finally:
        serve.delete(settings.app_name)


def write_objects_dir(root: Path) -> Path:
    """An objects dir with the procedural block as a top-level PLY (id "block") and a folder OBJ (id "block2")."""
    root.mkdir(parents=True, exist_ok=True)
    mesh = make_procedural_mesh("vertex_color_asym")
    mesh.export(root / "block.ply")
    (root / "block2").mkdir()
    make_procedural_mesh("plain_asym").export(root / "block2" / "model.obj")
    return root


@dataclass
class Encoded:
    """A synthetic frame and its uploads."""

    frame: SyntheticFrame
    rgb: bytes
    depth_png: bytes
    depth_npy: bytes
    mask: bytes

    @property
    def K_json(self) -> str:
        return json.dumps(self.frame.K.tolist())

    def register_files(self) -> dict:
        return {"rgb": ("rgb.png", self.rgb, "image/png"), "depth": ("depth.png", self.depth_png, "image/png"),
                "mask": ("mask.png", self.mask, "image/png")}

    def track_files(self) -> dict:
        return {"rgb": ("rgb.png", self.rgb, "image/png"), "depth": ("depth.png", self.depth_png, "image/png")}


def encode(frame: SyntheticFrame) -> Encoded:
    return Encoded(frame, codecs.encode_rgb_png(frame.rgb), codecs.encode_depth_png_mm(frame.depth_m),
                   codecs.encode_depth_npy(frame.depth_m), codecs.encode_mask_png(frame.mask))


def register(client: TestClient, enc: Encoded, object_id: str = "block") -> dict:
    response = client.post("/register", data={"object_id": object_id, "K": enc.K_json}, files=enc.register_files())
    assert response.status_code == 200, response.text
    return response.json()


def assert_rigid(pose: list[list[float]]) -> np.ndarray:
    """The pose as an array, after checking it is a finite rigid transform."""
    T = np.asarray(pose, dtype=np.float64)
    assert T.shape == (4, 4)
    assert np.isfinite(T).all()
    np.testing.assert_allclose(T[3], [0, 0, 0, 1])
    R = T[:3, :3]
    np.testing.assert_allclose(R.T @ R, np.eye(3), atol=1e-4)  # float32 tracking state, re-orthonormal to ~1e-6
    assert abs(np.linalg.det(R) - 1) < 1e-4
    return T


def assert_error(response, status: int, type_: str, field: str | None = None, match: str | None = None) -> dict:
    """Check the error envelope: status, type, field, anchored message prefix, request id, no traceback."""
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["type"] == type_, body
    if field is not None:
        assert body.get("field") == field, body
    if match is not None:
        assert re.match(match, body["message"]), body["message"]
    assert body["request_id"] == response.headers["x-request-id"]
    assert "Traceback" not in response.text
    return body


class GatedCore:
    """An inference core that parks every call until the test opens the gate. It has no ``capturable_forward``, so
    the step runners call its ``infer`` (where the gate is) instead of the inner core's forward."""

    capturable_forward = None

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def infer(self, *args, **kwargs):
        self._park()
        return self.inner.infer(*args, **kwargs)

    def _park(self) -> None:
        self.entered.set()
        assert self.opened.wait(30), "the test never opened the gate"

    def rearm(self) -> None:
        self.opened.clear()
        self.entered.clear()


def gated_estimator(estimator: PoseEstimator, core: str) -> tuple[PoseEstimator, GatedCore]:
    """A copy of ``estimator`` whose network core ``core`` (``refiner``, ``scorer`` or ``track_refiner``) parks
    every call at a :class:`GatedCore` (closed until the test opens it), and that gate."""
    gate = GatedCore(getattr(estimator.networks, core))
    gated = PoseEstimator(dataclasses.replace(estimator.networks, **{core: gate}), estimator.renderer,
                          device=estimator.device, config=estimator.config)
    return gated, gate
