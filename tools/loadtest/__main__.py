"""``python -m tools.loadtest``: see the package's docstring."""

import sys

from .cli import main

sys.exit(main())
