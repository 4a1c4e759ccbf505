"""``server.ingest.dispatch``: the GPU process accepts the track port's connections and hands each to the ingest
worker with the fewest open ones. Units with real sockets and stand-in workers (threads on the workers' ends),
then the real server: keep-alive connections spread evenly over its worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from server.ingest.dispatch import ConnectionDispatcher, ConnectionReceiver
from server.ingest.protocol import WORKER_HEADER
from tests.server._helpers import write_objects_dir
from tests.server.test_ingest import WAIT_S, _serve, _until


class _StandInWorker:
    """A thread on a worker's end of its channel: keeps every connection it is handed and reports how many it holds
    open (as the real worker does; ``close_all`` closes them and reports 0)."""

    def __init__(self, end: socket.socket) -> None:
        self.end, self.conns, self.received = end, [], 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.end, 64, 64)
            except OSError:
                return
            if not data and not fds:
                return
            with self.lock:
                for fd in fds:
                    self.conns.append(socket.socket(fileno=fd))
                    self.received += 1
                self.report()

    def report(self) -> None:
        self.end.send(f"{len(self.conns)} {self.received}\n".encode())

    def close_all(self) -> None:
        with self.lock:
            for conn in self.conns:
                conn.close()
            self.conns = []
            self.report()

    def count(self) -> int:
        with self.lock:
            return len(self.conns)


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


@pytest.fixture
def connect(listener) -> Iterator:
    """``connect(n)``: n client connections to ``listener``, all closed after the test."""
    opened: list[socket.socket] = []

    def open_n(n: int) -> None:
        opened.extend(socket.create_connection(listener.getsockname()) for _ in range(n))

    yield open_n
    for conn in opened:
        conn.close()


@contextlib.contextmanager
def _running(dispatcher: ConnectionDispatcher) -> Iterator[ConnectionDispatcher]:
    dispatcher.start()
    try:
        yield dispatcher
    finally:
        dispatcher.stop()


def test_connections_go_to_the_worker_with_the_fewest_open(listener, connect):
    dispatcher = ConnectionDispatcher(listener)
    workers = [_StandInWorker(dispatcher.attach(i)) for i in range(3)]
    with _running(dispatcher):
        for n in range(1, 10):  # one at a time: each goes where the fewest are open
            connect(1)
            _until(lambda n=n: sum(w.count() for w in workers) == n, f"{n} connections handed over")
        assert [w.count() for w in workers] == [3, 3, 3]
        workers[1].close_all()  # its connections closed: the next three go to it
        _until(lambda: dispatcher.loads()[1] == 0, "worker 1's report of no open connections")
        connect(3)
        _until(lambda: sum(w.count() for w in workers) == 9, "three more handed over")
        assert [w.count() for w in workers] == [3, 3, 3] and workers[1].received == 6
        assert dispatcher.dispatched == 12 and dispatcher.dropped == 0


def test_a_worker_that_went_away_gets_nothing_and_a_restart_takes_its_place(listener, connect):
    dispatcher = ConnectionDispatcher(listener)
    first = _StandInWorker(dispatcher.attach(0))
    dispatcher.attach(1).close()  # worker 1 exited: its end closed
    with _running(dispatcher):
        _until(lambda: 1 not in dispatcher.loads(), "the exited worker's channel dropped")
        connect(4)
        _until(lambda: first.count() == 4, "every connection to the live worker")
        restarted = _StandInWorker(dispatcher.attach(1))  # the restart: a new channel for the slot
        connect(4)
        _until(lambda: restarted.count() == 4, "the restarted worker catches up")
        assert first.count() == 4 and dispatcher.dropped == 0


def test_connections_wait_in_the_backlog_until_a_worker_is_attached(listener, connect):
    dispatcher = ConnectionDispatcher(listener)
    with _running(dispatcher):
        connect(2)  # no worker yet: accepted by the kernel, not by the dispatcher
        # two whole passes of its loop that began after the connections were waiting: each had its chance to
        # (wrongly) take them
        assert dispatcher.wait_rounds(dispatcher.rounds + 2, WAIT_S), "the dispatcher's loop stopped turning"
        assert dispatcher.dispatched == 0 and dispatcher.dropped == 0
        worker = _StandInWorker(dispatcher.attach(0))
        _until(lambda: worker.count() == 2, "the waiting connections handed over")


def test_an_unreadable_report_is_ignored_and_later_ones_count(listener):
    dispatcher = ConnectionDispatcher(listener)
    with dispatcher.attach(0) as end, _running(dispatcher):
        end.send(b"garbage\n")
        end.send(b"5 0\n")
        _until(lambda: dispatcher.loads() == {0: 5}, "the readable report taken")


def test_the_receiver_serves_passed_connections_with_the_given_protocol():
    """ConnectionReceiver: each passed descriptor becomes a connection of ``protocol_factory`` on the loop, and
    the open count is reported back."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    served: list[bytes] = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            served.append(data)
            self.transport.write(data.upper())

    async def main():
        receiver = ConnectionReceiver(theirs.detach(), Echo, lambda: len(served))
        receiver.start()
        a, b = socket.socketpair()
        socket.send_fds(ours, [b"c"], [b.fileno()])
        b.close()
        a.sendall(b"ping")
        a.setblocking(False)
        loop = asyncio.get_running_loop()
        answer = await asyncio.wait_for(loop.sock_recv(a, 16), WAIT_S)
        report = b""
        ours.setblocking(False)
        while not report.endswith(b"1 1\n"):  # until a report counts the passed descriptor and its connection
            report += await asyncio.wait_for(loop.sock_recv(ours, 64), WAIT_S)
        receiver.stop()
        a.close()
        return answer, receiver.received, report

    answer, received, report = asyncio.run(main())
    ours.close()
    assert answer == b"PING" and received == 1 and served == [b"ping"]
    assert report.split(b"\n")[0] == b"0 0"  # the first report: nothing yet
    assert set(report.split(b"\n")[1:-1]) <= {b"0 1", b"1 1"}  # then the descriptor, then its connection


def test_a_connection_no_worker_can_take_goes_to_the_fallback(listener, connect):
    """With no worker attached (every one given up) the dispatcher listens all the same and hands each connection to
    its fallback (the GPU process's own server), which gets a socket of its own; once a worker is attached the
    connections go to it."""
    taken: list[socket.socket] = []
    handed = threading.Event()

    def fallback(sock: socket.socket) -> None:
        taken.append(sock)
        handed.set()

    dispatcher = ConnectionDispatcher(listener, fallback)
    dispatcher.start()
    worker = None
    try:
        with socket.create_connection(listener.getsockname()) as client:
            client.sendall(b"GET /healthz")
            assert handed.wait(WAIT_S), "the fallback never got the connection"
            taken[0].settimeout(WAIT_S)
            assert taken[0].recv(64) == b"GET /healthz"  # its own socket: the dispatcher closed its copy
        assert (dispatcher.served_here, dispatcher.dropped) == (1, 0)
        worker = _StandInWorker(dispatcher.attach(0))
        connect(1)
        _until(lambda: worker.count() == 1, "the attached worker's connection")
        assert dispatcher.served_here == 1
    finally:
        dispatcher.stop()
        for sock in taken:
            sock.close()


@pytest.mark.slow
def test_keep_alive_connections_spread_evenly_over_the_server_workers(tiny_estimator, tmp_path):
    """The real server, 3 workers: 9 keep-alive connections on the track port, 3 per worker process (``/healthz``
    is relayed, and its answer names the worker that received it)."""
    with _serve(tiny_estimator, write_objects_dir(tmp_path / "objects"), ingest_workers=3) as served:
        port = served.state.ingest_workers.port
        clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30.0) for _ in range(9)]
        try:
            pids = []
            for client in clients:  # one after the other: each connection opens on its first request
                pids.append(client.get("/healthz").headers[WORKER_HEADER])
                opened = len(pids)
                _until(lambda opened=opened: sum(served.state.ingest_workers.dispatcher.loads().values()) >= opened,
                       "the worker's report of the new connection")
            assert sorted(pids.count(p) for p in set(pids)) == [3, 3, 3]
            for client in clients:  # each connection stays with its worker
                assert client.get("/healthz").headers[WORKER_HEADER] == pids[clients.index(client)]
            metrics = served.client.get("/metrics").text
            for slot in range(3):  # the balance, as operators see it
                assert f'fp_ingest_worker_connections{{worker="{slot}"}} 3' in metrics
        finally:
            for client in clients:
                client.close()
