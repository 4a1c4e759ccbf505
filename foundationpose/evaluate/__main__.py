"""``python -m foundationpose.evaluate`` (see :mod:`foundationpose.evaluate.cli`)."""

from foundationpose.evaluate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
