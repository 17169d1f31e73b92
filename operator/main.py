"""The operator image's entry point: ``python operator/main.py`` (or ``ddm operator``).

Watches the namespaces listed in ``DDM_WATCH_NAMESPACES`` (comma-separated; empty: the whole
cluster), serves kopf's liveness probe on ``DDM_LIVENESS_PORT`` (default 8081), and reads the
rest of its settings from the environment (``ddm.operator.config.OperatorConfig.from_env``).
"""

import os

from ddm.operator.runner import run_operator

if __name__ == "__main__":
    # run_operator reads and checks DDM_WATCH_NAMESPACES itself.
    run_operator(liveness_port=int(os.environ.get("DDM_LIVENESS_PORT", "8081")))
