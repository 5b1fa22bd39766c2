"""`python -m muster.cli`: the `muster` command."""

import sys

from muster.cli import main

sys.exit(main())
