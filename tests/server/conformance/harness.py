"""Running a conformance case through transports and judging the answers (shared by the local and Serve legs)."""

from __future__ import annotations

from typing import Any

from tests.server.conformance.cases import CASES, Frame, dumps, error_fields, mesh_upload, stays_open
from tests.server.conformance.transports import Answer, Transport

__all__ = ["API_KEY", "KEY", "STATUS", "check_alike", "make_context", "run_case"]

API_KEY = "conformance-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}

STATUS = {"ok": 200, "InputError": 422, "UnknownSessionError": 404, "UnsupportedMediaTypeError": 415,
          "AuthError": 401}


def make_context(transports: list[Transport], frame: Frame, prefix: str) -> dict[str, Any]:
    """What the cases need of a server: a pose to start from, an HTTP client, its key, fresh objects."""
    http = transports[0].http
    form = next(t for t in transports if t.kind == "form" or t.kind == "binary")
    with form.open() as conv:
        registered = conv.register(frame.header(), frame.register_parts())
    assert registered.ok, registered.body
    uploads = iter(range(10_000))

    def fresh_object() -> str:
        object_id = f"{prefix}{next(uploads)}"
        response = http.post("/objects", data={"object_id": object_id}, files={"mesh": ("m.ply", mesh_upload())},
                             headers=KEY)
        assert response.status_code == 201, response.text
        return object_id

    return {"start_pose": registered.pose, "http": http, "key": KEY, "fresh_object": fresh_object}


def run_case(name: str, transports: list[Transport], frame: Frame, ctx: dict[str, Any]) -> dict[str, Answer]:
    """The case through every transport of its kinds: {transport name: its answer}."""
    case = CASES[name]
    answers = {}
    for t in transports:
        if t.kind not in case.kinds:
            continue
        with t.open() as conv:
            answer = case.run(conv, frame, ctx)
            answers[t.name] = answer
            if t.kind == "stream" and case.closes:
                assert conv.closed(), f"{t.name}: the stream stayed open after {dumps(answer.body)}"
            elif t.kind == "stream" and not answer.ok:
                stays_open(conv, frame)
    return answers


def check_alike(name: str, answers: dict[str, Answer], transports: list[Transport]) -> None:
    """Each answer as the case expects for its kind, the same status on every HTTP transport, the same poses and
    the same trust fields: ``valid``, ``confidence`` and ``source`` on every transport, ``state`` on every one that
    answers for a session (a stateless track's is null). All compared exactly, as the poses are: every transport
    runs the same steps on the same pixels, so no tolerance is needed."""
    case = CASES[name]
    kind = {t.name: t.kind for t in transports}
    got = {t: (a.outcome, a.status) for t, a in answers.items()}
    for t, answer in answers.items():
        expected = case.expect[kind[t]]
        assert answer.outcome == expected, f"{t}: {error_fields(answer)}; expected {expected}; all: {got}"
        if answer.status is not None:
            assert answer.status == STATUS[expected[0]], f"{t}: {error_fields(answer)}; all: {got}"
    poses = {t: a.body["poses"] for t, a in answers.items() if "poses" in a.body}
    if poses:
        first = next(iter(poses.values()))
        assert all(p == first for p in poses.values()), {t: dumps(p) for t, p in poses.items()}
    trust = {t: a.body["trust"] if "trust" in a.body else [a.trust]
             for t, a in answers.items() if "trust" in a.body or (a.ok and a.trust is not None)}
    if not trust:
        return
    for t, fields in trust.items():
        assert all(x is not None and "(missing)" not in x.values() for x in fields), f"{name}: {t}: {fields}"
    stateless = {t for t in trust if answers[t].body.get("stateless")}
    for t in stateless:
        assert all(x["state"] is None for x in trust[t]), f"{name}: {t}: a stateless answer with a state: {trust[t]}"
    alike = {t: [{k: v for k, v in x.items() if k != "state"} for x in fields] for t, fields in trust.items()}
    first = next(iter(alike.values()))
    assert all(v == first for v in alike.values()), f"{name}: the trust fields differ: {trust}"
    sessions = {t: fields for t, fields in trust.items() if t not in stateless}
    if sessions:
        first = next(iter(sessions.values()))
        assert all(v == first for v in sessions.values()), f"{name}: the session states differ: {sessions}"


