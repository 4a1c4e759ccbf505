"""The HTTP API, declared once: the routes of ``python -m server`` and of the Ray Serve ingress
(:func:`server.api.app.build_api`). Importing the package imports none of its modules (an ingest worker, torch-free,
reads :mod:`.bodies` and :mod:`.stream` only)."""
