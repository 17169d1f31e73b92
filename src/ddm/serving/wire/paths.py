"""Where a model server answers for one model: the one place the routes' paths are built.

A model server of one model (``ddm serve expert``, ``ddm serve stage``) answers at the root
(``/v1/velocity``, ``/v1/info``, ``/readyz``); a pool server (``ddm serve pool``) answers for
each member under ``/v1/members/NAME`` (``/v1/members/NAME/velocity``, ``.../info``,
``.../readyz``). The servers mount their routes at these paths and the router calls them, so a
``router.yaml`` discovery's ``member`` changes nothing but the paths. A pool server also takes
one step's velocity calls to several of its members in one request at
:data:`POOL_VELOCITY_PATH`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEMBERS_PREFIX", "ModelPaths", "POOL_VELOCITY_PATH", "model_paths"]

MEMBERS_PREFIX = "/v1/members/"
#: A pool server's route for a pool velocity request (``docs/protocol.md``, version 3).
POOL_VELOCITY_PATH = "/v1/pool/velocity"


@dataclass(frozen=True)
class ModelPaths:
    """One model's routes: the binary protocol's POST, its ``/v1/info`` and its readiness."""

    velocity: str
    info: str
    readyz: str


def model_paths(member: str | None = None) -> ModelPaths:
    """The paths of a server's one model (``member`` None) or of the pool member ``member``."""
    if member is None:
        return ModelPaths(velocity="/v1/velocity", info="/v1/info", readyz="/readyz")
    prefix = f"{MEMBERS_PREFIX}{member}"
    return ModelPaths(velocity=f"{prefix}/velocity", info=f"{prefix}/info",
                      readyz=f"{prefix}/readyz")
