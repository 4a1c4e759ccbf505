"""The conformance cases: each is one request (or a short exchange) that every transport of its kinds must answer
the same way. A case returns the :class:`~tests.server.conformance.transports.Answer` to judge; :data:`CASES` holds,
per case, the kinds it applies to and the outcome expected of every transport of a kind: ``("ok", None)`` or
(error type, field). Every class of hostile input the server must refuse the same way on every port is here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from foundationpose.synthetic.meshes import make_procedural_mesh
from tests.server.conformance.transports import Answer, Raw, StreamWs

__all__ = ["CASES", "Case", "Frame", "stays_open"]

HUGE_INT = "1" * 400  # an integer no float64 holds
HUGE_HEADER_INT = "9" * 5000  # an integer beyond Python's int-from-text limit (4300 digits)


@dataclass(frozen=True)
class Frame:
    """A synthetic frame as every transport sends it: raw uint8 rgb, uint16 millimetre depth, uint8 mask."""

    rgb: np.ndarray
    depth_mm: np.ndarray
    mask: np.ndarray
    K: list[list[float]]

    @property
    def hw(self) -> tuple[int, int]:
        return self.depth_mm.shape

    def register_parts(self) -> dict[str, Any]:
        return {"rgb": self.rgb, "depth": self.depth_mm, "mask": self.mask}

    def track_parts(self) -> dict[str, Any]:
        return {"rgb": self.rgb, "depth": self.depth_mm}

    def header(self, **fields: Any) -> dict[str, Any]:
        return {"object_id": "block", "K": self.K, **fields}


@dataclass(frozen=True)
class Case:
    run: Callable[..., Answer]
    kinds: tuple[str, ...]
    expect: dict[str, tuple[str, str | None]]  # kind -> outcome
    closes: bool = False  # a stream's connection ends after this answer


CASES: dict[str, Case] = {}
ALL = ("form", "binary", "stream")
HTTP = ("form", "binary")
FRAMED = ("binary", "stream")  # a JSON header: what a form cannot send


def case(kinds: tuple[str, ...], expect: tuple[str, str | None] | dict[str, tuple[str, str | None]],
         closes: bool = False) -> Callable[[Callable[..., Answer]], Callable[..., Answer]]:
    def add(fn: Callable[..., Answer]) -> Callable[..., Answer]:
        per_kind = expect if isinstance(expect, dict) else {kind: expect for kind in kinds}
        CASES[fn.__name__] = Case(fn, kinds, per_kind, closes)
        return fn
    return add


def _registered(conv: Any, f: Frame) -> Answer:
    answer = conv.register(f.header(), f.register_parts())
    assert answer.ok, answer.body
    return answer


def stays_open(conv: Any, f: Frame) -> None:
    """A stream answers a good message after a refused one: a register, or a frame once it has a session."""
    answer = conv.register(f.header(), f.register_parts())
    if answer.outcome == ("InputError", "type"):  # the session began before the refused message
        answer = conv.track({}, f.track_parts())
    assert answer.ok, answer.body


# -- what every transport must accept ------------------------------------------------------------------------------
@case(ALL, ("ok", None))
def register_then_track(conv: Any, f: Frame, ctx: dict) -> Answer:
    registered = _registered(conv, f)
    tracked = conv.track({}, f.track_parts())
    return Answer(tracked.status, {**tracked.body, "poses": [registered.pose, tracked.pose],
                                   "trust": [registered.trust, tracked.trust]})


@case(ALL, ("ok", None))
def track_from_a_known_pose(conv: Any, f: Frame, ctx: dict) -> Answer:
    """Stateless HTTP tracks from a pose; a stream starts from it (its first frame is the same step). The stateless
    answers have no session, so no ``state`` (null); the streams' is their session's."""
    pose = ctx["start_pose"]
    stateless = not isinstance(conv, StreamWs)
    if not stateless:
        started = conv.start(f.header(pose=pose))
        assert started.ok, started.body
        answer = conv.track({}, f.track_parts())
    else:
        answer = conv.track(f.header(pose=pose), f.track_parts())
    return Answer(answer.status, {**answer.body, "poses": [answer.pose], "trust": [answer.trust],
                                  "stateless": stateless})


@case(FRAMED, ("ok", None))
def unknown_header_keys_of_any_value_are_ignored(conv: Any, f: Frame, ctx: dict) -> Answer:
    """A lone surrogate, or an integer of 2**64, under keys the server does not read."""
    return conv.register(f.header(note=Raw('"\\ud800"'), big=2**64, neg=-(2**64)), f.register_parts())


# -- numbers no float64 holds, text that is no text -----------------------------------------------------------------
@case(ALL, ("InputError", "K"))
def K_with_an_integer_of_400_digits(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(K=Raw(f"[[{HUGE_INT},0,64],[0,500,48],[0,0,1]]")), f.register_parts())


@case(ALL, ("InputError", "K"))
def K_with_a_float_beyond_float64(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(K=Raw("[[1e400,0,64],[0,500,48],[0,0,1]]")), f.register_parts())


@case(ALL, ("InputError", "pose"))
def pose_with_an_integer_of_400_digits(conv: Any, f: Frame, ctx: dict) -> Answer:
    pose = Raw(f"[[1,0,0,{HUGE_INT}],[0,1,0,0],[0,0,1,0.5],[0,0,0,1]]")
    if isinstance(conv, StreamWs):
        return conv.start(f.header(pose=pose))
    return conv.track(f.header(pose=pose), f.track_parts())


@case(FRAMED, ("InputError", "message"))
def header_with_an_integer_of_5000_digits(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(note=Raw(HUGE_HEADER_INT)), f.register_parts())


@case(FRAMED, ("InputError", "object_id"))
def object_id_with_a_lone_surrogate(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(object_id=Raw('"bl\\ud800ck"')), f.register_parts())


@case(("stream",), ("InputError", "frame"))
def frame_numbers_beyond_64_bits(conv: Any, f: Frame, ctx: dict) -> Answer:
    _registered(conv, f)
    answers = []
    for number in (2**64, -(2**63) - 1):
        conv.send({"type": "frame", "frame": number}, f.track_parts())
        answers.append(conv.receive())
    assert answers[0].outcome == answers[1].outcome, [a.body for a in answers]
    return answers[0]


# -- images that are not what they say ------------------------------------------------------------------------------
@case(FRAMED, ("InputError", "rgb"))
def rgb_declared_float32(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(__dtypes__={"rgb": "float32"}), f.register_parts())


@case(FRAMED, ("InputError", "rgb"))
def rgb_declared_a_nonsense_dtype(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(__dtypes__={"rgb": "pixels"}), f.register_parts())


@case(ALL, ("InputError", "depth"))
def depth_in_metres_saved_as_millimetres(conv: Any, f: Frame, ctx: dict) -> Answer:
    metres = np.round(f.depth_mm.astype(np.float64) / 1000.0).astype(np.uint16)  # 0.5 m -> 0 or 1 "mm"
    answer = conv.register(f.header(), {**f.register_parts(), "depth": metres})
    assert "Depth in metres saved as millimetres?" in answer.error.get("message", ""), answer.body
    return answer


@case(ALL, ("InputError", "K"))
def K_whose_principal_point_is_on_the_edge(conv: Any, f: Frame, ctx: dict) -> Answer:
    h, w = f.hw
    answer = conv.register(f.header(K=[[500.0, 0.0, float(w)], [0.0, 500.0, h / 2], [0.0, 0.0, 1.0]]),
                           f.register_parts())
    assert "K for another image size?" in answer.error.get("message", ""), answer.body
    return answer


@case(ALL, ("InputError", "K"))
def K_of_a_1920x1080_camera(conv: Any, f: Frame, ctx: dict) -> Answer:
    return conv.register(f.header(K=[[1000.0, 0.0, 960.0], [0.0, 1000.0, 540.0], [0.0, 0.0, 1.0]]),
                         f.register_parts())


# -- the stream's openings ------------------------------------------------------------------------------------------
@case(("stream",), ("InputError", "parts"))
def start_with_parts(conv: Any, f: Frame, ctx: dict) -> Answer:
    conv.send({"type": "start", **f.header(pose=ctx["start_pose"])}, f.track_parts())
    return conv.receive()


@case(("stream",), ("ok", None))
def a_waiting_start_is_never_replaced_by_a_frame(conv: Any, f: Frame, ctx: dict) -> Answer:
    """[start, frame 1, start, frame 2] back to back: the first start is answered, the second refused, and frame 2
    answered (frame 1 answered or listed as skipped)."""
    start = f.header(pose=ctx["start_pose"])
    for header, parts in (({"type": "start", **start}, {}), ({"type": "frame", "frame": 1}, f.track_parts()),
                          ({"type": "start", **start}, {}), ({"type": "frame", "frame": 2}, f.track_parts())):
        conv.send(header, parts)
    answers = [conv.receive()]
    while not (answers[-1].body.get("type") == "pose" and answers[-1].body.get("frame") == 2):
        answers.append(conv.receive())
    kinds = [a.body["type"] for a in answers]
    assert kinds.count("started") == 1 and kinds[0] == "started", kinds
    assert [a.outcome for a in answers if a.body["type"] == "error"] == [("InputError", "type")], kinds
    covered = {a.body["frame"] for a in answers if a.body["type"] == "pose"}
    covered |= {n for a in answers for n in a.body.get("skipped", [])}
    assert covered == {1, 2}, [a.body for a in answers]
    return answers[-1]


@case(("stream",), ("ok", None))
def a_start_after_a_failed_register_is_answered(conv: Any, f: Frame, ctx: dict) -> Answer:
    """[register with a bad K, start, frame] back to back: the error, the start, the pose."""
    for header, parts in (({"type": "register", **f.header(K=Raw(f"[[{HUGE_INT},0,1]]"))}, f.register_parts()),
                          ({"type": "start", **f.header(pose=ctx["start_pose"])}, {}),
                          ({"type": "frame", "frame": 1}, f.track_parts())):
        conv.send(header, parts)
    answers = [conv.receive() for _ in range(3)]
    assert [a.body["type"] for a in answers] == ["error", "started", "pose"], [a.body for a in answers]
    assert answers[0].outcome == ("InputError", "K")
    return answers[-1]


# -- lifecycle --------------------------------------------------------------------------------------------------------
@case(ALL, {"form": ("UnknownSessionError", "session_id"), "binary": ("UnknownSessionError", "session_id"),
            "stream": ("InputError", "type")})
def a_track_without_a_session(conv: Any, f: Frame, ctx: dict) -> Answer:
    if isinstance(conv, StreamWs):
        return conv.track({}, f.track_parts())
    return conv.track({"session_id": "nosuchsession"}, f.track_parts())


@case(ALL, ("UnknownSessionError", "session_id"), closes=True)
def a_track_of_a_deleted_session(conv: Any, f: Frame, ctx: dict) -> Answer:
    session_id = _registered(conv, f).body["session_id"]
    deleted = ctx["http"].delete(f"/sessions/{session_id}", headers=ctx["key"])
    assert deleted.status_code == 200, deleted.text
    return conv.track({}, f.track_parts())


@case(ALL, ("UnknownSessionError", "session_id"), closes=True)
def a_track_after_its_object_was_deleted(conv: Any, f: Frame, ctx: dict) -> Answer:
    object_id = ctx["fresh_object"]()
    session_id = _registered_object(conv, f, object_id)
    deleted = ctx["http"].delete(f"/objects/{object_id}", headers=ctx["key"])
    assert deleted.status_code == 200 and deleted.json()["sessions_ended"] == 1, deleted.text
    assert session_id
    return conv.track({}, f.track_parts())


def _registered_object(conv: Any, f: Frame, object_id: str) -> str:
    answer = conv.register(f.header(object_id=object_id), f.register_parts())
    assert answer.ok, answer.body
    return answer.body["session_id"]


def mesh_upload() -> bytes:
    """A small mesh to upload (PLY bytes)."""
    return make_procedural_mesh("plain_asym").export(file_type="ply")


def error_fields(answer: Answer) -> dict[str, Any]:
    """What the test report shows of an answer."""
    return {"status": answer.status, **({"error": answer.error} if answer.error else {"type": answer.body.get("type")})}


def dumps(value: Any) -> str:
    return json.dumps(value, default=str)[:400]
