"""An ingest worker's side of a request: its frame decoded into a ring slot, its typed input sent to the GPU
process, the answer awaited.

The worker parses every request with the flow's own parsers (:mod:`server.flow.inputs`, so it refuses what the
main port refuses, the same way) and decodes its images with the flow's decode (:func:`server.flow.frames.
decode_frame`) straight into a slot of its :class:`~deploy_core.memory.ring.FrameRing`. What it sends the GPU process
is the typed input in the flow's one encoding (:mod:`server.flow.wire`: ids that passed their checks, K and pose as
finite floats) and the slot (:func:`slot_frame` reads it back), never a client's raw header, so nothing a client
chose can break the relay; a stream message's frame number goes beside it. The GPU process
(:mod:`server.ingest.hub`) rebuilds the input without parsing it again, runs the request flow's step on the frame
in the slot and answers.

:class:`RelayStream` is the :class:`~server.flow.stream.StreamHandler` of a worker's ``WS /track/stream``: the
connection, its parsing, newest-frame-wins and answers are :class:`~server.flow.stream.Stream`'s, run in the
worker; each message's step is relayed, and the GPU process's judgement of a failed one (its status, whether
the stream ends and with which close code) is applied as if it were the worker's own.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from typing import Any

import anyio

from deploy_core.memory.ring import FrameRing
from server.errors import OverloadedError, RequestTimeoutError, error_object
from server.flow import wire
from server.flow.frames import Decoded, FrameBytes, decode_frame, raw_hw
from server.flow.inputs import RegisterInput
from server.flow.stream import CLOSE_RESTART, StreamItem, judge
from server.phases import Phases

__all__ = ["RelayStream", "RelayedStreamError", "decode_into_slot", "relay", "relay_input", "slot_frame",
           "slot_views"]


def slot_views(ring: FrameRing, slot: int, hw: tuple[int, int], with_mask: bool = False) -> tuple[Any, Any, Any]:
    """(rgb (H, W, 3) uint8, depth (H, W) float32, mask (H, W) uint8 or None): the views of ``slot`` an (H, W)
    frame is decoded into (and read from, in the GPU process)."""
    return ring.rgb(slot, hw), ring.depth(slot, hw), ring.mask(slot, hw) if with_mask else None


def slot_frame(ring: FrameRing, header: dict[str, Any]) -> FrameBytes:
    """The images of a relayed request whose ``header`` names its slot (:func:`relay`): raw views of the slot, the
    depth marked in range when the worker found it so."""
    h, w = (int(v) for v in header["hw"])
    rgb, depth, mask = slot_views(ring, int(header["slot"]), (h, w), with_mask=bool(header.get("mask")))
    return FrameBytes(memoryview(rgb).cast("B"), memoryview(depth).cast("B"),
                      None if mask is None else memoryview(mask).cast("B"), rgb_shape=[h, w, 3], depth_shape=[h, w],
                      depth_dtype="float32", mask_shape=None if mask is None else [h, w],
                      depth_in_range=header.get("depth_in_range") is True)


async def decode_into_slot(ring: FrameRing, slot: int, frame: FrameBytes, max_hw: tuple[int, int], phases: Phases,
                           *, with_mask: bool = False) -> Decoded:
    """Decode ``frame`` into ``slot`` (:func:`~server.flow.frames.decode_frame` with the slot's buffers): raw pixels
    right here on the event loop (a copy and a range check, ~1 ms at 640x480: less than two thread hops under load;
    on 2 CPU cores, 16 clients, the decode phase went from 6.0 to 1.8 ms), encoded images in a thread (the codecs
    run for several ms without the GIL)."""
    into = partial(slot_views, ring, slot, with_mask=with_mask)
    decode = partial(decode_frame, frame, max_hw, phases, with_mask=with_mask, into=into)
    if raw_hw(frame, max_hw, with_mask) is not None:
        return decode()
    return await anyio.to_thread.run_sync(decode)


def full_ring(ring: FrameRing, retry_after_ms: float) -> OverloadedError:
    """The refusal of a request that finds every slot of the worker's ring busy: a slot frees when one of its
    requests is answered, about one track service time from now."""
    return OverloadedError(f"ingest worker {os.getpid()}: all {ring.slots} frame slots are busy (more ingest_slots "
                           "in the --config file, or --ingest-workers)", retry_after_ms=retry_after_ms)


async def relay(hub: Any, ring: FrameRing, header: dict[str, Any], frame: FrameBytes | None, max_hw: tuple[int, int],
                phases: Phases, *, with_mask: bool, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """Send one request to the GPU process: ``frame`` (None: no images) decoded into a slot, ``header`` with the
    slot and this process's phases added; the GPU process's (answer header, body). The slot is freed when the GPU
    process is done with it. OverloadedError (503) when the ring is full, RequestTimeoutError (504) past
    ``timeout_s``; ConnectionError when the GPU process is gone."""
    slot, answered = None, None
    try:
        if frame is not None:
            slot = ring.acquire()
            if slot is None:
                raise full_ring(ring, hub.track_ms or 1000.0)
            decoded = await decode_into_slot(ring, slot, frame, max_hw, phases, with_mask=with_mask)
            header.update(slot=slot, hw=list(decoded.hw), depth_in_range=decoded.in_range, mask=with_mask)
        header["phases"] = phases.ms
        answered = await hub.send(header)
        try:
            return await asyncio.wait_for(asyncio.shield(answered), timeout_s)
        except TimeoutError as exc:
            raise RequestTimeoutError("no answer from the GPU process in time") from exc
    finally:
        if slot is not None:
            ring.release_after(slot, answered)


async def relay_input(hub: Any, ring: FrameRing, header: dict[str, Any], value: wire.Input, max_hw: tuple[int, int],
                      phases: Phases, *, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """:func:`relay` a parsed request: ``value``'s fields (:func:`server.flow.wire.fields_of`) in ``header``'s
    ``input``, its images (a register's with its mask, unless it has a box) decoded into a slot."""
    header["input"] = wire.fields_of(value)
    frame = value.frame if wire.has_frame(value) else None
    with_mask = isinstance(value, RegisterInput) and value.box is None
    return await relay(hub, ring, header, frame, max_hw, phases, with_mask=with_mask, timeout_s=timeout_s)


class RelayedStreamError(Exception):
    """An error the GPU process's stream answered, with its judgement (status; close code and reason or None)."""

    def __init__(self, status: int, closing: Any, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "error"))
        self.status, self.error = int(status), error
        self.closing = (int(closing[0]), str(closing[1])) if closing else None


class RelayStream:
    """A worker's stream handler (see the module docstring). ``hub``: the worker's
    :class:`~server.ingest.worker.HubClient`."""

    def __init__(self, hub: Any, ring: FrameRing, stream_id: str, *, max_image_hw: tuple[int, int],
                 answer_timeout_s: float) -> None:
        self.hub, self.ring, self.stream_id = hub, ring, stream_id
        self.max_image_hw, self.answer_timeout_s = max_image_hw, answer_timeout_s
        self.opened = False  # the GPU process has a stream (and maybe a session) of this connection

    async def register(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases)

    async def start(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases)

    async def frame(self, item: StreamItem, phases: Phases) -> tuple[dict, dict[str, float]]:
        return await self._relay(item, phases)

    def end(self) -> None:
        if self.opened:
            self.hub.notify({"op": "end", "stream": self.stream_id})
            self.opened = False

    def judge(self, exc: Exception) -> tuple[int, tuple[int, str] | None]:
        if isinstance(exc, RelayedStreamError):
            return exc.status, exc.closing
        return judge(exc, self.opened, self.stream_id)

    def error(self, exc: Exception) -> dict[str, Any]:
        return exc.error if isinstance(exc, RelayedStreamError) else error_object(exc)

    async def _relay(self, item: StreamItem, phases: Phases) -> tuple[dict, dict]:
        header = {"op": "stream", "stream": self.stream_id, "frame": item.frame}
        self.opened = True
        try:
            answer, _ = await relay_input(self.hub, self.ring, header, item.request, self.max_image_hw, phases,
                                          timeout_s=self.answer_timeout_s)
        except ConnectionError as exc:
            raise RelayedStreamError(503, [CLOSE_RESTART, "the GPU process is gone"],
                                     {"type": "NotReadyError", "message": "the GPU process is not reachable"}) from exc
        if not answer.get("ok"):
            raise RelayedStreamError(answer.get("status", 500), answer.get("closing") or None,
                                     answer.get("error") or {"type": "InternalError", "message": "no answer"})
        phases.skip()  # the GPU process's phases are in its timings
        return answer["body"], answer["timings"]
