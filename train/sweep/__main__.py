"""``python -m train.sweep``: see :mod:`train.sweep.cli`."""

import sys

from train.sweep import cli

sys.exit(cli.main())
