"""The request flow: what happens to a pose request between the bytes a transport received and its answer,
written once for every transport (multipart HTTP, ``/track/binary``, ``WS /track/stream``, the ingest workers'
track port, the Ray Serve ingress).

* :mod:`.message`: the binary message container (the stream's messages, the binary bodies);
* :mod:`.inputs`: a request's fields parsed into typed values (the same refusals on every port);
* :mod:`.frames`: its images decoded (encoded or raw, into new arrays or a worker's slot);
* :mod:`.validation`: the decoded frame and values validated (``foundationpose.validate`` plus K's fit);
* :mod:`.backend`: the backend interface and the local backend (a ``PoseService`` in this process);
* :mod:`.steps`: the session steps (register, track, start) on a host, and the answers;
* :mod:`.stream`: the stream's state machine (newest frame wins, answers in order, errors that spare the session).
"""
