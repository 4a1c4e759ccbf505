"""The transports of the conformance suite: one small adapter per way in, all with the same conversation API.

A :class:`Conversation` sends a register, a start or a track step with a header (the fields: ``object_id``, ``K``,
``pose``, ``session_id`` and whatever a case adds) and images (arrays go raw, bytes as encoded files), and returns
the :class:`Answer`:

* :class:`FormHttp`: ``POST /register`` / ``POST /track`` multipart forms (the header's fields as form fields);
* :class:`BinaryHttp`: ``POST /register/binary`` / ``POST /track/binary`` (the message container);
* :class:`StreamWs`: ``WS /track/stream`` (one connection per conversation, one answer per message).

HTTP conversations remember the session of their last register and track it unless the header says otherwise.
A header value :class:`Raw` is written into the JSON header as it is (numbers no Python ``json`` writes).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.flow.message import pack_message

__all__ = ["TRUST_FIELDS", "Answer", "BinaryHttp", "Conversation", "FormHttp", "Raw", "StreamWs", "Transport", "pack"]

TRUST_FIELDS = ("valid", "confidence", "state", "source")  # a pose answer's trust, the same on every transport


@dataclass(frozen=True)
class Raw:
    """A header value written as this JSON text."""

    text: str


def pack(header: dict[str, Any], parts: dict[str, Any]) -> bytes:
    """The message container of ``header`` (with :class:`Raw` values spliced in as their text) and ``parts``; a
    header key ``__dtypes__`` ({part: dtype}) overrides what the parts declare."""
    header = dict(header)
    dtypes = header.pop("__dtypes__", {})
    raws = {f"__raw_{i}__": v.text for i, v in enumerate(v for v in header.values() if isinstance(v, Raw))}
    names = iter(raws)
    plain = {k: (f"{next(names)}" if isinstance(v, Raw) else v) for k, v in header.items()}
    blob = pack_message(plain, parts)
    (n,) = struct.unpack_from("<I", blob)
    decoded = json.loads(blob[4:4 + n])
    for part in decoded["parts"]:
        part["dtype"] = dtypes.get(part["name"], part.get("dtype"))
        if part["dtype"] is None:
            del part["dtype"]
    head = json.dumps(decoded, separators=(",", ":"))
    for name, text in raws.items():
        head = head.replace(json.dumps(name), text)
    encoded = head.encode("utf-8", "surrogatepass")
    return struct.pack("<I", len(encoded)) + encoded + blob[4 + n:]


def _text(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class Answer:
    """One answer: an HTTP status (None for a stream message), the error's type / field / message, the pose."""

    status: int | None
    body: dict[str, Any]

    @property
    def error(self) -> dict[str, Any]:
        failed = (self.status or 200) >= 400 or self.body.get("type") == "error"
        return (self.body.get("error") or {"type": "?"}) if failed else {}

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def outcome(self) -> tuple[str, str | None]:
        """("ok", None) or (error type, field): what must be the same on every transport."""
        return ("ok", None) if self.ok else (self.error.get("type"), self.error.get("field"))

    @property
    def pose(self) -> list | None:
        return self.body.get("pose")

    @property
    def trust(self) -> dict[str, Any] | None:
        """What the answer says its pose is worth (``valid``, ``confidence``, ``state``, ``source``); None when it
        has no pose."""
        if "pose" not in self.body:
            return None
        return {name: self.body.get(name, "(missing)") for name in TRUST_FIELDS}


class Conversation:
    """One client's requests (a stream: one connection)."""

    kind = ""

    def register(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        raise NotImplementedError

    def track(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        raise NotImplementedError


@dataclass
class Transport:
    """A named way in: ``open()`` starts a conversation; ``port`` is the server it reaches (main, ingest, serve)."""

    name: str
    kind: str  # form | binary | stream
    port: str
    open: Callable[[], Any]
    http: Any = None  # an HTTP client of the same server (uploads, deletes, /metrics)
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return self.name


class _Http(Conversation):
    def __init__(self, register_client: Any, track_client: Any, headers: dict[str, str]) -> None:
        self.register_client, self.track_client, self.headers = register_client, track_client, headers
        self.session_id: str | None = None

    def _answer(self, response: Any) -> Answer:
        try:
            body = response.json()
        except ValueError:
            body = {"text": response.text}
        if response.status_code == 200 and "score" in body:  # a register's answer
            self.session_id = body["session_id"]
        return Answer(response.status_code, body)

    def _session_header(self, header: dict[str, Any]) -> dict[str, Any]:
        if {"session_id", "pose", "object_id"} & set(header) or self.session_id is None:
            return header
        return {"session_id": self.session_id, **header}


class FormHttp(_Http):
    kind = "form"

    @staticmethod
    def _form(header: dict[str, Any], parts: dict[str, Any]) -> tuple[dict[str, str], dict[str, tuple]]:
        data = {k: _text(v) for k, v in header.items() if v is not None}
        files = {}
        for name, value in parts.items():
            if isinstance(value, np.ndarray):
                files[name] = (f"{name}.raw", np.ascontiguousarray(value).tobytes())
                data[f"{name}_shape"] = ",".join(str(d) for d in value.shape)
                if name == "depth":
                    data["depth_dtype"] = value.dtype.name
            else:
                files[name] = (f"{name}.png", bytes(value))
        return data, files

    def register(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        data, files = self._form(header, parts)
        return self._answer(self.register_client.post("/register", data=data, files=files, headers=self.headers))

    def track(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        data, files = self._form(self._session_header(header), parts)
        return self._answer(self.track_client.post("/track", data=data, files=files, headers=self.headers))


class BinaryHttp(_Http):
    kind = "binary"
    _octets = {"Content-Type": "application/octet-stream"}

    def register(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        body = pack({"type": "register", **header}, parts)
        return self._answer(self.register_client.post("/register/binary", content=body,
                                                      headers={**self.headers, **self._octets}))

    def track(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        body = pack(self._session_header(header), parts)
        return self._answer(self.track_client.post("/track/binary", content=body, headers={**self.headers,
                                                                                            **self._octets}))


class StreamWs(Conversation):
    """A stream connection: ``ws`` has ``send(bytes)``, ``receive() -> dict`` and ``close()``."""

    kind = "stream"

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.frames = 0

    def send(self, header: dict[str, Any], parts: dict[str, Any]) -> None:
        self.ws.send(pack(header, parts))

    def receive(self) -> Answer:
        return Answer(None, self.ws.receive())

    def register(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        self.send({"type": "register", **header}, parts)
        return self.receive()

    def start(self, header: dict[str, Any]) -> Answer:
        self.send({"type": "start", **header}, {})
        return self.receive()

    def track(self, header: dict[str, Any], parts: dict[str, Any]) -> Answer:
        self.frames += 1
        self.send({"type": "frame", "frame": self.frames, **header}, parts)
        return self.receive()

    def closed(self) -> bool:
        """Whether the server has closed the connection (a receive raises)."""
        try:
            self.ws.receive()
        except Exception:  # noqa: BLE001 - either client's "the connection is closed"
            return True
        return False


class TestClientWs:
    """A Starlette TestClient WebSocket as the stream adapter's socket."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws

    def send(self, data: bytes) -> None:
        self._ws.send_bytes(data)

    def receive(self) -> dict[str, Any]:
        return self._ws.receive_json()


class SocketWs:
    """A ``websockets`` sync client connection as the stream adapter's socket."""

    def __init__(self, ws: Any, timeout_s: float) -> None:
        self._ws, self._timeout_s = ws, timeout_s

    def send(self, data: bytes) -> None:
        self._ws.send(data)

    def receive(self) -> dict[str, Any]:
        return json.loads(self._ws.recv(timeout=self._timeout_s))


@contextmanager
def http_conversation(cls: type[_Http], register_client: Any, track_client: Any,
                      headers: dict[str, str]) -> Iterator[_Http]:
    yield cls(register_client, track_client, headers)
