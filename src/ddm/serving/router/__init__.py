"""The router: its API (:mod:`ddm.serving.router.api`: requests, clients, the page, what its
routes share) over its fleet (:mod:`ddm.serving.router.fleet`: pools and replicas of the
model servers, coalescing, the remote driver of the sampling loop)."""
