"""The conformance judge itself (:func:`check_alike`) on answers made by hand: it catches a transport whose trust
fields differ from the others', and lets a stateless answer have no state."""

from __future__ import annotations

import pytest

from tests.server.conformance.harness import check_alike
from tests.server.conformance.transports import Answer, Transport

POSE = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.5], [0.0, 0.0, 0.0, 1.0]]
TRANSPORTS = [Transport("form", "form", "main", lambda: None), Transport("binary", "binary", "main", lambda: None),
              Transport("stream", "stream", "main", lambda: None)]


def _trust(**changes):
    return {"valid": True, "confidence": 0.91, "state": "tracking", "source": "track", **changes}


def _answer(kind: str, trust: dict, stateless: bool = False) -> Answer:
    body = {"pose": POSE, "poses": [POSE], "trust": [trust], "stateless": stateless, **trust}
    return Answer(None if kind == "stream" else 200, {**body, "type": "pose"} if kind == "stream" else body)


def test_the_same_trust_everywhere_passes():
    check_alike("register_then_track", {t.name: _answer(t.kind, _trust()) for t in TRANSPORTS}, TRANSPORTS)


@pytest.mark.parametrize("changes", [{"valid": False}, {"confidence": 0.910001}, {"source": "register"},
                                     {"state": "uncertain"}])
def test_one_transport_with_other_trust_fields_fails_naming_them(changes):
    answers = {t.name: _answer(t.kind, _trust()) for t in TRANSPORTS}
    answers["binary"] = _answer("binary", _trust(**changes))
    with pytest.raises(AssertionError, match=r"^register_then_track: the (trust fields|session states) differ: "):
        check_alike("register_then_track", answers, TRANSPORTS)


def test_a_missing_trust_field_fails():
    answers = {t.name: _answer(t.kind, _trust()) for t in TRANSPORTS}
    answers["form"].body["trust"] = [{**_trust(), "confidence": "(missing)"}]
    with pytest.raises(AssertionError, match=r"^register_then_track: form: "):
        check_alike("register_then_track", answers, TRANSPORTS)


def test_stateless_answers_have_no_state_and_the_rest_is_still_compared():
    answers = {"form": _answer("form", _trust(state=None), stateless=True),
               "binary": _answer("binary", _trust(state=None), stateless=True),
               "stream": _answer("stream", _trust(state="uncertain"))}
    check_alike("track_from_a_known_pose", answers, TRANSPORTS)
    answers["binary"] = _answer("binary", _trust(state="tracking"), stateless=True)
    with pytest.raises(AssertionError, match=r"a stateless answer with a state"):
        check_alike("track_from_a_known_pose", answers, TRANSPORTS)
    answers["binary"] = _answer("binary", _trust(state=None, confidence=0.5), stateless=True)
    with pytest.raises(AssertionError, match=r"the trust fields differ"):
        check_alike("track_from_a_known_pose", answers, TRANSPORTS)
