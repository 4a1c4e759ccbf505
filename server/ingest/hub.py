"""The GPU process's end of the ingest workers: a Unix-socket server on the app's event loop.

Each worker connects once (``hello`` names its :class:`~deploy_core.memory.ring.FrameRing`, which the hub maps and
unlinks), then sends one ``track`` message per ``POST /track/binary`` it received, the frame already decoded into a
slot, with the request's typed input as the worker parsed it (:mod:`server.flow.wire`: rebuilt here, not parsed
again). The hub runs that request through the request flow's track step (:func:`server.flow.steps.track`:
sessions, admission, per-session order, validation, batching, errors), on the app's own event loop, and sends the
HTTP answer back as bytes, its error answer, count, timing and access line from the app's own functions
(:func:`~server.errors.error_response`, :func:`~server.middleware.finish_request`); a stream's messages go through a
:class:`~server.flow.stream.SessionStream` per worker connection. Any other request a worker received (``http``)
is answered by the app itself (:attr:`ServerState.app <server.state.ServerState>`), its middlewares included. So
a request is answered exactly as if this process had received it, while the HTTP receive, body parse and decode of
the tracks ran in another process, under another GIL.

Warm-up: :meth:`IngestHub.warm_workers` asks the connected workers (and each that connects later), one at a time,
to run its request paths once (``warm``: :func:`server.warmup.warm_worker`) and waits until enough of them report
``warmed``.
A worker's message that carries ``"warmup": true`` is one of those requests: it is served in the warm-up's context
(:func:`server.warmup.warm_task`), so it passes while the server is still starting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from deploy_core.memory.ring import FrameRing, pin_ring, unpin_ring
from server.asgi_call import call_http
from server.errors import CLIENT_GONE, error_response
from server.flow import steps, wire
from server.flow.stream import SessionStream, StreamItem, observe_answer
from server.ingest.protocol import MAX_BODY_BYTES, ProtocolError, pack, read_message
from server.ingest.relay import slot_frame
from server.loop_watch import LOOP_BEAT_S, LoopStats, loop_families
from server.metrics import Family
from server.middleware import finish_request
from server.phases import Phases
from server.warmup import warm_task

__all__ = ["ENDPOINT", "IngestHub"]

log = logging.getLogger(__name__)

ENDPOINT = "/track/binary"  # the ingest requests' metrics label: the same route as on the main port


class _Connection:
    """One worker's connection: its ring, its writer and its requests in progress."""

    def __init__(self, pid: int, ring: FrameRing, writer: asyncio.StreamWriter, pinned: bool) -> None:
        self.pid = pid
        self.ring = ring
        self.writer = writer
        self.pinned = pinned  # the ring is page-locked for the GPU (pin_ring)
        self.tasks: set[asyncio.Task] = set()
        self.relayed = 0  # of those, relayed HTTP requests (answered by the app, not tracks)
        self.streams: dict[str, Any] = {}  # the worker's WS /track/stream connections: their GPU-side Stream
        self.http_counts: dict[tuple[str, str], int] = {}  # (endpoint, status) -> the worker's answers so far
        self.stream_counts = (0, 0, 0)  # the worker's streams: open now, frames received, frames skipped
        self.loop_stats: LoopStats | None = None  # the worker's event loop (its LoopWatch), when it reports one
        self._outbox: list[bytes] = []  # answers of this loop iteration, written together by _flush
        self.warm: str | None = None  # None: not asked; "asked"; "ok"; else why its warm-up failed
        self.warm_paths: dict[str, float] = {}  # its warm-up's ms per path (warm == "ok")

    def send(self, message: bytes) -> None:
        """Queue one answer for the worker; the answers of one loop iteration go out in one write (a batch of poses
        completes together, so its answers to one worker would otherwise cost one system call each).

        No drain: a worker has at most ``slots`` requests here, so its unread answers are bounded by the ring."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if self.writer.is_closing():
            log.info("ingest worker %d went away before %d bytes of answers were sent", self.pid, len(data))
            return
        self.writer.write(data)


def _phases_of(header: dict[str, Any], request_id: str) -> Phases:
    """This process's stopwatch of a worker's request, holding the worker's phases so far (receive, parse, decode)."""
    phases = Phases(request_id=request_id)
    worker_phases = header.get("phases")
    if worker_phases:  # {name: ms} written by our own worker (Phases.ms): taken as they are
        phases.ms.update(worker_phases)
    return phases


def _counts_of(rows: Any) -> dict[tuple[str, str], int]:
    """A worker's stats rows (endpoint, method, status, count) -> {(endpoint, status): count}."""
    out: dict[tuple[str, str], int] = {}
    for endpoint, _method, status, n in rows:
        key = (str(endpoint), str(status))
        out[key] = out.get(key, 0) + int(n)
    return out


def _loop_stats_of(fields: Any) -> LoopStats | None:
    """A worker's reported event-loop counters; None (and a warning) when they do not fit this server's."""
    try:
        return LoopStats.of(fields)
    except (TypeError, ValueError) as exc:
        log.warning("ingest worker sent unreadable event-loop counters (%s); ignored", exc)
        return None


def _synchronize_then_unpin(device: Any, ring: FrameRing) -> None:
    import torch

    torch.cuda.synchronize(device)
    unpin_ring(ring)


class IngestHub:
    """Serves the ingest workers' requests with ``state`` (a :class:`~server.state.ServerState`: the flow's host).

    socket_path: the Unix socket the workers connect to (created by :meth:`start`, removed by :meth:`stop`).
    """

    def __init__(self, state: Any, socket_path: Path) -> None:
        self.state = state
        self.socket_path = Path(socket_path)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.requests = 0  # track messages answered
        self._retired_counts: dict[tuple[str, str], int] = {}  # http_counts of workers that disconnected
        self._retired_frames = (0, 0)  # their streams' frames received, skipped
        self._retired_loops = LoopStats.empty()  # their event loops' lag and stalls (none stalled any more)
        self.refused_hellos = 0
        self.protocol_errors = 0
        # what a worker's warm-up runs with ({"object_id", "hw"}), from warm_workers on; None: workers are not asked
        self.warm_target: dict[str, Any] | None = None
        self._warm_changed = asyncio.Event()  # a worker connected, left or reported its warm-up

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)  # this user's processes only: the workers hold the API key anyway
        log.info("ingest hub listening on %s", self.socket_path)

    @property
    def connected(self) -> int:
        return len(self._connections)

    @property
    def page_locked(self) -> int:
        """Connected workers whose ring is page-locked (:func:`pin_ring`)."""
        return sum(c.pinned for c in self._connections)

    @property
    def in_flight(self) -> int:
        """Tracks and stream messages of the workers being served now (not the requests relayed to the app)."""
        return sum(len(c.tasks) - c.relayed for c in self._connections)

    async def stop(self) -> None:
        """Stop accepting, close every connection (their requests in progress are cancelled)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            for task in conn.tasks:
                task.cancel()
            conn.writer.close()
        await asyncio.gather(*(t for c in list(self._connections) for t in c.tasks), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    def families(self) -> list[Family]:
        return [
            Family("fp_ingest_workers_connected", "gauge", "Ingest worker processes connected to the GPU process.")
            .add(self.connected),
            Family("fp_ingest_in_flight", "gauge", "Ingest track requests being served by the GPU process.")
            .add(self.in_flight),
            Family("fp_ingest_requests_total", "counter", "Ingest requests (tracks and stream messages) answered by the GPU process.")
            .add(self.requests),
            self._http_family(),
            *self._stream_families(),
            *self._loop_families(),
        ]

    def _loop_families(self) -> list[Family]:
        """The workers' event loops together (their watches have the server's loop_stall_s; none when it is 0)."""
        stall_s = self.state.config.loop_stall_s
        if not stall_s > 0:
            return []
        total = self._retired_loops
        for conn in self._connections:
            if conn.loop_stats is not None:
                total += conn.loop_stats
        return loop_families(total, "fp_ingest_event_loop", "the ingest workers' event loops", LOOP_BEAT_S, stall_s)

    def _stream_families(self) -> list[Family]:
        conns = list(self._connections)
        received = self._retired_frames[0] + sum(c.stream_counts[1] for c in conns)
        skipped = self._retired_frames[1] + sum(c.stream_counts[2] for c in conns)
        return [Family("fp_ingest_streams_open", "gauge", "Open /track/stream connections of the ingest workers.")
                .add(sum(c.stream_counts[0] for c in conns)),
                Family("fp_ingest_stream_frames_received_total", "counter",
                       "Frame messages received by the ingest workers' streams.").add(received),
                Family("fp_ingest_stream_frames_skipped_total", "counter",
                       "Ingest workers' stream frames replaced by a newer one before they ran (newest frame wins).")
                .add(skipped)]

    def _http_family(self) -> Family:
        totals = dict(self._retired_counts)
        for conn in self._connections:
            for key, n in conn.http_counts.items():
                totals[key] = totals.get(key, 0) + n
        fam = Family("fp_ingest_http_requests_total", "counter", "Requests the ingest workers answered on the track "
                     "port, by endpoint and status, their own refusals (401, 413, 415, 422, a full ring's 503) "
                     "included (reported by each worker about once a second).")
        for (endpoint, status), n in sorted(totals.items()):
            fam.add(n, endpoint=endpoint, status=status)
        return fam

    # -- warm-up --------------------------------------------------------------------------------------------------------
    async def warm_workers(self, object_id: str, hw: tuple[int, int], count: int,
                           progress: Any = None) -> dict[int, dict[str, float]]:
        """Ask the workers to warm up with ``object_id`` at ``hw``, one at a time (those connecting later too), until
        ``count`` connected workers are warm: their ms per path, by process id. RuntimeError naming the worker when
        one's warm-up fails. progress: called with (warm, count) whenever that changes."""
        self.warm_target = {"object_id": object_id, "hw": [int(hw[0]), int(hw[1])]}
        self._ask_warm()
        shown = -1
        while True:
            self._warm_changed.clear()
            warm = [c for c in self._connections if c.warm == "ok"]
            failed = next((c for c in self._connections if c.warm not in (None, "asked", "ok")), None)
            if failed is not None:
                raise RuntimeError(f"ingest worker {failed.pid}: warm-up failed: {failed.warm}")
            if progress is not None and len(warm) != shown:
                shown = len(warm)
                progress(shown, count)
            if len(warm) >= count:
                return {c.pid: dict(c.warm_paths) for c in warm}
            await self._warm_changed.wait()

    def _ask_warm(self) -> None:
        """Ask the next connected worker not asked yet to warm up, once none is warming: one worker at a time, as
        each warm-up's relayed register needs the register lane (two in flight) and must not be refused as overload
        by its fellow workers' registers."""
        if self.warm_target is None or any(c.warm == "asked" for c in self._connections):
            return
        conn = next((c for c in self._connections if c.warm is None), None)
        if conn is not None:
            conn.warm = "asked"
            conn.send(pack({"op": "warm", **self.warm_target}))

    def _warmed(self, conn: _Connection, header: dict[str, Any]) -> None:
        """A worker's warm-up report: ``{"op": "warmed", "paths": {name: ms}}`` or ``{"op": "warmed", "error"}``."""
        if header.get("error"):
            conn.warm = str(header["error"])
            log.error("ingest worker %d: warm-up failed: %s", conn.pid, conn.warm)
        else:
            conn.warm = "ok"
            conn.warm_paths = {str(k): float(v) for k, v in (header.get("paths") or {}).items()}
            self._ask_warm()
        self._warm_changed.set()

    # -- one connection ------------------------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = None
        try:
            conn = await self._hello(reader, writer)
            if conn is None:
                return
            self._connections.add(conn)
            self._warm_changed.set()
            self._ask_warm()
            max_body = max(MAX_BODY_BYTES, self.state.config.max_upload_bytes + (1 << 16))  # a relayed upload
            handlers = {"track": self._track, "stream": self._stream, "http": self._http}
            while True:
                message = await read_message(reader, max_body)
                if message is None:
                    break
                header, body = message
                op = header["op"]
                if op == "stats":  # the worker's own answers so far (its refusals included)
                    conn.http_counts = _counts_of(header.get("requests") or ())
                    conn.stream_counts = tuple(int(v) for v in header.get("streams") or (0, 0, 0))
                    if header.get("loop") is not None:
                        conn.loop_stats = _loop_stats_of(header["loop"])
                    continue
                if op == "end":  # in order, before later messages
                    self._end_stream(conn, str(header.get("stream")))
                    continue
                if op == "warmed":
                    self._warmed(conn, header)
                    continue
                handler = handlers.get(op)
                if handler is None:
                    raise ProtocolError(f"unexpected op {op!r}")
                # a worker's own warm-up request (its warm_worker) is served while the server still starts
                coro = handler(conn, header, body)
                task = warm_task(coro) if header.get("warmup") is True else asyncio.create_task(coro)
                conn.tasks.add(task)
                task.add_done_callback(conn.tasks.discard)
        except (ProtocolError, ConnectionError) as exc:
            self.protocol_errors += 1
            log.warning("ingest worker connection dropped: %s", exc)
        finally:
            if conn is not None:
                self._connections.discard(conn)
                self._ask_warm()  # a worker gone while warming: the next one goes on
                self._warm_changed.set()
                for key, n in conn.http_counts.items():  # a gone worker's answers stay counted
                    self._retired_counts[key] = self._retired_counts.get(key, 0) + n
                if conn.loop_stats is not None:  # its loop's lag and stalls stay counted; it is no longer stalled
                    self._retired_loops += dataclasses.replace(conn.loop_stats, stalled=0)
                _, received, skipped = conn.stream_counts  # its streams closed with it
                self._retired_frames = (self._retired_frames[0] + received, self._retired_frames[1] + skipped)
                for task in conn.tasks:  # nobody is left to read their answers
                    task.cancel()
                await asyncio.gather(*conn.tasks, return_exceptions=True)
                for stream_id in list(conn.streams):  # the worker's connections are gone with it
                    self._end_stream(conn, stream_id)
                if conn.pinned:  # copies of its frames may still be queued on the GPU: let them finish first
                    await asyncio.to_thread(_synchronize_then_unpin, self._device(), conn.ring)
                log.info("ingest worker %d disconnected", conn.pid)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Connection | None:
        message = await read_message(reader)
        if message is None:
            return None
        header, _ = message
        try:
            if header["op"] != "hello":
                raise ValueError(f"first message must be hello, got {header['op']!r}")
            max_hw = tuple(int(v) for v in header["max_hw"])
            if max_hw != tuple(self.state.config.max_image_hw):
                raise ValueError(f"worker max_hw {max_hw} != the server's {tuple(self.state.config.max_image_hw)}")
            pid = int(header.get("pid", -1))
            ring = FrameRing.open(Path(header["ring"]), int(header["slots"]), max_hw)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            self.refused_hellos += 1
            log.warning("ingest worker refused: %s", exc)
            writer.write(pack({"op": "refused", "reason": str(exc)}))
            await writer.drain()
            return None
        ring.unlink()  # mapped on both sides now: the memory goes with the last mapping
        pinned = await asyncio.to_thread(pin_ring, ring, self._device())  # page-locking ~70 MB takes a while
        writer.write(pack({"op": "ready", "track_ms": self._track_ms()}))
        await writer.drain()
        log.info("ingest worker %d connected: a ring of %d slots (%d MiB), %s", pid, ring.slots, ring.size >> 20,
                 "page-locked for the GPU" if pinned else "frames staged by copy")
        return _Connection(pid, ring, writer, pinned)

    def _device(self) -> Any:
        """The GPU process's device (:attr:`ServerState.device`: workers connect while the networks still load), or
        None when it cannot be had (CUDA asked for, none here): the start-up reports that, not a hello."""
        try:
            return self.state.device
        except ValueError:
            return None

    async def _track(self, conn: _Connection, header: dict[str, Any], _body: bytes) -> None:
        """A worker's ``POST /track/binary``: the flow's track step on its typed input; answered, counted and logged
        by the app's functions (its 499 when the worker went away meanwhile)."""
        started = time.perf_counter()
        request_id = str(header.get("request_id") or "-")
        host, state = self.state, {}
        host.metrics.request_started()
        status = CLIENT_GONE
        try:
            phases = _phases_of(header, request_id)
            request = wire.input_of(header["input"], slot_frame(conn.ring, header))
            body, result = await steps.track(host, ENDPOINT, request, phases, in_loop=self._submit_in_loop(conn))
            answer = steps.answer_of(host.metrics, ENDPOINT, body, result, phases)
            status, content, media_type = 200, answer.content, "application/json"
            headers = [list(pair) for pair in answer.headers()]
        except Exception as exc:  # noqa: BLE001 - every error becomes its HTTP answer, as on the main port
            response = error_response(exc, request_id, retry_after_s=host.config.retry_after_s, state=state)
            status, content, media_type = response.status_code, bytes(response.body), response.media_type
            headers = [[k, v] for k, v in response.headers.items()
                       if k.lower() not in ("content-length", "content-type")]
        finally:
            finish_request(host.metrics, request_id, "POST", ENDPOINT, status, time.perf_counter() - started, state)
        self.requests += 1
        conn.send(pack({"op": "answer", "id": header.get("id"), "status": status, "headers": headers,
                        "media_type": media_type or "application/json", "track_ms": self._track_ms()}, content))

    async def _http(self, conn: _Connection, header: dict[str, Any], body: bytes) -> None:
        """A request the worker relayed whole: answered by the app (:attr:`ServerState.app`) as if it had come in
        here; its answer goes back with every header."""
        path = str(header["path"])
        status, headers, content = 500, [], b""
        conn.relayed += 1
        try:
            answer = await call_http(self.state.app, str(header["method"]), path,
                                     headers=[(k, v) for k, v in header["headers"]], body=body,
                                     query=str(header.get("query", "")), raw_path=str(header.get("raw_path") or path),
                                     client=header.get("client"))
            status, headers, content = answer.status, answer.headers, answer.body
        except Exception:  # noqa: BLE001 - the app's middleware answers every error; this is one after its answer
            log.exception("relayed %s %s failed after its answer started", header["method"], path)
        finally:
            conn.relayed -= 1
        conn.send(pack({"op": "answer", "id": header.get("id"), "status": status, "headers": headers,
                        "track_ms": self._track_ms()}, content))

    def _submit_in_loop(self, conn: _Connection) -> bool:
        """Whether a worker's frames are validated and submitted on this event loop instead of a worker thread each
        (:class:`~server.flow.backend.LocalBackend`): those of a page-locked ring, which need neither a decode nor a
        staging copy (elsewhere each request copies ~2 MB). On the H200, 64 binary clients through 8 workers: 970
        tracks/s (p99 118 ms) against 821-867 from worker threads."""
        return conn.pinned

    def _track_ms(self) -> float:
        """The track lane's measured service time (ms): the workers' Retry-After when their ring is full."""
        return round(float(self.state.service_times.ms("track")), 3)

    # -- WS /track/stream of a worker ------------------------------------------------------------------------------------
    async def _stream(self, conn: _Connection, header: dict[str, Any], _body: bytes) -> None:
        """One message of a worker's stream, answered by this process's :class:`~server.flow.stream.SessionStream` of
        that connection (the main port's steps, sessions and admission); the answer is its body and timings, or its
        error with the stream's judgement (status, and how the stream must end if it must)."""
        stream_id = str(header.get("stream"))
        handler = conn.streams.get(stream_id)
        if handler is None:
            handler = conn.streams[stream_id] = SessionStream(self.state, stream_id, in_loop=self._submit_in_loop(conn))
        number = header.get("frame")
        phases = _phases_of(header, f"{stream_id}:{number}")
        reply: dict[str, Any] = {"op": "answer", "id": header.get("id"), "track_ms": self._track_ms()}
        try:
            request = wire.input_of(header["input"], slot_frame(conn.ring, header) if "slot" in header else None)
            kind = header["input"]["kind"]
            item = StreamItem(kind, time.perf_counter_ns(), number, request)
            step = {"register": handler.register, "start": handler.start, "frame": handler.frame}[kind]
            body, timings = await step(item, phases)
            observe_answer(self.state.metrics, kind, timings, phases)
            reply.update(ok=True, body=body, timings={**timings, **{k: round(v, 4) for k, v in phases.ms.items()}})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered and judged by the stream's own rules
            status, closing = handler.judge(exc)
            reply.update(ok=False, status=status, closing=list(closing) if closing else None,
                         error=handler.error(exc))
        self.requests += 1
        conn.send(pack(reply))

    def _end_stream(self, conn: _Connection, stream_id: str) -> None:
        handler = conn.streams.pop(stream_id, None)
        if handler is not None:
            handler.end()
