"""``python -m train.curvature``: see :mod:`train.curvature.cli`."""

import sys

from train.curvature import cli

sys.exit(cli.main())
