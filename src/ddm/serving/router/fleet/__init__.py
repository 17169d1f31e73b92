"""The router's fleet: the model servers it calls (replicas, pools, pool calls, stage
callers), coalescing, demand, the missing-expert policy and the remote driver of
:mod:`ddm.sampling.loop`. It imports nothing of :mod:`ddm.serving.router.api`."""
