"""Where a DDMDeployment's checkpoint is on this machine (``ddm up``, ``ddm sample``).

``image:///opt/ddm/...`` names a file baked into the images; locally the repository holds the
same tree. ``file://`` is a path here; ``pvc://CLAIM/...`` is found under a directory holding one
directory per claim. Fetched checkpoints (http(s), s3, gs) must be fetched first.
"""

from __future__ import annotations

from pathlib import Path

from ddm.checkpoints.uri import CheckpointSource

#: Where the images keep files that ``image://`` URIs name; locally, the repository root.
IMAGE_PREFIX = "/opt/ddm/"
REPOSITORY_ROOT = Path(__file__).resolve().parents[3]


class CheckpointNotHere(RuntimeError):
    """A checkpoint URI that names no directory on this machine; the message says what to do."""


def resolve_checkpoint(checkpoint: CheckpointSource, image_root: Path = REPOSITORY_ROOT,
                       pvc_root: Path | None = None) -> Path:
    """Map a checkpoint URI to a local directory, or say why it cannot be."""
    if checkpoint.scheme in ("image", "file"):
        path = Path(checkpoint.path)
        if path.exists():
            return path
        if checkpoint.scheme == "image" and checkpoint.path.startswith(IMAGE_PREFIX):
            local = image_root / checkpoint.path[len(IMAGE_PREFIX):]
            if local.exists():
                return local
        raise CheckpointNotHere(f"checkpoint {checkpoint.uri}: {path} does not exist here "
                                f"(image paths under {IMAGE_PREFIX} are looked up in "
                                f"{image_root})")
    if checkpoint.scheme == "pvc":
        local = claim_path(checkpoint, pvc_root)
        if not local.exists():
            raise CheckpointNotHere(f"checkpoint {checkpoint.uri}: {local} does not exist")
        return local
    raise CheckpointNotHere(f"checkpoint {checkpoint.uri}: fetch it first (ddm "
                            f"fetch-checkpoint {checkpoint.uri} DIR) and point the manifest at "
                            "file://DIR")


def claim_path(source: CheckpointSource, pvc_root: Path | None) -> Path:
    """Where ``pvc://CLAIM/PATH`` is here: ``pvc_root/CLAIM/PATH`` (``--pvc-root`` stands in
    for the cluster's claims, one directory per claim), whether it exists yet or not."""
    if pvc_root is None:
        raise CheckpointNotHere(f"{source.uri} is on a PersistentVolumeClaim; pass --pvc-root "
                                "DIR holding one directory per claim")
    return pvc_root / source.location / source.path.strip("/")
