"""Ingest workers: ``POST /track/binary`` served by extra processes on a track port, each receiving, parsing and
decoding under its own GIL, handing decoded frames to the GPU process through shared memory.

    worker process (x N)                                GPU process (python -m server)
    uvicorn on the track port (inherited socket)        IngestHub on the app's event loop (Unix socket)
    auth, body limit, parse, decode -> FrameRing slot   -> routes_pose.track_frame (sessions, admission,
    one small message per request  ------------------>     batching, errors) -> the HTTP answer's bytes
    answer bytes back to the client  <-----------------

:mod:`~deploy_core.memory.ring` (the shared frame slots), :mod:`~server.ingest.protocol` (the socket messages),
:mod:`~server.ingest.hub` (the GPU process's end), :mod:`~server.ingest.worker` (one worker process),
:mod:`~server.ingest.workers` (the processes: start, restart, stop).
"""
