"""``python -m train.plot``: see :mod:`train.report.plot`."""

import sys

from train.report import plot

if __name__ == "__main__":
  sys.exit(plot.main())
