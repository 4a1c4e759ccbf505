"""Spreading the ingest workers' port's connections evenly over the workers.

When every worker accepts on one shared listening socket, the kernel hands a new connection to whichever worker
wakes first, so long-lived connections (keep-alive HTTP clients, streams) end up unevenly: on the H200 under 64
clients the busiest of 8 workers used 0.7-0.9 of a core while another used 0.06-0.3, and the clients of the busy
one waited on its event loop. Here the GPU process accepts instead (:class:`ConnectionDispatcher`, one thread that
only accepts and passes file descriptors) and hands each connection to the worker with the fewest open
connections, over a Unix socket pair per worker (``SCM_RIGHTS``); the worker (:class:`ConnectionReceiver`) serves
it with its uvicorn server's own protocol, as if it had accepted it, and reports its open connections back so that
closed ones count.

Channel messages: GPU process -> worker, one byte ``c`` with one descriptor per connection; worker -> GPU process,
ASCII lines ``"<open> <received>\\n"``: its open connections and how many descriptors it has received in all (the
dispatcher adds the ones sent since, which the report cannot include yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable

__all__ = ["ConnectionDispatcher", "ConnectionReceiver", "REPORT_S"]

log = logging.getLogger(__name__)

REPORT_S = 0.05  # how often a worker reports its open connections (only when they changed)
_POLL_S = 0.2  # the dispatcher's wait between looks at its channel list (restarts) and the stop flag


class _Channel:
    """The GPU process's end of one worker's socket pair and what it knows of the worker's connections."""

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index, self.sock = index, sock
        self.sent = 0  # descriptors sent
        self.open = 0  # the worker's last report: open connections ...
        self.received = 0  # ... when it had received this many descriptors
        self._partial = b""

    @property
    def load(self) -> int:
        """Open connections now, as best known: the last report plus the descriptors sent after it."""
        return self.open + (self.sent - self.received)

    def read_reports(self) -> bool:
        """Take the worker's report lines; False when the worker's end is closed (it exited)."""
        try:
            data = self.sock.recv(4096)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines[-1:]:  # only the newest report matters
            try:
                open_now, received = (int(v) for v in line.split())
            except ValueError:
                log.warning("ingest worker slot %d: unreadable connection report %r", self.index, line[:40])
                continue
            self.open, self.received = open_now, received
        return True


class ConnectionDispatcher:
    """Accepts on ``listener`` in a thread of its own and passes each connection to the worker with the fewest open
    ones (ties: the lowest index). :meth:`attach` gives a worker slot a new channel and returns the worker's end (to
    be inherited by the worker process); a worker that exits is dropped when its end closes.

    fallback: takes a connection no worker can take (none attached: every worker given up; or every channel full), in
    this thread, as its own socket: the GPU process then serves it itself, so the server's port answers whatever
    becomes of the workers. Without one, connections wait in the listen backlog while no worker is attached. (A
    worker's channel is attached before its process starts: the connections it is handed meanwhile wait there.)"""

    def __init__(self, listener: socket.socket,
                 fallback: Callable[[socket.socket], None] | None = None) -> None:
        self.listener = listener
        self._fallback = fallback
        listener.setblocking(False)
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()
        self._changed = True
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.dispatched = 0
        self.dropped = 0  # connections closed because no worker could take them (and there is no fallback)
        self.served_here = 0  # connections handed to the fallback
        self.rounds = 0  # passes of the dispatcher's loop (each: one wait for its sockets, then what they had)
        self._rounds_changed = threading.Condition()

    def attach(self, index: int) -> socket.socket:
        """A new socket pair for worker slot ``index`` (replacing its previous one); returns the worker's end,
        inheritable, which the caller closes once the worker process has it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        theirs.set_inheritable(True)
        with self._lock:
            old = self._channels.pop(index, None)
            self._channels[index] = _Channel(index, ours)
            self._changed = True
        if old is not None:
            old.sock.close()
        return theirs

    def loads(self) -> dict[int, int]:
        """Open connections per attached worker slot, as best known (for logs and tests)."""
        with self._lock:
            return {i: c.load for i, c in sorted(self._channels.items())}

    def wait_rounds(self, rounds: int, timeout: float) -> bool:
        """Wait until the loop has completed ``rounds`` passes in all (:attr:`rounds`); False at the timeout. A pass
        started after an event has seen it: tests wait for states, not for time."""
        with self._rounds_changed:
            return self._rounds_changed.wait_for(lambda: self.rounds >= rounds, timeout)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fp-ingest-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.sock.close()

    # -- the thread --------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        registered: list[_Channel] = []
        listening = False
        try:
            while not self._stopping.is_set():
                with self._lock:
                    if self._changed:
                        self._changed = False
                        for channel in registered:
                            with contextlib.suppress(KeyError, ValueError):  # closed (dropped, replaced) meanwhile
                                selector.unregister(channel.sock)
                        registered = list(self._channels.values())
                        for channel in registered:
                            selector.register(channel.sock, selectors.EVENT_READ, channel)
                    want_listen = bool(self._channels) or self._fallback is not None
                if want_listen != listening:
                    if want_listen:
                        selector.register(self.listener, selectors.EVENT_READ, None)
                    else:
                        selector.unregister(self.listener)
                    listening = want_listen
                for key, _ in selector.select(_POLL_S):
                    if key.data is None:
                        self._accept_all()
                    elif not key.data.read_reports():
                        self._drop(key.data)
                with self._rounds_changed:
                    self.rounds += 1
                    self._rounds_changed.notify_all()
        finally:
            selector.close()

    def _drop(self, channel: _Channel) -> None:
        """A worker's end closed (it exited): forget its channel (a restart attaches a new one)."""
        with self._lock:
            if self._channels.get(channel.index) is channel:
                del self._channels[channel.index]
            self._changed = True
        channel.sock.close()

    def _accept_all(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave the rest in the backlog for the next round
                log.warning("ingest: accept failed: %s", exc)
                return
            with conn:
                self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        with self._lock:
            ranked = sorted(self._channels.values(), key=lambda c: (c.load, c.index))
        for channel in ranked:
            try:
                socket.send_fds(channel.sock, [b"c"], [conn.fileno()])
            except BlockingIOError:  # its channel is full (the worker is stalled): the next one
                continue
            except OSError:
                self._drop(channel)
                continue
            with self._lock:
                channel.sent += 1
            self.dispatched += 1
            return
        if self._fallback is not None:
            self.served_here += 1
            self._fallback(conn.dup())
            return
        self.dropped += 1
        log.warning("ingest: no worker could take a connection; closed it")


class ConnectionReceiver:
    """The worker's end: serves each connection the GPU process passes with ``protocol_factory`` (the uvicorn
    server's own), on the running loop, and reports ``open_connections()`` whenever it changed (every
    :data:`REPORT_S` at most). Takes no more once the GPU process's end closes (the worker learns of the GPU
    process going away from its hub connection)."""

    def __init__(self, channel_fd: int, protocol_factory: Callable[[], asyncio.Protocol],
                 open_connections: Callable[[], int]) -> None:
        self.channel = socket.socket(fileno=channel_fd)
        self.channel.setblocking(False)
        self._factory = protocol_factory
        self._open_connections = open_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._reporter: asyncio.Task | None = None
        self.received = 0
        self.closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.channel.fileno(), self._readable)
        self._reporter = self._loop.create_task(self._report())

    def stop(self) -> None:
        """Take no more connections (those being served go on)."""
        if self._loop is not None and not self.closed:
            self._loop.remove_reader(self.channel.fileno())
        if self._reporter is not None:
            self._reporter.cancel()
        self.closed = True

    def _readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.channel, 64, 64)
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("ingest worker %d: connection channel broke: %s", os.getpid(), exc)
            data, fds = b"", []
        for fd in fds:
            self.received += 1
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            task = asyncio.ensure_future(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not data and not fds:  # the GPU process's end closed
            self.stop()

    async def _serve(self, sock: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self._factory, sock)
        except OSError as exc:  # the client went away meanwhile
            log.info("ingest worker %d: a passed connection could not be served: %s", os.getpid(), exc)
            sock.close()

    async def _report(self) -> None:
        last = None
        while not self.closed:
            now = (self._open_connections(), self.received)
            if now != last:
                try:
                    self.channel.send(f"{now[0]} {now[1]}\n".encode())
                    last = now
                except BlockingIOError:
                    pass
                except OSError:
                    return
            await asyncio.sleep(REPORT_S)
