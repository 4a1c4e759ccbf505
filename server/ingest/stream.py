"""``WS /track/stream`` on the track port: the stream's protocol served by an ingest worker.

The connection, its receive loop, newest-frame-wins, the in-order answers, the idle timeout and the close codes are
:class:`server.routes_stream.Stream`'s, run in the worker. What needs the GPU process (register, start, track) is
relayed: the worker decodes the message's images into a slot of its ring and sends the message's header; the GPU
process answers it with its own ``Stream`` of this connection (the main port's rules, sessions and admission) and
sends back the answer body and timings, or the error body with its judgement (the status, whether the stream ends
and with which close code), which the worker applies as if it had judged it itself.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from server.errors import OverloadedError, RequestTimeoutError
from server.ingest.frames import decode_into_slot
from server.ingest.ring import FrameRing
from server.metrics import Metrics, StreamCounters
from server.phases import Phases
from server.pose_flow import frame_of_parts
from server.routes_stream import Stream, StreamItem

__all__ = ["IngestStream", "RelayedStreamError", "StreamHost"]


@dataclass(frozen=True, slots=True)
class _StreamConfig:
    max_upload_bytes: int
    stream_idle_s: float


@dataclass(slots=True)
class StreamHost:
    """What :class:`~server.routes_stream.Stream` reads of its host, in a worker."""

    config: _StreamConfig
    metrics: Metrics
    streams: StreamCounters

    @classmethod
    def of(cls, max_upload_bytes: int, stream_idle_s: float, metrics: Metrics) -> StreamHost:
        return cls(_StreamConfig(max_upload_bytes, stream_idle_s), metrics, StreamCounters())


class RelayedStreamError(Exception):
    """An error the GPU process's stream answered, with its judgement."""

    def __init__(self, status: int, fatal: bool, closing: list, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "error"))
        self.status, self.fatal, self.error = int(status), bool(fatal), error
        self.closing = (int(closing[0]), str(closing[1])) if closing else None


@dataclass(slots=True)
class IngestStream(Stream):
    """A worker's stream: the GPU-side work relayed through ``hub`` (a :class:`~server.ingest.worker.HubClient`)."""

    hub: Any = None
    ring: FrameRing | None = None
    max_image_hw: tuple[int, int] = (0, 0)
    answer_timeout_s: float = 90.0  # the GPU process answers 504 itself after its request timeout; this is beyond
    decode_inline: bool = False  # raw frames are copied into the ring on the event loop (decode_into_slot)
    opened: bool = False  # the GPU process has a Stream (and maybe a session) of this connection

    async def register(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases, images=True, with_mask=True)

    async def start(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases, images=False, with_mask=False)

    async def track(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases, images=True, with_mask=False)

    def end_session(self) -> None:
        if self.opened:
            self.hub.notify({"op": "stream", "kind": "end", "stream": self.stream_id})
            self.opened = False

    def judge(self, exc: Exception, item: StreamItem) -> tuple[int, bool]:
        if isinstance(exc, RelayedStreamError):
            if exc.fatal:
                self.closing = exc.closing or self.closing
            return exc.status, exc.fatal
        return Stream.judge(self, exc, item)

    def error_body(self, exc: Exception, item: StreamItem) -> dict:
        if isinstance(exc, RelayedStreamError):
            return {"type": "error", "frame": item.frame, "error": exc.error}
        return Stream.error_body(self, exc, item)

    async def _relay(self, item: StreamItem, phases: Phases, *, images: bool, with_mask: bool) -> tuple[dict, dict]:
        message = item.message
        header: dict[str, Any] = {"op": "stream", "kind": item.kind, "stream": self.stream_id, "frame": item.frame,
                                  "message_header": message.header, "mask": with_mask}
        slot = None
        answered: asyncio.Future | None = None
        try:
            if images and message.parts:
                frame = frame_of_parts(message.parts, with_mask=with_mask)
                phases.lap("parse")
                slot = self.ring.acquire()
                if slot is None:
                    raise OverloadedError(f"ingest worker {os.getpid()}: all {self.ring.slots} frame slots are busy",
                                          retry_after_ms=self.hub.track_ms or 1000.0)
                decoded = await decode_into_slot(self.ring, slot, frame, self.max_image_hw, phases,
                                                 with_mask=with_mask, inline=self.decode_inline)
                header.update(slot=slot, hw=list(decoded.hw), depth_in_range=decoded.depth_in_range)
            header["phases"] = phases.ms
            self.opened = True
            try:
                answered = await self.hub.send(header)
                answer, _ = await asyncio.wait_for(asyncio.shield(answered), self.answer_timeout_s)
            except TimeoutError as exc:
                raise RequestTimeoutError("no answer from the GPU process in time") from exc
            except ConnectionError as exc:
                raise RelayedStreamError(503, True, [1012, "the GPU process is gone"],
                                         {"type": "NotReadyError", "message": "the GPU process is not reachable"}) from exc
        finally:
            if slot is not None:
                self.ring.release_after(slot, answered)
        if not answer.get("ok"):
            raise RelayedStreamError(answer.get("status", 500), answer.get("fatal", True), answer.get("closing") or [],
                                     answer.get("error") or {"type": "InternalError", "message": "no answer"})
        phases.skip()  # the GPU process's phases are in its timings
        return answer["body"], answer["timings"]
