"""`python -m rllib_dreamerv3 ...`: the `rllib` command (see `rllib_dreamerv3.cli`)."""

import sys

from rllib_dreamerv3.cli import main

sys.exit(main(prog="python -m rllib_dreamerv3"))
