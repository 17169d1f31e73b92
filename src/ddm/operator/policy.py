"""The operator-wide allow-lists a DDMDeployment must stay within (pure).

Whoever may create a DDMDeployment in a namespace may run pods there: its images, its
checkpoints (fetched by its checkpoint stager inside the cluster), the Secrets of the namespace
it names, the nodes it asks for. An admin narrows that with lists in the operator's settings
(``OperatorConfig``, from the chart's ``tenants`` values and ``allowHostPaths``), never in the
CRD:

- images (``image`` of the router or an expert; the operator's own images are the admin's and
  always allowed): each entry ends with ``/`` (a registry or repository path), ``:`` or ``@``
  (any tag or digest of one repository), or is one whole image reference;
- checkpoint sources: a scheme (``pvc://``), or a scheme, a host or bucket and a ``/``
  (``s3://acme-models/``, ``https://models.acme.example/ddm/``, ``image:///opt/models/``):
  never a host without its ``/``, which ``https://models.acme.example.evil.test/`` would
  match; a URI held in the user's Secret (``uriFrom``) is shown as ``secret://NAME/KEY``:
  the operator cannot see it, so only the entry ``secret://`` admits it (its fetch still goes
  through the fetcher's destination rules and the stager's NetworkPolicy);
- Secrets a spec may name (``credentialsSecret``, ``uriFrom.secretKeyRef``,
  ``router.auth.secretName``): a whole name, or a prefix ending with ``*`` (``ddm-*``);
- toleration keys and nodeSelector keys the spec's pod options may use (whole keys; a
  toleration without a key tolerates every taint, so it is refused by any list; a
  ``nodeAffinity`` places pods as a nodeSelector does, so its keys and fields are held to the
  same list); the accelerators' own, which the operator adds, are the admin's;
- host paths (``file://`` checkpoints, off unless listed): absolute directory prefixes ending
  with ``/``; a path with ``.`` or ``..`` segments is inside none.

An empty list allows everything (the default), but for host paths, where it allows none. A spec
outside a list is invalid (``SpecValid`` False), with a message naming the field, the value (a
URI redacted) and the setting.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ddm.checkpoints.uri import SECRET_SCHEME, CheckpointSource, redact_uri
from ddm.deploy.pod_options import PodOptions
from ddm.deploy.spec import DDMSpec, SecretKey, StageSpec

IMAGES_ENV = "DDM_ALLOWED_IMAGES"
CHECKPOINTS_ENV = "DDM_ALLOWED_CHECKPOINT_SOURCES"
SECRETS_ENV = "DDM_ALLOWED_SECRETS"
TOLERATION_KEYS_ENV = "DDM_ALLOWED_TOLERATION_KEYS"
NODE_SELECTOR_KEYS_ENV = "DDM_ALLOWED_NODE_SELECTOR_KEYS"
HOST_PATHS_ENV = "DDM_ALLOW_HOST_PATHS"
_CHECKPOINT_ENTRY = re.compile(r"^[a-z0-9]+://([^/\s]*/\S*)?$")
_SECRET_ENTRY = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$|^[a-z0-9][-a-z0-9.]*\*$")
_KEY_ENTRY = re.compile(r"^\S+$")


def _is_directory_prefix(entry: str) -> bool:
    """An absolute directory ending with ``/``, in normal form (no ``.``, ``..`` or ``//``)."""
    return entry == "/" or (entry.startswith("/") and entry.endswith("/")
                            and not any(c.isspace() for c in entry)
                            and posixpath.normpath(entry) + "/" == entry)


@dataclass(frozen=True)
class AllowLists:
    """The admin's lists (see the module's docstring); empty: anything, but ``host_paths``."""

    images: tuple[str, ...] = ()
    checkpoint_sources: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    toleration_keys: tuple[str, ...] = ()
    node_selector_keys: tuple[str, ...] = ()
    host_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_image_entries(self.images)
        check_checkpoint_entries(self.checkpoint_sources)
        for env, entries, valid, hint in (
                (SECRETS_ENV, self.secrets, _SECRET_ENTRY.match,
                 "a Secret name, or a prefix of one ending with '*'"),
                (TOLERATION_KEYS_ENV, self.toleration_keys, _KEY_ENTRY.match, "a taint key"),
                (NODE_SELECTOR_KEYS_ENV, self.node_selector_keys, _KEY_ENTRY.match,
                 "a label key"),
                (HOST_PATHS_ENV, self.host_paths, _is_directory_prefix,
                 "an absolute directory ending with '/' (no '.', '..' or '//' segments)")):
            for entry in entries:
                if not valid(entry):
                    raise ValueError(f"{env}: {entry!r} is not {hint}")


def check_image_entries(entries: tuple[str, ...]) -> None:
    """A ``ValueError`` naming the first entry that is not a bounded image prefix."""
    for entry in entries:
        if not entry or any(c.isspace() for c in entry):
            raise ValueError(f"{IMAGES_ENV}: {entry!r} is not an image or image prefix")


def check_checkpoint_entries(entries: tuple[str, ...]) -> None:
    """A ``ValueError`` naming the first entry that is not a bounded URI prefix."""
    for entry in entries:
        if not _CHECKPOINT_ENTRY.match(entry):
            raise ValueError(f"{CHECKPOINTS_ENV}: {entry!r} must be a scheme (pvc://) or end its "
                             "host or bucket with '/' (s3://models/, https://store.example/)")


def image_allowed(image: str, entries: tuple[str, ...]) -> bool:
    return not entries or any(image == e or (e.endswith(("/", ":", "@")) and image.startswith(e))
                              for e in entries)


def checkpoint_allowed(checkpoint: CheckpointSource, entries: tuple[str, ...]) -> bool:
    return not entries or any(checkpoint.uri.startswith(e) for e in entries)


def secret_allowed(name: str, entries: tuple[str, ...]) -> bool:
    return not entries or any(name == e or (e.endswith("*") and name.startswith(e[:-1]))
                              for e in entries)


def host_path_allowed(path: str, entries: tuple[str, ...]) -> bool:
    """Whether ``path`` lies under one of ``entries`` (none: no host path is allowed); a
    path with ``.``, ``..`` or ``//`` segments is under none."""
    directory = path.rstrip("/") + "/"
    return _is_directory_prefix(directory) and any(directory.startswith(e) for e in entries)


def policy_problems(spec: DDMSpec, allowed: AllowLists) -> list[str]:
    """What in ``spec`` lies outside the allow-lists, one message per field."""
    found = []
    pods = [("spec.router", spec.router.pod, spec.router.checkpoint)]
    pods += [(f"spec.experts[{i}]", e.pod, e.checkpoint) for i, e in enumerate(spec.experts)]
    pods += [(path, stage.pod, stage.checkpoint) for path, stage in _stages(spec)]
    pods += [(f"spec.pools[{i}]", pool.pod, None) for i, pool in enumerate(spec.pools)]
    if spec.router.network is not None:
        pods.append(("spec.router.network", spec.router.network.pod, None))
    for path, pod, checkpoint in pods:
        image = pod.image
        if image is not None and not image_allowed(image, allowed.images):
            found.append(f"{path}.image: {image!r} is not among the images this operator allows "
                         f"({IMAGES_ENV}: {', '.join(allowed.images)})")
        if checkpoint is not None and not checkpoint_allowed(checkpoint,
                                                             allowed.checkpoint_sources):
            found.append(f"{path}.checkpoint.uri: {redact_uri(checkpoint.uri)!r} is not among the "
                         f"checkpoint sources this operator allows ({CHECKPOINTS_ENV}: "
                         f"{', '.join(allowed.checkpoint_sources)})")
        if (checkpoint is not None and checkpoint.scheme == "file"
                and not host_path_allowed(checkpoint.path, allowed.host_paths)):
            found.append(f"{path}.checkpoint.uri: {checkpoint.uri!r} is not under a host path "
                         f"this operator allows ({HOST_PATHS_ENV}: "
                         f"{', '.join(allowed.host_paths) or 'none'})")
        found += _placement_problems(path, pod, allowed)
    for path, secret in _secret_references(spec):
        if not secret_allowed(secret, allowed.secrets):
            found.append(f"{path}: Secret {secret!r} is not among the Secrets this operator lets "
                         f"a spec name ({SECRETS_ENV}: {', '.join(allowed.secrets)})")
    return found


def _placement_problems(path: str, pod: PodOptions, allowed: AllowLists) -> list[str]:
    found = []
    if allowed.node_selector_keys:
        keys = [("nodeSelector", key) for key in pod.node_selector or {}]
        keys += [(f"affinity.nodeAffinity.{where}", key)
                 for where, key in _node_affinity_keys(pod.affinity)]
        for field, key in keys:
            if key not in allowed.node_selector_keys:
                found.append(f"{path}.{field}: key {key!r} is not among the keys this "
                             f"operator allows ({NODE_SELECTOR_KEYS_ENV}: "
                             f"{', '.join(allowed.node_selector_keys)})")
    if allowed.toleration_keys:
        for index, toleration in enumerate(pod.tolerations):
            key = toleration.get("key")
            if key not in allowed.toleration_keys:
                shown = repr(key) if key else "none (it would tolerate every taint)"
                found.append(f"{path}.tolerations[{index}]: key {shown} is not among the keys "
                             f"this operator allows ({TOLERATION_KEYS_ENV}: "
                             f"{', '.join(allowed.toleration_keys)})")
    return found


def _node_affinity_keys(affinity: Mapping[str, Any] | None) -> Iterator[tuple[str, Any]]:
    """(where, key) of every node label or field a ``nodeAffinity`` selects on, required or
    preferred: it places a pod as a nodeSelector does, so the same keys are allowed."""
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
                yield f"{kind} {match}", (requirement.get("key")
                                          if isinstance(requirement, Mapping) else requirement)


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
    fetches: list[tuple[str, SecretKey | None]] = [
        ("spec.router.checkpoint.credentialsSecret", spec.router.fetch.credentials)]
    fetches += [(f"spec.experts[{i}].checkpoint.credentialsSecret", e.fetch.credentials)
                for i, e in enumerate(spec.experts)]
    fetches += [(f"{path}.checkpoint.credentialsSecret", stage.fetch.credentials)
                for path, stage in _stages(spec)]
    for path, credentials in fetches:
        if credentials is not None:
            yield f"{path}.name", credentials.name
    held = [("spec.router.checkpoint", spec.router.checkpoint)]
    held += [(f"spec.experts[{i}].checkpoint", e.checkpoint) for i, e in enumerate(spec.experts)]
    held += [(f"{path}.checkpoint", stage.checkpoint) for path, stage in _stages(spec)]
    for path, checkpoint in held:
        if checkpoint is not None and checkpoint.scheme == SECRET_SCHEME:
            yield f"{path}.uriFrom.secretKeyRef.name", checkpoint.location
