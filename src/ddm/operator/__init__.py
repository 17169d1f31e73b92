"""The Kubernetes operator for DDMDeployments (``crds/ddmdeployments.ddm.dev.yaml``).

``spec`` (the typed spec and its checks), ``manifests`` (pure builders), ``status`` (pure
aggregation) and ``diagram`` import neither kopf nor the Kubernetes client; ``reconcile``,
``handlers`` and ``runner`` (``run_operator``) do. Nothing here imports NumPy or an ML
framework: the operator image stays small and starts fast.
"""
