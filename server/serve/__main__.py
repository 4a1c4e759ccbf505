"""``python -m server.serve --objects DIR --replicas N [...]``: the service on Ray Serve (see ``server.serve.cli``)."""

import sys

from server.serve.cli import main

sys.exit(main())
