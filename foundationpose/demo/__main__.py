"""``python -m foundationpose.demo``: see :mod:`foundationpose.demo.cli`."""

import sys

from foundationpose.demo.cli import main

sys.exit(main())
