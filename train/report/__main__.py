"""``python -m train.report``: see :mod:`train.report.cli`."""

import sys

from train.report import cli

sys.exit(cli.main())
