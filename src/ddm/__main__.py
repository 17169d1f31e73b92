"""``python -m ddm``: the same as the ``ddm`` command."""

import sys

from ddm.cli import main

sys.exit(main())
