"""Bounded load test of the pose service, loopback only, clients in several processes; prints one JSON summary.

    python -m tools.loadtest --spawn --clients 4 --duration-s 20                 # start a tiny server itself
    python -m tools.loadtest --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode stream
    python -m tools.loadtest --url http://127.0.0.1:8000 --clients 64 --processes 8 --mode http-raw         --registers-alongside 2 --tracks-per-register 1000
    python -m tools.loadtest --url http://127.0.0.1:8000 --track-url http://127.0.0.1:8001 --mode http-binary
    python -m tools.loadtest --spawn --spawn-ingest-workers 4 --mode http-binary --clients 16 --processes 4

``--clients`` concurrent clients are spread over ``--processes`` worker processes (each an asyncio
loop), so the load generator is not the bottleneck. Each client loops: register on a synthetic frame,
then ``--tracks-per-register`` tracks of that session, then end the session.

Set-up, then the measured window: first every track client obtains its session (a register; a stream
keeps its connection open), waiting out each refusal as the server asks, for at most
``--setup-timeout-s``; then all worker processes start the clock together (a barrier) and the window of
``--duration-s`` begins with every session ready, so it measures tracking, not the register lane's
start-up storm (64 clients registering at once against a lane of ~10 registers/s). A client whose set-up
ran out registers inside the window. ``--no-setup``: no set-up phase, every client registers inside the
window (the old behaviour). ``--mode``:

* ``http-png``: ``POST /track`` with PNG frames (multipart), ``DELETE /sessions/{id}`` at the end;
* ``http-raw``: ``POST /track`` with raw frames (``rgb_shape`` / ``depth_shape`` / ``depth_dtype`` fields);
* ``http-binary``: ``POST /track/binary``, raw frames in one binary body (packed once per session);
  with ``--track-url`` every ``POST /track/binary`` (session and stateless tracks) goes to that URL (a
  server's ingest workers' track port, ``python -m server --ingest-workers N --ingest-port P``) and
  everything else (registers, deletes, /metrics) to ``--url``;
* ``stream``: ``WS /track/stream``, one connection per session, the next frame after each answer;
* ``stream-deflate``: the same, offering ``permessage-deflate`` as ``websockets``' default client does
  (``python -m server`` refuses it; against a server that accepts it, this shows what zlib costs per frame).

``--registers-alongside N`` adds N clients that only register (HTTP, PNG), offering ``--register-rate``
registers/s together inside the window (they have no set-up), to see registers/s under track load.

Random weights make tracking drift out of the working range after a few hundred steps, and every later
track of that session is a 422 naming ``pose``: such a track is counted in ``diverged`` (not as an
error), and the client registers a new session (``--on-diverge reregister``; a stream reconnects and
registers) or goes on from the registered pose without a register (``--on-diverge stateless``: HTTP
with stateless tracks; a stream reconnects with a ``start`` message from that pose, endpoint
``stream_start``). Latency percentiles are of answered (status < 400) requests only; refusals and
errors are counted by status. The window stops at ``--duration-s`` or after ``--max-requests``
requests, whichever comes first. A 503/429 is counted as a refusal and the client waits the server's
``Retry-After-Ms`` (else ``Retry-After``) times 1 + U(0, 0.1) (jitter), at most 10 s and never past the
end of its phase (the set-up's timeout, the window's end), then goes on (a stream sends the refused
register again on its connection).

Only loopback targets are allowed (127.0.0.1, localhost, ::1): this tool must never load someone
else's server. ``--spawn`` runs ``python -m server`` with a tiny configuration (4 hypotheses, 1
iteration, random weights unless ``--weights``) on a free 127.0.0.1 port with a random API key and a
temporary objects directory, waits for ``/readyz`` and stops it at the end; with
``--spawn-ingest-workers N`` (``--mode http-binary`` only) it also passes ``--ingest-workers N
--ingest-port P`` (another free port), waits for that port's ``/healthz`` and sends the tracks there.

Output (stdout): ``{"requests", "elapsed_s", "requests_per_s", "tracks_per_s", "registers_per_s", "endpoints": {name:
{count, ok, diverged, p50_ms, p90_ms, p99_ms, mean_ms, per_s, active_per_s, errors_by_status}}, "refusals",
"errors_by_status", "diverged", "transport_errors", "refusals_without_retry_after", "stream_outside_phases_ms": {p50_ms,
p90_ms, p99_ms}, "setup": {...}, "server_phases_ms": {endpoint: {phase: mean ms}}, "server_stages_ms": ...,
"load_generator": {processes, cpu_fraction, busiest, saturated}, "settings": {..., "url", "track_url"}}``
(``track_url``: where the track requests went, ``url`` unless ``--track-url`` or ``--spawn-ingest-workers``;
``load_generator``: each load process's CPU seconds per second of the window, ``saturated`` from 0.85 on, with a
warning on stderr: the figures may then be the generator's limit, not the server's; with ``--processes 1`` the load
runs in the calling process, whose other threads count too).
Everything but ``setup`` and the ``server_*`` keys is the measured window only (``elapsed_s`` its
length). ``setup`` (null with ``--no-setup``): ``{seconds, timeout_s, clients, sessions_ready,
registers_ok, registers_refused, register_p50_ms, register_p99_ms, errors_by_status, transport_errors,
refusals_without_retry_after, error_samples}`` (``seconds``: the first process's set-up start to the
last one's end; ``sessions_ready``: track clients that entered the window with a session).
``server_phases_ms`` / ``server_stages_ms`` are means from /metrics deltas over set-up and window
together (the track endpoints' are the window's: the set-up sends no track); ``server_counts`` is how much
the track lane's counters grew over them (batches, batched requests, inline tracks, driver launches, graph
captures: the window's, as the set-up sends no track); ``server_gpu_p50_ms`` each pipeline stage's recent
median GPU time at the end (``"track/step"``: ms); the other ``server_*`` keys are the server's counters
at the end. ``stateless_tracks``: the answered HTTP tracks sent without a session (with ``--on-diverge
stateless``, after their session diverged). ``per_s`` over the whole window,
``active_per_s`` between the endpoint's first and last answer, i.e. without the ramp-up;
``refusals_without_retry_after`` counts the 429/503 answers, by ``"endpoint status"``, that lacked a
``Retry-After`` header (a stream's error: ``retry_after_ms``); ``stream_outside_phases_ms``: per answered stream frame, the round trip minus the
server's phases in its ``timings_ms``, i.e. transport and client time); progress goes to stderr.
"""

from __future__ import annotations

from .cli import build_parser, main
from .clients import (
           HTTP_CLIENTS,
           MODES,
           OBJECT_ID,
           RETRY_CAP_S,
           RETRY_JITTER,
           SCENE_OBJECT_IDS,
           SCENES,
           Uploads,
           _request,
           is_diverged,
           retry_wait_s,
           scene_frame,
)
from .run import _split, check_loopback, run_load
from .spawn import spawned_server
from .stats import Stats, _counter_deltas, _generator_summary, _histogram_means, _stage_gpu_p50_ms, digest

# the leading-underscore names are the tools' and tests' handles on the pieces (serve_bench reuses the clients)
__all__ = ["HTTP_CLIENTS", "MODES", "OBJECT_ID", "RETRY_CAP_S", "RETRY_JITTER", "SCENES", "SCENE_OBJECT_IDS", "Stats",
           "Uploads", "_counter_deltas", "_generator_summary", "_histogram_means", "_request", "_split",
           "_stage_gpu_p50_ms", "build_parser", "check_loopback", "digest", "is_diverged", "main", "retry_wait_s",
           "run_load", "scene_frame", "spawned_server"]
