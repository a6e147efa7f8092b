"""``python -m phalanx.cli``: the ``phalanx`` command."""

import sys

from phalanx.cli.commands import main

sys.exit(main())
