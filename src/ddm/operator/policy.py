"""What a DDMDeployment may use in its namespace, under the operator's settings (pure).

Whoever may create a DDMDeployment in a namespace may run pods there: its images, its
checkpoints (fetched by its checkpoint stager inside the cluster, or mounted from a claim), the
Secrets of the namespace it names, the nodes it asks for. So the defaults contain a tenant, and
an admin widens them in the operator's settings (``OperatorConfig``, from the chart's
``tenants`` values and ``allowHostPaths``), never in the CRD:

- images (``image`` of the router, an expert or a stage): the repositories of the operator's
  own images (``DDM_IMAGE_*``: ``ddm:0.1.0`` makes ``ddm`` one, any tag or digest of it), and
  the prefixes in ``DDM_ALLOWED_IMAGES``: each ends with ``/`` (a registry or repository path),
  ``:`` or ``@`` (any tag or digest of one repository), or is one whole image reference;
  ``*`` allows any image;
- Secrets a spec may name (``credentialsSecret``, ``storeCredentialsSecret``,
  ``uriFrom.secretKeyRef``, ``router.auth.secretName``, as ``_secret_references`` lists them):
  the DDM's own, ``<name>-*``, but those named as the operator names its own
  (``<name>-router-token-<u>``, ``-expert-token-<u>``, ``-checkpoint-<d>``:
  ``ddm.operator.names``), and those in ``DDM_ALLOWED_SECRETS``: a whole name, or a prefix
  ending with ``*`` (``team-*``; ``*``: any). A DDM named ``a`` may name ``a-b-login``, meant
  for a DDM ``a-b``: give tenants names that are not prefixes of each other;
- claims of ``pvc://`` checkpoints: the DDM's own, ``<name>-*``, and those in
  ``DDM_ALLOWED_CLAIMS`` (as Secrets are listed);
- checkpoint sources, in ``DDM_ALLOWED_CHECKPOINT_SOURCES`` (empty: any): a scheme
  (``pvc://``), or a scheme, a host or bucket and a ``/`` (``s3://acme-models/``,
  ``https://models.acme.example/ddm/``, ``image:///opt/models/``): never a host without its
  ``/``, which ``https://models.acme.example.evil.test/`` would match; a URI held in the
  user's Secret (``uriFrom``) is shown as ``secret://NAME/KEY``: the operator cannot see it,
  so only the entry ``secret://`` admits it (its fetch still goes through the fetcher's
  destination rules and the stager's NetworkPolicy);
- placement: a toleration without a key tolerates every taint (refused unless
  ``DDM_ALLOW_TOLERATE_ALL_TAINTS``); tolerating the control-plane taints or selecting
  control-plane nodes (``node-role.kubernetes.io/control-plane`` or ``master``, in a
  nodeSelector or a nodeAffinity's ``In``/``Exists``) is refused unless
  ``DDM_ALLOW_CONTROL_PLANE``; pinning pods to a named node (a nodeAffinity's ``matchFields``
  ``In``, or the ``kubernetes.io/hostname`` label) unless ``DDM_ALLOW_NODE_NAMES``. Beyond
  these, ``DDM_ALLOWED_TOLERATION_KEYS`` and ``DDM_ALLOWED_NODE_SELECTOR_KEYS`` (empty: any)
  list the keys allowed (a nodeAffinity's keys and fields are held to the nodeSelector's
  list); the accelerators' own, which the operator adds, are the admin's;
- host paths (``file://`` checkpoints, none unless listed in ``DDM_ALLOW_HOST_PATHS``):
  absolute directory prefixes ending with ``/``; a path with ``.`` or ``..`` segments is
  inside none;
- routing strategies (``DDM_ALLOWED_STRATEGIES``, empty: any): the spec's
  ``sampling.strategy`` must be one; every router is told the list and refuses requests for
  any other (``ddm.deploy.router_config.SamplingDefaults.strategies``).

A spec outside them is invalid (``SpecValid`` False, an ``InvalidSpec`` event), with a message
naming the field, the value (a URI redacted) and the setting that would allow it. The operator
and ``ddm render`` both call :func:`policy_problems` (through ``children.checked_spec``).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

from ddm.checkpoints.uri import SECRET_SCHEME, CheckpointSource, redact_uri
from ddm.deploy.limits import STRATEGY_PATTERN
from ddm.deploy.pod_options import PodOptions
from ddm.deploy.router_config import strategy_allowed
from ddm.deploy.spec import DDMSpec, StageSpec
from ddm.operator.names import is_operator_secret

IMAGES_ENV = "DDM_ALLOWED_IMAGES"
CHECKPOINTS_ENV = "DDM_ALLOWED_CHECKPOINT_SOURCES"
SECRETS_ENV = "DDM_ALLOWED_SECRETS"
CLAIMS_ENV = "DDM_ALLOWED_CLAIMS"
TOLERATION_KEYS_ENV = "DDM_ALLOWED_TOLERATION_KEYS"
NODE_SELECTOR_KEYS_ENV = "DDM_ALLOWED_NODE_SELECTOR_KEYS"
HOST_PATHS_ENV = "DDM_ALLOW_HOST_PATHS"
STRATEGIES_ENV = "DDM_ALLOWED_STRATEGIES"
TOLERATE_ALL_TAINTS_ENV = "DDM_ALLOW_TOLERATE_ALL_TAINTS"
CONTROL_PLANE_ENV = "DDM_ALLOW_CONTROL_PLANE"
NODE_NAMES_ENV = "DDM_ALLOW_NODE_NAMES"
#: The labels and taints of control-plane nodes (kubeadm's, and the name before 1.24).
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
#: The label naming a node, as ``matchFields: metadata.name`` does.
HOSTNAME_KEY = "kubernetes.io/hostname"
#: nodeAffinity operators that select nodes having the key (NotIn, DoesNotExist keep pods off).
_SELECTING = ("In", "Exists")
ANY = "*"
#: What an entry of each list may be; the chart's values schema checks the same (generated:
#: scripts/generate_crds.py). No entry holds a comma: the lists are comma-separated.
#: DDM_ALLOWED_CHECKPOINT_SOURCES: a scheme, or a scheme, a host or bucket and a '/'.
CHECKPOINT_ENTRY_PATTERN = r"^[a-z0-9]+://([^/\s,]*/[^\s,]*)?$"
#: DDM_ALLOWED_SECRETS, DDM_ALLOWED_CLAIMS: a whole name, or a prefix ending with ``*``.
NAME_ENTRY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?|([a-z0-9][-a-z0-9.]*)?\*)$"
#: DDM_ALLOWED_IMAGES, DDM_ALLOWED_TOLERATION_KEYS, DDM_ALLOWED_NODE_SELECTOR_KEYS: any word.
WORD_ENTRY_PATTERN = r"^[^\s,]+$"
_CHECKPOINT_ENTRY = re.compile(CHECKPOINT_ENTRY_PATTERN)
_NAME_ENTRY = re.compile(NAME_ENTRY_PATTERN)
_KEY_ENTRY = re.compile(WORD_ENTRY_PATTERN)


def _is_directory_prefix(entry: str) -> bool:
    """An absolute directory ending with ``/``, in normal form (no ``.``, ``..`` or ``//``)."""
    return entry == "/" or (entry.startswith("/") and entry.endswith("/")
                            and not any(c.isspace() for c in entry)
                            and posixpath.normpath(entry) + "/" == entry)


@dataclass(frozen=True)
class AllowLists:
    """The admin's settings (the module's docstring says what each allows beyond the
    defaults): the lists (comma-separated variables) and three switches."""

    images: tuple[str, ...] = ()
    checkpoint_sources: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    claims: tuple[str, ...] = ()
    toleration_keys: tuple[str, ...] = ()
    node_selector_keys: tuple[str, ...] = ()
    host_paths: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    tolerate_all_taints: bool = False
    control_plane: bool = False
    node_names: bool = False

    def __post_init__(self) -> None:
        check_image_entries(self.images)
        check_checkpoint_entries(self.checkpoint_sources)
        names = "name, or a prefix of one ending with '*'"
        for env, entries, valid, hint in (
                (SECRETS_ENV, self.secrets, _NAME_ENTRY.match, f"a Secret {names}"),
                (CLAIMS_ENV, self.claims, _NAME_ENTRY.match, f"a claim {names}"),
                (TOLERATION_KEYS_ENV, self.toleration_keys, _KEY_ENTRY.match, "a taint key"),
                (NODE_SELECTOR_KEYS_ENV, self.node_selector_keys, _KEY_ENTRY.match,
                 "a label key"),
                (HOST_PATHS_ENV, self.host_paths, _is_directory_prefix,
                 "an absolute directory ending with '/' (no '.', '..' or '//' segments)"),
                (STRATEGIES_ENV, self.strategies, re.compile(STRATEGY_PATTERN).match,
                 "a routing strategy (oracle, ensemble, topK, threshold:P)")):
            for entry in entries:
                if not valid(entry):
                    raise ValueError(f"{env}: {entry!r} is not {hint}")


def check_image_entries(entries: tuple[str, ...]) -> None:
    """A ``ValueError`` naming the first entry that is not a bounded image prefix."""
    for entry in entries:
        if not _KEY_ENTRY.match(entry):
            raise ValueError(f"{IMAGES_ENV}: {entry!r} is not an image or image prefix")


def check_checkpoint_entries(entries: tuple[str, ...]) -> None:
    """A ``ValueError`` naming the first entry that is not a bounded URI prefix."""
    for entry in entries:
        if not _CHECKPOINT_ENTRY.match(entry):
            raise ValueError(f"{CHECKPOINTS_ENV}: {entry!r} must be a scheme (pvc://) or end its "
                             "host or bucket with '/' (s3://models/, https://store.example/)")


def repository(image: str) -> str:
    """``image`` without its digest and tag: ``reg.example:5000/ddm/cpu`` of
    ``reg.example:5000/ddm/cpu:1@sha256:...``."""
    name = image.partition("@")[0]
    head, slash, last = name.rpartition("/")
    return head + slash + last.partition(":")[0]


def image_allowed(image: str, entries: tuple[str, ...], own: Iterable[str]) -> bool:
    """Whether ``image`` is of a repository of the operator's ``own`` images, or within
    ``entries``."""
    return (repository(image) in {repository(o) for o in own} or ANY in entries
            or any(image == e or (e.endswith(("/", ":", "@")) and image.startswith(e))
                   for e in entries))


def checkpoint_allowed(checkpoint: CheckpointSource, entries: tuple[str, ...]) -> bool:
    return not entries or any(checkpoint.uri.startswith(e) for e in entries)


def name_allowed(name: str, entries: tuple[str, ...], owner: str) -> bool:
    """Whether a Secret or claim ``name`` is the DDM ``owner``'s own (``<owner>-*``), or
    within ``entries`` (whole names, prefixes ending with ``*``)."""
    return (name.startswith(f"{owner}-")
            or any(name == e or (e.endswith(ANY) and name.startswith(e[:-1])) for e in entries))


def host_path_allowed(path: str, entries: tuple[str, ...]) -> bool:
    """Whether ``path`` lies under one of ``entries`` (none: no host path is allowed); a
    path with ``.``, ``..`` or ``//`` segments is under none."""
    directory = path.rstrip("/") + "/"
    return _is_directory_prefix(directory) and any(directory.startswith(e) for e in entries)


def _listed(entries: tuple[str, ...]) -> str:
    return ", ".join(entries) or "none"


def policy_problems(spec: DDMSpec, name: str, allowed: AllowLists,
                    own_images: Iterable[str]) -> list[str]:
    """What in ``spec`` (of the DDMDeployment ``name``) the operator's settings ``allowed``
    do not allow, one message per field naming the setting that would; ``own_images``: the
    operator's (``DDM_IMAGE_*``), whose repositories are allowed."""
    own = sorted({repository(image) for image in own_images})
    found = []
    pods = [("spec.router", spec.router.pod, spec.router.checkpoint)]
    pods += [(f"spec.experts[{i}]", e.pod, e.checkpoint) for i, e in enumerate(spec.experts)]
    pods += [(path, stage.pod, stage.checkpoint) for path, stage in _stages(spec)]
    pods += [(f"spec.pools[{i}]", pool.pod, None) for i, pool in enumerate(spec.pools)]
    if spec.router.network is not None:
        pods.append(("spec.router.network", spec.router.network.pod, None))
    for path, pod, checkpoint in pods:
        image = pod.image
        if image is not None and not image_allowed(image, allowed.images, own):
            found.append(f"{path}.image: {image!r} is neither of the operator's own "
                         f"repositories ({', '.join(own)}) nor among the images it allows "
                         f"({IMAGES_ENV}: {_listed(allowed.images)})")
        if checkpoint is not None:
            found += _checkpoint_problems(f"{path}.checkpoint.uri", checkpoint, name, allowed)
        found += _placement_problems(path, pod, allowed)
    for path, secret in _secret_references(spec):
        if is_operator_secret(secret) or not name_allowed(secret, allowed.secrets, name):
            found.append(f"{path}: Secret {secret!r} is neither the DDM's own ({name}-*, but "
                         f"the operator's tokens and checkpoint URIs) nor among the Secrets "
                         f"this operator lets a spec name ({SECRETS_ENV}: "
                         f"{_listed(allowed.secrets)})")
    if not strategy_allowed(spec.sampling.strategy, allowed.strategies):
        found.append(f"spec.sampling.strategy: {spec.sampling.strategy!r} is not among the "
                     f"strategies this operator allows ({STRATEGIES_ENV}: "
                     f"{_listed(allowed.strategies)})")
    return found


def _checkpoint_problems(field: str, checkpoint: CheckpointSource, name: str,
                         allowed: AllowLists) -> list[str]:
    found = []
    if not checkpoint_allowed(checkpoint, allowed.checkpoint_sources):
        found.append(f"{field}: {redact_uri(checkpoint.uri)!r} is not among the checkpoint "
                     f"sources this operator allows ({CHECKPOINTS_ENV}: "
                     f"{', '.join(allowed.checkpoint_sources)})")
    if checkpoint.scheme == "file" and not host_path_allowed(checkpoint.path, allowed.host_paths):
        found.append(f"{field}: {checkpoint.uri!r} is not under a host path this operator "
                     f"allows ({HOST_PATHS_ENV}: {_listed(allowed.host_paths)})")
    if checkpoint.scheme == "pvc" and not name_allowed(checkpoint.location, allowed.claims, name):
        found.append(f"{field}: claim {checkpoint.location!r} is neither the DDM's own "
                     f"({name}-*) nor among the claims this operator allows ({CLAIMS_ENV}: "
                     f"{_listed(allowed.claims)})")
    return found


def _placement_problems(path: str, pod: PodOptions, allowed: AllowLists) -> list[str]:
    found = []
    control_plane = (f"selects control-plane nodes ({CONTROL_PLANE_ENV}=true would allow it)")
    named = f"pins pods to a named node ({NODE_NAMES_ENV}=true would allow it)"
    selected = [("nodeSelector", key, "In") for key in pod.node_selector or {}]
    selected += list(_node_affinity_requirements(pod.affinity))
    for field, key, operator in selected:
        where = f"{path}.{field}: key {key!r}"
        if operator in _SELECTING and key in CONTROL_PLANE_KEYS and not allowed.control_plane:
            found.append(f"{where} {control_plane}")
        elif (operator == "In" and (key == HOSTNAME_KEY or "matchFields" in field)
              and not allowed.node_names):
            found.append(f"{where} {named}")
        elif allowed.node_selector_keys and key not in allowed.node_selector_keys:
            found.append(f"{where} is not among the keys this operator allows "
                         f"({NODE_SELECTOR_KEYS_ENV}: {', '.join(allowed.node_selector_keys)})")
    for index, toleration in enumerate(pod.tolerations):
        key, where = toleration.get("key"), f"{path}.tolerations[{index}]"
        if not key:
            if not allowed.tolerate_all_taints:
                found.append(f"{where}: a toleration without a key tolerates every taint "
                             f"({TOLERATE_ALL_TAINTS_ENV}=true would allow it)")
        elif key in CONTROL_PLANE_KEYS and not allowed.control_plane:
            found.append(f"{where}: key {key!r} tolerates the control-plane taint "
                         f"({CONTROL_PLANE_ENV}=true would allow it)")
        elif allowed.toleration_keys and key not in allowed.toleration_keys:
            found.append(f"{where}: key {key!r} is not among the keys this operator allows "
                         f"({TOLERATION_KEYS_ENV}: {', '.join(allowed.toleration_keys)})")
    return found


def _node_affinity_requirements(affinity: Mapping[str, Any] | None
                                ) -> Iterator[tuple[str, Any, Any]]:
    """(field, key, operator) of every node label or field a ``nodeAffinity`` selects on,
    required or preferred: it places a pod as a nodeSelector does, so the same rules hold."""
    node = (affinity or {}).get("nodeAffinity")
    node = node if isinstance(node, Mapping) else {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = [("required", term) for term in _items(
        required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None)]
    terms += [("preferred", preferred.get("preference"))
              for preferred in _items(node.get("preferredDuringSchedulingIgnoredDuringExecution"))
              if isinstance(preferred, Mapping)]
    for kind, term in terms:
        for match in ("matchExpressions", "matchFields"):
            for requirement in _items(term.get(match) if isinstance(term, Mapping) else None):
                requirement = requirement if isinstance(requirement, Mapping) else {}
                yield (f"affinity.nodeAffinity.{kind} {match}", requirement.get("key"),
                       requirement.get("operator"))
def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _stages(spec: DDMSpec) -> list[tuple[str, StageSpec]]:
    """(field, stage) of the text encoder and decoder (the router network's checkpoint is the
    router's; its pod options are checked with its placement)."""
    return [(path, stage) for path, stage in (("spec.textEncoder", spec.text_encoder),
                                              ("spec.decoder", spec.decoder))
            if stage is not None]


def _secret_references(spec: DDMSpec) -> Iterator[tuple[str, str]]:
    """(field, Secret name) of every Secret the spec names."""
    if spec.router.auth is not None and spec.router.auth.secret_name is not None:
        yield "spec.router.auth.secretName", spec.router.auth.secret_name
    checkpoints = [("spec.router.checkpoint", spec.router.checkpoint, spec.router.fetch)]
    checkpoints += [(f"spec.experts[{i}].checkpoint", e.checkpoint, e.fetch)
                    for i, e in enumerate(spec.experts)]
    checkpoints += [(f"{path}.checkpoint", stage.checkpoint, stage.fetch)
                    for path, stage in _stages(spec)]
    for path, checkpoint, fetch in checkpoints:
        for field, secret in fetch.secrets():
            yield f"{path}.{field}.name", secret.name
        if checkpoint is not None and checkpoint.scheme == SECRET_SCHEME:
            yield f"{path}.uriFrom.secretKeyRef.name", checkpoint.location
