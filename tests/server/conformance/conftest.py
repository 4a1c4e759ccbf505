"""The servers of the conformance suite: one tiny CPU app with an API key and one ingest worker (its main port in
process, the worker's port a real socket: it serves tracks and streams and relays every other request to the app),
and the transports that reach it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from websockets.sync.client import connect

from server.client import depth_mm
from tests.server._helpers import write_objects_dir
from tests.server.conformance.cases import Frame
from tests.server.conformance.harness import API_KEY, KEY, make_context
from tests.server.conformance.transports import (
    BinaryHttp,
    FormHttp,
    SocketWs,
    StreamWs,
    TestClientWs,
    Transport,
)
from tests.server.test_ingest import _serve

ANSWER_TIMEOUT_S = 300.0  # the safety net of a connection's opening and of each answer (a loaded 2-core machine)


@contextmanager
def socket_stream(url: str, headers: dict[str, str]) -> Iterator[StreamWs]:
    with connect(url, additional_headers=dict(headers), open_timeout=ANSWER_TIMEOUT_S, max_size=2**24, compression=None) as ws:
        yield StreamWs(SocketWs(ws, ANSWER_TIMEOUT_S))


@pytest.fixture(scope="session")
def local(tiny_estimator, tmp_path_factory) -> Iterator[dict]:
    """The main port's three transports and the same three through the ingest worker's port, on one server."""
    objects = write_objects_dir(tmp_path_factory.mktemp("conformance_objects"))
    with _serve(tiny_estimator, objects, ingest_workers=1, api_key=API_KEY, max_upload_bytes=4 * 1024 * 1024) as served:
        main, ingest = served.client, served.ingest
        port = served.state.ingest_workers.port

        @contextmanager
        def main_stream(headers: dict[str, str] = KEY) -> Iterator[StreamWs]:
            with main.websocket_connect("/track/stream", headers=dict(headers)) as ws:  # it adds to the dict
                yield StreamWs(TestClientWs(ws))

        transports = [
            Transport("main-form", "form", "main", lambda headers=KEY: _http(FormHttp, main, main, headers), http=main),
            Transport("main-binary", "binary", "main", lambda headers=KEY: _http(BinaryHttp, main, main, headers),
                      http=main),
            Transport("main-stream", "stream", "main", main_stream, http=main),
            Transport("ingest-form", "form", "ingest", lambda headers=KEY: _http(FormHttp, ingest, ingest, headers),
                      http=ingest),
            Transport("ingest-binary", "binary", "ingest",
                      lambda headers=KEY: _http(BinaryHttp, ingest, ingest, headers), http=ingest,
                      extra={"track_client": ingest}),
            Transport("ingest-stream", "stream", "ingest",
                      lambda headers=KEY: socket_stream(f"ws://127.0.0.1:{port}/track/stream", headers), http=main),
        ]
        yield {"transports": transports, "served": served}


@contextmanager
def _http(cls, register_client, track_client, headers: dict[str, str] = KEY):
    yield cls(register_client, track_client, headers)


@pytest.fixture(scope="session")
def frame(enc) -> Frame:
    f = enc.frame
    return Frame(f.rgb, depth_mm(f.depth_m), (f.mask > 0).astype(np.uint8), f.K.tolist())


@pytest.fixture(scope="session")
def ctx(local, frame) -> dict[str, Any]:
    return make_context(local["transports"], frame, "cf")
