"""What a text DDM's expert was trained on, as its checkpoint declares it (``_ddm.trained_on``).

A label expert's ``/v1/info`` names its labels and partition; a text expert's cluster is a
k-means cluster of image embeddings, which says nothing to a person. ``ddm import text2img``
therefore summarises the partition's fit (``partition.json``'s ``fit``) per expert: how many
of the training images its cluster holds and which digits it holds most of, the caption words
that decide the cluster (docs/text2img.md). The page shows it on the expert's card.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ddm.checkpoints.format import CheckpointError

#: The text2img training's partition file (k-means record and its ``fit``), which the import
#: summarises.
PARTITION_FILE = "partition.json"
#: The ``_ddm`` key.
TRAINED_ON_KEY = "trained_on"
#: The training set every text2img expert's images come from.
TEXT2IMG_DATA = "coloured MNIST"
#: The features the text2img partition clustered (``ddm.training.text2img.partition``).
TEXT2IMG_FEATURES = "clip image"


@dataclass(frozen=True)
class TrainedOn:
    """Expert ``cluster``'s share of a k-means partition into ``clusters``: ``images`` of the
    ``training_images`` of ``data``, most of each digit in ``digits``."""

    clusters: int
    images: int
    training_images: int
    digits: tuple[int, ...]
    data: str = TEXT2IMG_DATA
    features: str = TEXT2IMG_FEATURES

    @classmethod
    def from_fit(cls, fit: Mapping[str, Any], cluster: int) -> TrainedOn:
        """Cluster ``cluster``'s summary from a partition file's ``fit`` record: its size,
        and the digits whose images it holds more of than any other cluster."""
        counts = fit["digits_per_cluster"]
        digits = tuple(d for d in range(len(counts[cluster]))
                       if max(range(len(counts)), key=lambda k: counts[k][d]) == cluster)
        return cls(clusters=int(fit["k"]), images=int(fit["cluster_sizes"][cluster]),
                   training_images=int(fit["images"]), digits=digits)

    def declaration(self) -> dict[str, Any]:
        """The JSON ``_ddm.trained_on`` block."""
        return {"clusters": self.clusters, "images": self.images,
                "training_images": self.training_images, "digits": list(self.digits),
                "data": self.data, "features": self.features}

    @classmethod
    def from_declaration(cls, where: str, block: Any) -> TrainedOn:
        """Parse ``_ddm.trained_on``; ``CheckpointError`` naming the malformed field."""
        field = f"_ddm.{TRAINED_ON_KEY}"
        keys = {"clusters", "images", "training_images", "digits", "data", "features"}
        if not isinstance(block, Mapping) or set(block) != keys:
            raise CheckpointError(f"{where}: {field} must be an object with exactly "
                                  f"{', '.join(sorted(keys))}")
        for name in ("clusters", "images", "training_images"):
            if type(block[name]) is not int or block[name] < 0:
                raise CheckpointError(f"{where}: {field}.{name} must be a non-negative "
                                      f"integer, got {block[name]!r}")
        digits = block["digits"]
        if not (isinstance(digits, list) and all(type(d) is int and 0 <= d <= 9 for d in digits)):
            raise CheckpointError(f"{where}: {field}.digits must be a list of digits 0-9, got "
                                  f"{digits!r}")
        for name in ("data", "features"):
            if not (isinstance(block[name], str) and 0 < len(block[name]) <= 64):
                raise CheckpointError(f"{where}: {field}.{name} must be a short text, got "
                                      f"{block[name]!r}")
        return cls(block["clusters"], block["images"], block["training_images"], tuple(digits),
                   block["data"], block["features"])

    def info(self, cluster: int | None) -> dict[str, Any]:
        """``/v1/info``'s ``partition``, ``data`` and ``summary``, in the shape a label
        expert reports them."""
        return {"partition": {"scheme": {"method": "kmeans",
                                         "features": {"name": self.features},
                                         "clusters": self.clusters}, "index": cluster},
                "data": {"name": self.data, "images": self.images},
                "summary": "digits " + ", ".join(map(str, self.digits)) if self.digits
                else None}
