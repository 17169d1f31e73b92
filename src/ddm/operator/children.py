"""Everything the operator makes for one DDMDeployment, as it sends it (pure).

The same two functions serve the reconcile and ``ddm render``: ``checked_spec`` (the spec
and the operator's tenancy policy) and ``desired_children``: the Secrets
first (created once, immutable, never read back: ``access.build_token_secrets``,
``fetcher.build_checkpoint_secrets``), then the children applied with server-side apply
(``manifests.build_children``) annotated with their spec hash, each owned by the
DDMDeployment as controller, so the garbage collector removes them all with it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ddm.deploy.spec import DDMSpec, SpecError, parse_spec
from ddm.operator.access import build_token_secrets
from ddm.operator.config import OperatorConfig
from ddm.operator.fetcher import build_checkpoint_secrets
from ddm.operator.manifests import build_children, with_spec_hash
from ddm.operator.policy import policy_problems


def checked_spec(raw: Any, name: str, config: OperatorConfig) -> DDMSpec:
    """The ``spec`` of the DDMDeployment ``name`` parsed and checked against the operator's
    settings (``ddm.operator.policy``); ``SpecError`` naming every problem."""
    spec = parse_spec(raw, allow_host_paths=bool(config.allowed.host_paths))
    outside = policy_problems(spec, name, config.allowed, config.images.by_family.values())
    if outside:
        raise SpecError(outside)
    return spec


def desired_children(spec: DDMSpec, owner: Mapping[str, Any], config: OperatorConfig,
                     new_token: Callable[[], str]) -> list[dict[str, Any]]:
    """The Secrets, then the applied children, of the DDMDeployment ``owner`` (its
    ``apiVersion``, ``kind`` and ``metadata`` with ``name``, ``namespace`` and ``uid``).
    ``new_token()``: a random token for each token Secret (used only if it is created)."""
    meta = owner["metadata"]
    secrets = [*build_token_secrets(spec, meta, config, new_token),
               *build_checkpoint_secrets(spec, meta)]
    applied = [with_spec_hash(with_owner(m, owner)) for m in build_children(spec, meta, config)]
    return [with_owner(m, owner) for m in secrets] + applied


def with_owner(manifest: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with ``owner`` as its controller (what ``kopf.append_owner_reference``
    writes: the garbage collector deletes it with ``owner``, foreground deletion waits)."""
    meta = owner["metadata"]
    reference = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
                 "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}
    return {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [reference]}}
