"""``WS /track/stream`` on the Ray Serve ingress: the single-process stream, its frames on the pose replicas.

The connection handling is :class:`server.routes_stream.Stream`'s (binary messages, newest frame
wins, answers in order, errors that spare the session, idle close, the session ends with the
connection, the ``start`` message); only the two steps differ: the register and each frame go to a pose replica through
the ingress (:meth:`~server.serve.ingress.PoseIngress.register_session` /
:meth:`~server.serve.ingress.PoseIngress.track_session`), exactly as an HTTP ``/register`` and a
session's ``/track`` do, so a frame is retried on another replica when its replica dies.
"""

from __future__ import annotations

from foundationpose.errors import InputError
from server.phases import Phases
from server.pose_flow import frame_of_parts, header_object_id, json_text_of, pose_json
from server.routes_stream import ENDPOINT, NO_SESSION_YET, Stream

__all__ = ["ServeStream"]


class ServeStream(Stream):
    """A stream whose ``state`` is the :class:`~server.serve.ingress.PoseIngress`."""

    __slots__ = ()

    async def register(self, item, phases: Phases) -> tuple[dict, dict[str, float]]:
        ingress = self.state
        self.check_no_session("register")
        header = item.message.header
        object_id = header_object_id(header)
        entry = ingress.objects.get(object_id)
        frame = frame_of_parts(item.message.parts, with_mask=True)
        phases.lap("parse")
        self.session, reply = await ingress.register_session(entry, frame, json_text_of(header.get("K")), phases)
        body = {"type": "registered", "session_id": self.session.session_id, "object_id": object_id,
                "pose": pose_json(reply.cam_from_mesh), "score": reply.score, "replica": reply.replica}
        return body, reply.timings_ms

    async def start(self, item, phases: Phases) -> tuple[dict, dict[str, float]]:
        """The ingress holds the sessions and the objects: a start needs no replica (its working range is
        the replicas' estimator config's)."""
        return self.start_session(item, phases, self.state.config.estimator.max_translation_m)

    async def track(self, item, phases: Phases) -> tuple[dict, dict[str, float]]:
        ingress, session = self.state, self.session
        if session is None:
            raise InputError("type", NO_SESSION_YET, "a frame")
        if not ingress.sessions.is_live(session):
            ingress.sessions.get(session.session_id)  # UnknownSessionError: deleted or expired
        K_value = item.message.header.get("K")
        frame = frame_of_parts(item.message.parts, with_mask=False)
        reply, frames = await ingress.track_session(session, frame, None if K_value is None else json_text_of(K_value),
                                                    phases, ENDPOINT)
        body = {"type": "pose", "frame": item.frame, "frames": frames, "pose": pose_json(reply.cam_from_mesh),
                "replica": reply.replica}
        return body, reply.timings_ms
