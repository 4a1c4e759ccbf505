"""The HTTP service scaled out on Ray Serve: ``python -m server.serve --objects DIR --replicas N``.

One ingress replica (FastAPI through Serve's ingress) parses requests and holds the tracking
sessions; ``N`` pose replicas each hold their own :class:`~foundationpose.service.PoseService`
(``num_gpus`` each, fractional to share a GPU) and load objects from the shared objects directory.
Modules: :mod:`.settings` (the knobs), :mod:`.replica` (pose replica), :mod:`.ingress` (the HTTP and
stream routes, sessions, retries), :mod:`.backend` (a step as a call to a pose replica), :mod:`.routing` (session
affinity), :mod:`.calls` (what travels
between them), :mod:`.metrics_board` (metrics of every replica), :mod:`.app` (the Serve application),
:mod:`.cli` (the command).

Importing this package does not import ``ray``; the modules that need it do.
"""
