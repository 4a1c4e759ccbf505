"""The flow's typed inputs between processes (:mod:`server.flow.wire`): what a worker writes, the hub reads back
equal, through the JSON of the ingest socket, without parsing it again."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from server import jsonio
from server.flow import wire
from server.flow.frames import FrameBytes
from server.flow.inputs import RegisterInput, SessionsTrackInput, StartInput, StreamFrame, TrackInput

FRAME = FrameBytes(b"rgb", b"depth", rgb_shape=[1, 1, 3], depth_shape=[1, 1], depth_dtype="uint16")
K = np.array([[607.0599975585938, 0.0, 324.5], [0.0, 606.75, 237.91999816894531], [0.0, 0.0, 1.0]])
POSE = np.array([[1.0, 0.0, 0.0, 0.1], [0.0, 1.0, 0.0, -1 / 3], [0.0, 0.0, 1.0, 0.5], [0.0, 0.0, 0.0, 1.0]])

VALUES = [
    TrackInput(FRAME, session_id="s1"),
    TrackInput(FRAME, session_id="s1", K=K),
    TrackInput(FRAME, object_id="block", K=K, pose=POSE),
    RegisterInput("block", K, FRAME),
    RegisterInput("block", K, FRAME, session_id="s1", box=(1, 2, 30, 40)),
    StartInput("block", K, POSE),
    StreamFrame(FRAME),
    StreamFrame(FRAME, K),
    SessionsTrackInput(FRAME, ("a", "b"), K),
]


def _same(a: object, b: object) -> bool:
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype == np.float64
                    and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_every_typed_input_comes_back_equal_through_json(value):
    fields = jsonio.loads(jsonio.dumps(wire.fields_of(value)))
    back = wire.input_of(fields, value.frame if wire.has_frame(value) else None)
    assert type(back) is type(value) and _same(back, value)  # float64 K and pose to the last bit
    assert fields["kind"] == wire.KINDS[type(value)]


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match=r"^unknown input kind 'teleport'$"):
        wire.input_of({"kind": "teleport"}, FRAME)
