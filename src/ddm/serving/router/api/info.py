"""What the router says of its DDM in ``GET /v1/info``, and so on its web page: the strategies
this DDM can serve, and a card per expert (what runs it and where, its replicas, what it was
trained on). Pure: built from ``router.yaml`` and what each expert said of itself in its own
``/v1/info`` (:class:`~ddm.serving.router.fleet.replicas.ExpertInfo`, a peer's word, already cut to
size there), so that a test can build any card without servers.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddm.conditioning import LABELS
from ddm.deploy.router_config import ExpertEntry, RouterConfigFile
from ddm.sampling.routing import routes_by_label
from ddm.serving.router.fleet.replicas import ExpertAbout, ExpertInfo, short_text

#: The strategies the web page offers, those this DDM can serve (:func:`strategies`); any
#: that ``parse_strategy`` accepts may be requested, unless ``sampling.strategies`` lists
#: them.
SUGGESTED_STRATEGIES = ("oracle", "top1", "top2", "threshold:0.2", "ensemble")


def strategies(config: RouterConfigFile) -> list[str]:
    """The strategies this DDM allows (``sampling.strategies``; none listed:
    :data:`SUGGESTED_STRATEGIES`) that it can serve: ``oracle`` only where every label
    belongs to exactly one expert (a partition by label; in a k-means DDM every expert draws
    every label, so the label cannot pick one), the learned ones only with a router network."""
    by_label = (config.conditioning == LABELS
                and routes_by_label([e.classes for e in config.experts], config.num_classes))
    learned = has_router_network(config)
    return [s for s in config.sampling.strategies or SUGGESTED_STRATEGIES
            if (by_label if s == "oracle" else learned)]


def has_router_network(config: RouterConfigFile) -> bool:
    """Whether the DDM has a router network: a label DDM's checkpoint, or a text DDM's
    stage."""
    return config.router_checkpoint is not None or config.router_network is not None


def expert_card(entry: ExpertEntry, info: ExpertInfo | None, replicas: Mapping[str, str],
                ready: int) -> dict[str, Any]:
    """One expert as ``/v1/info`` lists it: its name, replicas (endpoint: state) and how many
    are ready, what runs it (framework, runtime, device, hardware: None until a replica has
    answered) and :func:`trained_on`."""
    about = info.about if info is not None else ExpertAbout()
    return {"name": entry.name, "ready_replicas": ready, "replicas": dict(replicas),
            "framework": about.framework, "runtime": about.runtime, "device": about.device,
            "hardware": about.hardware, "trained_on": trained_on(entry, info)}


def trained_on(entry: ExpertEntry, info: ExpertInfo | None) -> dict[str, Any]:
    """What the expert learned from: ``partition`` (``labels`` or ``kmeans``; None where it
    records none), its ``part`` (the cluster or label group, 0-based) of ``parts``, the
    ``features`` a k-means partition clustered, the ``labels`` it draws (None: every label),
    the training set's name (``data``) and size (``images``), and a ``summary`` of what its
    images show (a text expert's digits)."""
    partition = info.partition if info is not None else None
    scheme = partition.get("scheme") if partition is not None else None
    scheme = scheme if isinstance(scheme, Mapping) else {}
    parts = scheme.get("groups", scheme.get("centroids", scheme.get("clusters")))
    features = scheme.get("features")
    index = partition.get("index") if partition is not None else None
    about = info.about if info is not None else ExpertAbout()
    return {"partition": short_text(scheme.get("method")),
            "part": index if isinstance(index, int) and not isinstance(index, bool) else None,
            "parts": len(parts) if isinstance(parts, list) else
            parts if type(parts) is int and parts > 0 else None,
            "features": short_text(features.get("name")) if isinstance(features, Mapping) else None,
            "labels": list(entry.classes) or None,
            "data": about.data, "images": about.images, "summary": about.summary}
