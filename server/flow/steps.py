"""The session steps of every transport: register, track (of a session or stateless) and a stream's start.

Each step runs on a :class:`Host` (what the flow needs of its server: the objects, the sessions, admission and a
:class:`~server.flow.backend.PoseBackend`): the single-process server's :class:`~server.state.ServerState`, or the
Ray Serve ingress. The rules live here once:

* a register is admitted before its images are read or decoded (a refused one costs no decode), creates the
  session when the pose is finite and the object still exists; a register that names a session re-registers it
  in place (the client's mask forces a new pose, in the session's order with its tracks);
* a session's frame goes through :mod:`foundationpose.session_step`: its plan (a lost session's frame first tries
  a register on a recovery candidate found in its depth, :attr:`TrackStart.recovery`), and the answer of its
  result by the session's :class:`~foundationpose.session_trust.SessionTrust` (its state: tracking, uncertain,
  lost, recovering; the pose shown for a symmetric object);
* track requests pass the track admission (one running + ``session_waiting`` per session, else 429; a bounded
  total, else 503); those of one session hold its ``asyncio.Lock`` from lookup to update, so they apply in arrival
  order, and the session changes only when a step succeeds, and only from the frame it was computed for (a step
  retried on another Serve replica is idempotent);
* a start opens a session from a given pose and K, checked as a stateless track's (no pipeline work).

:func:`answer_of` turns a step's body into the answer's bytes (with the host phases in ``timings_ms`` and
``Server-Timing``), the same for the main port, the ingest hub and the Serve ingress.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from starlette.responses import Response

from foundationpose import validate
from foundationpose.errors import InputError, UnknownObjectError
from foundationpose.session_step import answer, plan_frame
from foundationpose.validity import MEASUREMENTS
from server import jsonio
from server.errors import PoseDivergedError, classify, error_object
from server.flow.backend import PoseBackend, PoseResult, SubmitGroup, TrackStart
from server.flow.frames import FrameBytes
from server.flow.inputs import SessionsTrackInput, StartInput, TrackInput
from server.phases import Phases, server_timing
from server.warmup import warming

__all__ = ["SERVED_BY_HEADER", "Host", "PoseAnswer", "answer_of", "check_finite_pose", "pose_fields", "pose_json",
           "register", "reregister", "split_timings", "start", "track", "track_session", "track_sessions",
           "track_stateless"]

log = logging.getLogger(__name__)

SERVED_BY_HEADER = "X-Served-By"  # the Serve pose replica that computed an answer
_NOT_STAGES = ("batch", "total", "stage_queues", "batcher_wait")  # timings_ms keys that are not pipeline stages


class Host(Protocol):
    """What the request flow and the routes need of a server (``config`` is its ServerConfig, ``metrics`` its
    :class:`~server.metrics.Metrics`, ``sessions`` its :class:`~server.sessions.SessionStore`, ``objects`` its
    :class:`~server.objects.ObjectRegistry`, ``streams`` its :class:`~server.metrics.StreamCounters`)."""

    config: Any
    metrics: Any
    sessions: Any
    objects: Any
    streams: Any
    backend: PoseBackend

    def require_ready(self) -> None:
        """NotReadyError (503) unless the server serves pose and object requests."""

    def admit_register(self, endpoint: str) -> AbstractContextManager[Any]:
        """A register's admission ticket (OverloadedError when full), held until its pose is computed."""

    def admit_track(self, endpoint: str, key: str | None) -> AbstractContextManager[Any]:
        """A track's admission ticket (SessionBusyError / OverloadedError), held until it is answered."""


def check_finite_pose(pose: np.ndarray, what: str) -> None:
    """PoseDivergedError (500, nothing stored) when the pipeline returned NaN or inf entries."""
    if not np.isfinite(pose).all():
        raise PoseDivergedError(f"{what} produced a pose with NaN or inf entries; nothing was stored")


def pose_json(pose: np.ndarray) -> list[list[float]]:
    """A 4x4 pose as JSON rows of float64."""
    return np.asarray(pose, dtype=np.float64).tolist()


def pose_fields(result: PoseResult) -> dict[str, Any]:
    """The pose of an answer and what it is worth: ``pose``, ``valid`` (the session reports it valid; stateless: the
    frame's own verdict), ``confidence`` in [0, 1], ``state`` (None stateless), ``source``, the validity
    ``measurements`` by name (None where not measured or not finite) and ``symmetry``, what the pose is defined up
    to and what was found (:meth:`server.objects.ObjectEntry.symmetry_answer`; None where the flow set none)."""
    validity, report = result.validity, result.report
    if report is not None:
        valid = report.pose_valid
    else:
        valid = validity is not None and bool(validity.valid)
    measurements = None
    if validity is not None:
        measurements = {name: (float(v) if np.isfinite(v) else None)
                        for name, v in zip(MEASUREMENTS, validity.measurements.tolist(), strict=True)}
    return {"pose": pose_json(result.cam_from_mesh), "valid": bool(valid),
            "confidence": None if validity is None else round(float(validity.confidence), 6),
            "state": None if report is None else report.state.value, "source": result.source,
            "measurements": measurements, "symmetry": result.symmetry}


def _of_object(result: PoseResult, entry: Any) -> PoseResult:
    """``result`` with its object's symmetries as the answer states them (the object's entry)."""
    return dataclasses.replace(result, symmetry=entry.symmetry_answer())


def _judged(session: Any, result: PoseResult) -> PoseResult:
    """``result`` as its session answers it (:func:`foundationpose.session_step.answer`: the pose the one shown)."""
    answered = answer(session.trust, result, result.source)
    return dataclasses.replace(result, cam_from_mesh=answered.cam_from_mesh, report=answered.report)


# -- the steps ------------------------------------------------------------------------------------------------------
async def register(host: Host, endpoint: str, object_id: str, K: np.ndarray, phases: Phases,
                   read_frame: Callable[[], Awaitable[FrameBytes]], *, session_id: str | None = None,
                   box: tuple[int, int, int, int] | None = None) -> tuple[Any, PoseResult]:
    """Register ``object_id`` in the frame ``read_frame`` returns (called once admitted; laps ``parse``): the new
    session and the result. session_id: re-register that session instead (:func:`reregister`). box: the object
    shown by a box instead of the frame's mask."""
    host.require_ready()
    if session_id is not None:
        return await reregister(host, endpoint, host.sessions.get(session_id), object_id, K, phases, read_frame,
                                box=box)
    entry = host.objects.get(object_id)
    with host.admit_register(endpoint):  # before the decode: a refused register costs no decode
        frame = await read_frame()
        phases.lap("parse")
        session_id = host.sessions.new_id()  # drawn first: a Serve router sees it, the logs name it
        result = await host.backend.register(entry, frame, K, phases, session_id=session_id, box=box)
    check_finite_pose(result.cam_from_mesh, "register")
    result = _of_object(result, entry)
    if not host.objects.is_current(entry):
        raise UnknownObjectError(f"object_id: {object_id!r} was deleted while the request ran")
    session = host.sessions.create(object_id=object_id, obj=entry.model, K=result.K, image_hw=result.image_hw,
                                   cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                                   score=np.nan if result.score is None else result.score, session_id=session_id)
    session.replica = result.replica
    result = _judged(session, result)
    session.pose = result.cam_from_mesh
    return session, result


async def reregister(host: Host, endpoint: str, session: Any, object_id: str, K: np.ndarray, phases: Phases,
                     read_frame: Callable[[], Awaitable[FrameBytes]], *,
                     box: tuple[int, int, int, int] | None = None) -> tuple[Any, PoseResult]:
    """Register ``session``'s object in a frame with the client's mask (or box), in the session's order with its tracks:
    the session keeps its id, and its pose, K and image size become this frame's (``object_id`` must be the
    session's)."""
    if object_id != session.object_id:
        raise InputError("object_id", f"the session's object {session.object_id!r} (or no session_id)",
                         repr(object_id))
    sessions = host.sessions
    with host.admit_register(endpoint):
        frame = await read_frame()
        phases.lap("parse")
        async with session.lock:  # in arrival order with the session's tracks
            phases.lap("queue")
            if not sessions.is_live(session):
                sessions.get(session.session_id)  # raises UnknownSessionError (deleted or expired meanwhile)
            entry = host.objects.get(object_id)
            result = await host.backend.register(entry, frame, K, phases, session_id=session.session_id, box=box)
            check_finite_pose(result.cam_from_mesh, "register")
            result = _of_object(result, entry)
            result = _judged(session, result)
            if sessions.advance(session, cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                                image_hw=result.image_hw, K=result.K):
                session.score = np.nan if result.score is None else result.score
                session.replica = result.replica
    return session, result


async def track_session(host: Host, endpoint: str, session: Any, frame: FrameBytes, K: np.ndarray | None,
                        phases: Phases, *, in_loop: bool = False,
                        group: SubmitGroup | None = None) -> tuple[PoseResult, int]:
    """One track step of ``session``: (result, the session's frame count it answers). group: the step shares a
    batch with others (:func:`track_sessions`)."""
    sessions = host.sessions
    with host.admit_track(endpoint, session.session_id):
        async with session.lock:  # FIFO: frames of one session apply in arrival order
            phases.lap("queue")
            if not sessions.is_live(session):
                sessions.get(session.session_id)  # raises UnknownSessionError (deleted or expired meanwhile)
            entry = host.objects.get(session.object_id)
            frame_no = session.frames + 1
            # The warm-up's sessions never recover: its object is not the weights' (trained weights judge it lost
            # after three frames), and its later frames must run the track paths they warm, not recovery registers.
            recovery = None if warming() else plan_frame(session.trust)
            start = TrackStart(session.cam_from_centred.astype(np.float64), "centred", session_K=session.K,
                               session_hw=session.image_hw, key=session.session_id, frame_no=frame_no,
                               prefer_replica=getattr(session, "replica", None), recovery=recovery)
            result = await host.backend.track(entry, frame, K, start, phases, in_loop=in_loop, group=group)
            check_finite_pose(result.cam_from_mesh, "track")
            result = _of_object(result, entry)
            if session.frames == frame_no - 1 and sessions.is_live(session):
                result = _judged(session, result)
            if session.frames == frame_no - 1 and sessions.advance(
                    session, cam_from_centred=result.cam_from_centred, pose=result.cam_from_mesh,
                    image_hw=result.image_hw):
                session.replica = result.replica
            else:
                log.info("session %s ended while its track request ran; the result is returned, not stored",
                         session.session_id)
            return result, session.frames if sessions.is_live(session) else frame_no


async def track_stateless(host: Host, endpoint: str, object_id: str, frame: FrameBytes, K: np.ndarray | None,
                          pose: np.ndarray, phases: Phases, *, in_loop: bool = False) -> PoseResult:
    """One track step from a given ``pose`` (4x4 cam_from_mesh); no session."""
    entry = host.objects.get(object_id)
    with host.admit_track(endpoint, None):
        phases.lap("queue")
        result = await host.backend.track(entry, frame, K, TrackStart(pose, "mesh"), phases, in_loop=in_loop)
    check_finite_pose(result.cam_from_mesh, "track")
    return _of_object(result, entry)


async def track(host: Host, endpoint: str, request: TrackInput, phases: Phases, *,
                in_loop: bool = False) -> tuple[dict[str, Any], PoseResult]:
    """A track request of any HTTP form (multipart, binary body, an ingest worker's frame): the answer's body and
    the result. in_loop: the frame needs no decode nor staging copy (see :class:`~server.flow.backend.LocalBackend`)."""
    host.require_ready()
    if request.session_id is not None:
        session = host.sessions.get(request.session_id)
        result, frames = await track_session(host, endpoint, session, request.frame, request.K, phases,
                                             in_loop=in_loop)
        return {"session_id": session.session_id, "object_id": session.object_id, **pose_fields(result),
                "frame": frames}, result
    result = await track_stateless(host, endpoint, request.object_id, request.frame, request.K, request.pose, phases,
                                   in_loop=in_loop)
    return {"session_id": None, "object_id": request.object_id, **pose_fields(result), "frame": None}, result


async def track_sessions(host: Host, endpoint: str, request: SessionsTrackInput,
                         phases: Phases) -> tuple[dict[str, Any], list[PoseResult]]:
    """Several sessions into one frame: the answer's body (``sessions``: per session, in the request's order, its
    track answer or its ``error``) and the results that succeeded.

    Every session is looked up first (an unknown one refuses the whole request: nothing is tracked), and the
    frame decoded once (:meth:`~server.flow.backend.PoseBackend.shared_frame`; a bad image refuses it too). Then the
    sessions' steps are submitted together, each as :func:`track_session` (its admission, its order with the
    session's other requests, its own ``timings_ms``) into one batch (the batcher holds it open until each was
    submitted or refused, at most :data:`~foundationpose.service.pose_service.GROUP_HOLD_S`): one track step per object; one after
    another where the backend says so (:attr:`~server.flow.backend.SubmitGroup.concurrent`, Ray Serve). One
    session's failure (busy, a timeout, a diverged pose) is its entry's ``error`` and ``status``; the others are
    answered."""
    host.require_ready()
    sessions = [host.sessions.get(session_id) for session_id in request.session_ids]
    frame = await host.backend.shared_frame(request.frame, phases)
    group = host.backend.submit_group(len(sessions))

    async def one(session: Any) -> tuple[dict[str, Any], PoseResult | None]:
        own = Phases(request_id=phases.request_id)
        try:
            result, frames = await track_session(host, endpoint, session, frame, request.K, own, group=group)
        except Exception as exc:  # this session only
            info = classify(exc)
            if info.internal:
                log.error("track of session %s in a several-session request failed with an unexpected %s",
                          session.session_id, type(exc).__name__, exc_info=exc)
            return {"session_id": session.session_id, "object_id": session.object_id, "status": info.status,
                    "error": error_object(exc)}, None
        finally:
            group.arrived(session.session_id)  # refused before its submit: the others need not wait for it
        host.metrics.observe_stages(endpoint, split_timings(result.timings_ms))
        return {"session_id": session.session_id, "object_id": session.object_id, "status": 200,
                **pose_fields(result), "frame": frames,
                "timings_ms": {**result.timings_ms, **{k: round(v, 4) for k, v in own.ms.items()}}}, result

    if group.concurrent:
        answered = await asyncio.gather(*(one(session) for session in sessions))
    else:
        answered = [await one(session) for session in sessions]
    phases.lap("pipeline")
    return {"sessions": [entry for entry, _ in answered]}, [result for _, result in answered if result is not None]


def start(host: Host, request: StartInput, phases: Phases) -> Any:
    """A session of ``request.object_id`` from a given pose and K, checked as a stateless track's (422 naming
    ``K`` / ``pose``; K's fit to the image is checked with each frame); laps ``validate``."""
    host.require_ready()
    entry = host.objects.get(request.object_id)
    K = validate.validate_K(request.K)
    cam_from_mesh = validate.validate_pose(request.pose, "pose", host.backend.max_translation_m)
    phases.lap("validate")
    from foundationpose.coordinate_frames import (
        to_centred_frame,  # torch: a GPU process's or the ingress' side
    )

    model = entry.model
    session = host.sessions.create(object_id=request.object_id, obj=model, K=K, image_hw=None, pose=cam_from_mesh,
                                   score=float("nan"),  # as a stateless track starts:
                                   cam_from_centred=to_centred_frame(cam_from_mesh, model.mesh_from_centred))
    session.trust.start_from(session.cam_from_centred)
    return session


# -- answers ------------------------------------------------------------------------------------------------------------
def split_timings(timings_ms: dict[str, float]) -> dict[str, float]:
    """The pipeline-stage entries of a result's timings (for the stage histograms)."""
    return {k: v for k, v in timings_ms.items() if k not in _NOT_STAGES}


@dataclass(frozen=True, slots=True)
class PoseAnswer:
    """The 200 answer of a pose request as bytes: the JSON body, its ``Server-Timing`` header value and the Serve
    replica that computed it ("" in-process). The ingest hub sends these to its worker as they are; the routes
    answer :meth:`response`."""

    content: bytes
    server_timing: str
    replica: str = ""

    def headers(self) -> list[tuple[str, str]]:
        headers = [("Server-Timing", self.server_timing)]
        if self.replica:
            headers.append((SERVED_BY_HEADER, self.replica))
        return headers

    def response(self) -> Response:
        return Response(self.content, media_type="application/json", headers=dict(self.headers()))


def answer_of(metrics: Any, endpoint: str, body: dict, result: PoseResult | None, phases: Phases) -> PoseAnswer:
    """The JSON answer of a pose request: timings_ms = the pipeline's stages + the host phases so far; ``encode`` is
    timed here and reported in ``Server-Timing`` and ``metrics`` (it cannot be inside the body it times). result:
    None for an answer of several results (:func:`track_sessions`: each entry carries its own stages)."""
    stages = {} if result is None else result.timings_ms
    body["timings_ms"] = {**stages, **{k: round(v, 4) for k, v in phases.ms.items()}}
    content = jsonio.dumps(body)
    phases.lap("encode")
    if result is not None:
        metrics.observe_stages(endpoint, split_timings(stages))
    metrics.observe_phases(endpoint, phases.ms)
    phases.log(endpoint)
    return PoseAnswer(content, server_timing(phases.ms), "" if result is None else result.replica)
