"""`python -m ddm_devcluster {build,up,down,status}`."""

import sys

from ddm_devcluster.command import main

sys.exit(main())
