"""`python -m ddm.devcluster {build,up,down,status}`."""

import sys

from ddm.devcluster.command import main

sys.exit(main())
