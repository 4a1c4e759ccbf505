"""``python -m foundationpose.quant``: see :mod:`foundationpose.quant.cli`."""

from foundationpose.quant.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
