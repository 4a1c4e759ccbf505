"""POST /track/sessions: several sessions (objects) tracked into one frame, one answer listing each."""

from __future__ import annotations

import pytest

from foundationpose.errors import InputError
from foundationpose.service import pose_service
from foundationpose.synthetic.scenes import synthetic_frame
from server import codecs
from server.fields import MAX_SESSIONS_PER_FRAME
from server.flow.frames import FrameBytes
from server.flow.inputs import sessions_track_input
from tests.server._helpers import FRAME_HW, assert_error, assert_rigid, encode, register

OBJECTS = ("block", "block2", "block")  # two objects, one of them twice (two instances in the frame)


@pytest.fixture(scope="module")
def next_frames():
    return [encode(synthetic_frame(*FRAME_HW, seed=seed)) for seed in (7, 8)]


def _track_sessions(client, session_ids, enc, **fields):
    return client.post("/track/sessions", data={"session_ids": ",".join(session_ids), **fields},
                       files=enc.track_files())


@pytest.mark.slow
def test_several_sessions_in_one_frame_answer_as_their_own_tracks(client, enc, next_frames, monkeypatch):
    """Each entry equals the session's own track of the frame; the three steps shared one batch (the group's hold,
    made long here so that a slow machine cannot let it lapse, is released once all three were submitted)."""
    monkeypatch.setattr(pose_service, "GROUP_HOLD_S", 600.0)
    together = [register(client, enc, object_id)["session_id"] for object_id in OBJECTS]
    alone = [register(client, enc, object_id)["session_id"] for object_id in OBJECTS]  # the same registers again
    for step, frame in enumerate(next_frames, start=1):
        response = _track_sessions(client, together, frame)
        assert response.status_code == 200, response.text
        body = response.json()
        assert [e["session_id"] for e in body["sessions"]] == together  # the request's order
        assert body["timings_ms"]["pipeline"] > 0
        for entry, object_id, twin in zip(body["sessions"], OBJECTS, alone, strict=True):
            expected = client.post("/track", data={"session_id": twin}, files=frame.track_files()).json()
            assert entry["status"] == 200 and "error" not in entry
            assert entry["object_id"] == object_id and entry["frame"] == step
            assert_rigid(entry["pose"])
            assert entry["pose"] == expected["pose"], "a session tracked with others differs from its own track"
            for key in ("valid", "confidence", "state", "source", "measurements"):
                assert entry[key] == expected[key], key
            assert entry["timings_ms"]["step"] > 0 and entry["timings_ms"]["batch"] == len(OBJECTS)
    for sid in together:  # each session advanced by itself
        info = client.get(f"/sessions/{sid}").json()
        assert info["frames"] == len(next_frames)
        assert info["pose"] == body["sessions"][together.index(sid)]["pose"]


@pytest.mark.slow
def test_an_unknown_session_or_a_bad_image_refuses_the_whole_request(client, enc):
    sid = register(client, enc)["session_id"]
    assert_error(_track_sessions(client, [sid, "no-such-session"], enc), 404, "UnknownSessionError", "session_id")
    bad_depth = codecs.encode_mask_png(enc.frame.mask)  # 8-bit PNG: decoded once, refused once
    assert_error(client.post("/track/sessions", data={"session_ids": sid},
                             files={**enc.track_files(), "depth": ("d.png", bad_depth)}),
                 422, "InputError", "depth", r"^depth: expected a 16-bit single-channel PNG")
    assert client.get(f"/sessions/{sid}").json()["frames"] == 0  # nothing was tracked


@pytest.mark.slow
def test_a_session_that_cannot_take_the_frame_is_its_entrys_error(client, enc):
    """A session registered on frames of another size needs a K with this frame: only that entry fails."""
    fits = register(client, enc)["session_id"]
    other = register(client, encode(synthetic_frame(FRAME_HW[0] + 16, FRAME_HW[1] + 16, seed=3)))["session_id"]
    response = _track_sessions(client, [fits, other], enc)
    assert response.status_code == 200, response.text
    ok, failed = response.json()["sessions"]
    assert ok["status"] == 200 and ok["frame"] == 1
    assert failed["status"] == 422 and failed["session_id"] == other and "pose" not in failed
    assert failed["error"]["type"] == "InputError" and failed["error"]["field"] == "K"
    assert failed["error"]["message"].startswith("K: expected the K of this 128x96 frame")
    assert client.get(f"/sessions/{other}").json()["frames"] == 0  # unchanged


@pytest.mark.parametrize(("session_ids", "match"), [
    ("a,a", r"^session_ids: expected 1 to 16 distinct session ids, comma-separated; got 'a' more than once"),
    (",".join(f"s{i}" for i in range(MAX_SESSIONS_PER_FRAME + 1)), r"^session_ids: "),
    ("a,,b", r"^session_ids: "),
    ("", r"^session_ids: "),
])
def test_session_ids_that_are_not_a_list_of_distinct_ids_are_refused(client, enc, session_ids, match):
    response = client.post("/track/sessions", data={"session_ids": session_ids}, files=enc.track_files())
    assert_error(response, 422, "InputError", "session_ids", match)


def test_the_parser_takes_text_or_a_list_and_names_the_field():
    frame = FrameBytes(b"", b"")
    assert sessions_track_input(frame, session_ids="a,b-2", K=None).session_ids == ("a", "b-2")
    parsed = sessions_track_input(frame, session_ids=["a", "b"], K="[[1,0,1],[0,1,1],[0,0,1]]")
    assert parsed.session_ids == ("a", "b") and parsed.K.shape == (3, 3)
    for bad, got in (([], "0 ids"), (["a", 3], "['a', 3]"), (None, "nothing"), ("a b", "'a b'")):
        with pytest.raises(InputError) as caught:
            sessions_track_input(frame, session_ids=bad, K=None)
        assert caught.value.field == "session_ids" and got in str(caught.value), str(caught.value)
