"""`python -m stp`: the `stp` command, where no console script is installed."""

import sys

from stp.cli.main import main

sys.exit(main())
