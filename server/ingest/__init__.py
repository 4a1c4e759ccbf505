"""Ingest workers: the server's port served by extra processes, each receiving, parsing and decoding
``POST /track/binary`` and ``WS /track/stream`` under its own GIL, handing decoded frames to the GPU process through
shared memory, and relaying every other request whole to the GPU process's app.

    worker process (x N)                                GPU process (python -m server)
    uvicorn on the connections the GPU process passes   IngestHub on the app's event loop (Unix socket)
    auth, body limit, parse, decode -> FrameRing slot   -> server.flow.steps.track (sessions, admission,
    the typed input, a few hundred bytes ------------->     batching, errors) -> the HTTP answer's bytes
    other requests, whole  --------------------------->  the app itself
    answer bytes back to the client  <-----------------

:mod:`~deploy_core.memory.ring` (the shared frame slots), :mod:`~server.ingest.protocol` (the socket messages),
:mod:`~server.flow.wire` (the typed inputs in them), :mod:`~server.ingest.hub` (the GPU process's end),
:mod:`~server.ingest.worker` (one worker process), :mod:`~server.ingest.dispatch` (the connections handed out),
:mod:`~server.ingest.workers` (the processes: start, restart, stop).
"""
