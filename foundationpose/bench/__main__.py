"""``python -m foundationpose.bench``: see :mod:`foundationpose.bench.e2e`."""

import sys

from foundationpose.bench.e2e import main

sys.exit(main())
