"""The operator-wide allow-lists a DDMDeployment must stay within (pure).

Whoever may create a DDMDeployment in a namespace may run pods there: its images, its
checkpoints (fetched by an init container inside the cluster). An admin narrows that with
two lists in the operator's settings (``OperatorConfig``, from the chart's ``tenants``
values), never in the CRD: the images a spec may name (``image`` of the router or an expert;
the operator's own images are the admin's and always allowed), and the checkpoint sources.
Each entry is a prefix that ends where a name does, so that it cannot be stretched:

- an image entry ends with ``/`` (a registry or repository path), ``:`` or ``@`` (any tag or
  digest of one repository), or is one whole image reference;
- a checkpoint entry is a scheme (``pvc://``), or a scheme, a host or bucket and a ``/``
  (``s3://acme-models/``, ``https://models.acme.example/ddm/``, ``image:///opt/models/``):
  never a host without its ``/``, which ``https://models.acme.example.evil.test/`` would
  match.
- a URI held in the user's Secret (``uriFrom``) is shown as ``secret://NAME/KEY``: the
  operator cannot see it, so only the entry ``secret://`` admits it (its fetch still goes
  through the fetcher's destination rules and the stager's NetworkPolicy).

An empty list allows everything (the default). A spec outside a list is invalid
(``SpecValid`` False), with a message naming the field, the value (a URI redacted) and the
setting.
"""

from __future__ import annotations

import re

from ddm.checkpoints.uri import CheckpointSource, redact_uri
from ddm.deploy.spec import DDMSpec

IMAGES_ENV = "DDM_ALLOWED_IMAGES"
CHECKPOINTS_ENV = "DDM_ALLOWED_CHECKPOINT_SOURCES"
_CHECKPOINT_ENTRY = re.compile(r"^[a-z0-9]+://([^/\s]*/\S*)?$")


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


def policy_problems(spec: DDMSpec, images: tuple[str, ...], checkpoints: tuple[str, ...]
                    ) -> list[str]:
    """What in ``spec`` lies outside the allow-lists, one message per field."""
    found = []
    pods = [("spec.router", spec.router.pod.image, spec.router.checkpoint)]
    pods += [(f"spec.experts[{i}]", e.pod.image, e.checkpoint) for i, e in enumerate(spec.experts)]
    for path, image, checkpoint in pods:
        if image is not None and not image_allowed(image, images):
            found.append(f"{path}.image: {image!r} is not among the images this operator allows "
                         f"({IMAGES_ENV}: {', '.join(images)})")
        if checkpoint is not None and not checkpoint_allowed(checkpoint, checkpoints):
            found.append(f"{path}.checkpoint.uri: {redact_uri(checkpoint.uri)!r} is not among the "
                         f"checkpoint sources this operator allows ({CHECKPOINTS_ENV}: "
                         f"{', '.join(checkpoints)})")
    return found
