"""``python -m kvforge`` = the ``kvforge`` command."""

import sys

from kvforge.cli import main

sys.exit(main())
