"""``python -m server --objects DIR [...]``: run the HTTP service (see ``server.cli`` and ``--help``)."""

import sys

from server.cli import main

sys.exit(main())
