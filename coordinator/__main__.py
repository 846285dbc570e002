"""``python -m coordinator``: the ``coordinator`` command (see coordinator.cli)."""
import sys

from coordinator.cli import main

sys.exit(main())
