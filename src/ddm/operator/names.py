"""Names, labels and addresses of a DDMDeployment's children: one place, used by every module.

Children are ``<name>-router`` (Deployment, Service), ``<name>-router-config`` (ConfigMap),
``<name>-expert-<expert>`` (Deployment, headless Service), ``<name>-stage-<role>``
(Deployment, headless Service) per stage placed ``separate`` (``text-encoder``, ``decoder``,
``router-network``), ``<name>-pool-<pool>`` (Deployment, headless Service) per pool, with
fetched checkpoints
``<name>-stager`` (the Deployment and Service that fetch them and hand them out), and
NetworkPolicies on ``<name>-experts``, ``<name>-stages`` (where stages are placed
``separate``), ``<name>-pools`` (where there are pools), ``<name>-router`` and
``<name>-stager``. The CRD bounds both names so that every Service name stays a DNS-1035
label of at most 63 characters.

The operator's Secrets are immutable and never read back, so their names say what they hold:
with router authentication ``<name>-router-token-<u>`` (the public API token, when the spec
names no Secret) and ``<name>-expert-token-<u>`` (what the router presents to its experts),
where ``<u>`` is a digest of the DDMDeployment's uid (unknown before it exists, new when it is
re-created); per fetched checkpoint ``<name>-checkpoint-<d>``, ``<d>`` a digest of the uid,
the pod and the URI, so a new URI is a new Secret and the old one stays for the old
ReplicaSets (a rollback) until the garbage collector removes it with the DDMDeployment.
"""

from __future__ import annotations

import hashlib
import re

# The servers' ports (``ddm.deploy.limits``) and the resource's identity (``ddm.deploy.spec``),
# re-exported for the operator.
from ddm.deploy.limits import EXPERT_PORT as EXPERT_PORT
from ddm.deploy.limits import METRICS_PORT as METRICS_PORT
from ddm.deploy.limits import ROUTER_PORT as ROUTER_PORT
from ddm.deploy.spec import API_VERSION as API_VERSION
from ddm.deploy.spec import GROUP as GROUP
from ddm.deploy.spec import KIND as KIND
from ddm.deploy.spec import VERSION as VERSION

PLURAL = "ddmdeployments"

MANAGED_BY = "ddm-operator"
DEPLOYMENT_LABEL = "ddm.dev/deployment"
EXPERT_LABEL = "ddm.dev/expert"
STAGE_LABEL = "ddm.dev/stage"
POOL_LABEL = "ddm.dev/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
#: Hash of a child's desired manifest: a spec change rewrites only the children it alters.
SPEC_HASH_ANNOTATION = "ddm.dev/spec-hash"
#: Hash of router.yaml on the router's pod template: a new config rolls the router.
CONFIG_HASH_ANNOTATION = "ddm.dev/config-hash"
#: Hash of a fetched checkpoint's URI (which lives in a Secret) on the pod template.
CHECKPOINT_HASH_ANNOTATION = "ddm.dev/checkpoint-hash"

#: What kopf watches (labelled ``managed-by: ddm-operator``) to reconcile the owner on a change:
#: (group, version, plural); "v1" is the core group. The children the operator writes, and the
#: pods of its Deployments (their state is the status's "why not ready"). Never Secrets: the
#: operator may create them but not read them.
POD_RESOURCE = ("v1", "pods")
CHILD_RESOURCES = (("apps", "v1", "deployments"), ("v1", "services"), ("v1", "configmaps"),
                   ("networking.k8s.io", "v1", "networkpolicies"), POD_RESOURCE)

#: Where a pod's servers listen: every address of the pod's own network namespace.
POD_HOST = "0.0.0.0"
#: Annotations that point annotation-based Prometheus discovery at ``METRICS_PORT``.
SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                      "prometheus.io/path": "/metrics"}


def expert_name(owner: str, expert: str) -> str:
    """The expert's Deployment and headless Service."""
    return f"{owner}-expert-{expert}"


def stage_name(owner: str, role: str) -> str:
    """A separate stage's Deployment and headless Service (``role``: text-encoder, decoder,
    router-network)."""
    return f"{owner}-stage-{role}"


def stage_dns(owner: str, role: str, namespace: str, cluster_domain: str) -> str:
    """The stage's headless Service's name: resolves to the IPs of every ready replica."""
    return f"{stage_name(owner, role)}.{namespace}.svc.{cluster_domain}"


def pool_name(owner: str, pool: str) -> str:
    """A pool's Deployment and headless Service."""
    return f"{owner}-pool-{pool}"


def pool_dns(owner: str, pool: str, namespace: str, cluster_domain: str) -> str:
    """The pool's headless Service's name: resolves to the IPs of every ready replica."""
    return f"{pool_name(owner, pool)}.{namespace}.svc.{cluster_domain}"


def router_name(owner: str) -> str:
    """The router's Deployment and Service."""
    return f"{owner}-router"


def router_config_name(owner: str) -> str:
    """The ConfigMap holding router.yaml."""
    return f"{owner}-router-config"


def router_token_name(owner: str, uid: str) -> str:
    """The Secret holding the router's public bearer token when the spec names none."""
    return f"{owner}-router-token-{digest(uid)[:8]}"


def expert_token_name(owner: str, uid: str) -> str:
    """The Secret holding the token the router presents to its experts (never the public one)."""
    return f"{owner}-expert-token-{digest(uid)[:8]}"


def checkpoint_secret_name(owner: str, uid: str, key: str, uri: str) -> str:
    """The Secret holding the URI of one fetched checkpoint (``key``: whose, router or expert)."""
    return f"{owner}-checkpoint-{digest(f'{uid}/{key}/{uri}')}"


#: What the operator's own Secrets' names end with (the functions above): a spec never names one.
_OPERATOR_SECRET = re.compile(
    r"-(router-token|expert-token)-[0-9a-f]{8}$|-checkpoint-[0-9a-f]{16}$")


def is_operator_secret(name: str) -> bool:
    """Whether ``name`` is shaped as one of the operator's own Secrets (a token, a
    checkpoint's URI) of some DDMDeployment: ``ddm.operator.policy`` lets no spec name one."""
    return _OPERATOR_SECRET.search(name) is not None


def digest(text: str) -> str:
    """A short content hash (16 hex digits of SHA-256) for names and annotations."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stager_name(owner: str) -> str:
    """The checkpoint stager's Deployment and Service (only when the DDM fetches one)."""
    return f"{owner}-stager"


def stager_host(owner: str, namespace: str, cluster_domain: str) -> str:
    """The stager Service's name, which the serving pods' copies are allowed to reach."""
    return f"{stager_name(owner)}.{namespace}.svc.{cluster_domain}"


def network_policy_name(owner: str, component: str) -> str:
    """The NetworkPolicy guarding ``component`` (experts, router or stager)."""
    return f"{owner}-{component}"


def labels(owner: str, component: str, expert: str | None = None,
           stage: str | None = None, pool: str | None = None) -> dict[str, str]:
    """The recommended ``app.kubernetes.io/*`` labels plus ours; ``component`` is
    expert|stage|pool|router|stager."""
    out = {
        "app.kubernetes.io/name": "ddm",
        "app.kubernetes.io/instance": owner,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/part-of": "ddm",
        MANAGED_BY_LABEL: MANAGED_BY,
        DEPLOYMENT_LABEL: owner,
    }
    return {**out, **_member(expert, stage, pool)}


def selector(owner: str, component: str, expert: str | None = None,
             stage: str | None = None, pool: str | None = None) -> dict[str, str]:
    """The immutable pod selector of a child Deployment (and its Service)."""
    return {DEPLOYMENT_LABEL: owner, COMPONENT_LABEL: component, **_member(expert, stage, pool)}


def _member(expert: str | None, stage: str | None, pool: str | None) -> dict[str, str]:
    return {**({EXPERT_LABEL: expert} if expert is not None else {}),
            **({STAGE_LABEL: stage} if stage is not None else {}),
            **({POOL_LABEL: pool} if pool is not None else {})}


def expert_dns(owner: str, expert: str, namespace: str, cluster_domain: str) -> str:
    """The headless Service's name: resolves to the IPs of every ready replica."""
    return f"{expert_name(owner, expert)}.{namespace}.svc.{cluster_domain}"


def router_url(owner: str, namespace: str) -> str:
    return f"http://{router_name(owner)}.{namespace}.svc:{ROUTER_PORT}"
