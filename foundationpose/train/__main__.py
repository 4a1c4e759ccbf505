"""``python -m foundationpose.train``: train the refiner and scorer for one object (see :mod:`foundationpose.train`)."""

from foundationpose.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
