"""The Kubernetes operator for DDMDeployments (``crds/ddmdeployments.ddm.dev.yaml``).

The spec and the plan of what runs are ``ddm.deploy``'s. Here, ``manifests`` (pure builders of
the plan's Kubernetes objects), ``placement``, ``access``, ``status`` (pure aggregation) and
``diagram`` import neither kopf nor the Kubernetes client; ``client`` (credentials), ``kube``
(the API calls), ``reconcile``, ``handlers`` (``register(registry)``) and ``runner``
(``run_operator``) do. Nothing here imports NumPy or an ML framework: the operator image stays
small and starts fast.
"""
