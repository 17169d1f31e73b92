"""``ddm render`` shows what the operator creates: on the real API server, the operator (with
the chart's defaults: router authentication and NetworkPolicies on) creates a DDM from
examples/mnist.yaml, one of its experts fetching its checkpoint, and every object it made
equals the rendered one: the same kinds and names, nothing more, nothing less, and every field
rendered is stored with the same value (the API server only adds its defaults and its own
fields); the tokens, random, are compared by their keys only."""

from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
import yaml
from test_operator import (  # the shared helpers of the operator's cluster tests
    DEFAULT_CONFIG,
    ROOT,
    Cluster,
    OperatorThread,
    crd,  # noqa: F401  (a fixture: the CRD applied)
    operator,  # noqa: F401  (a fixture: the operator running with default settings)
    wait_for,
)

from ddm.operator.config import OperatorConfig
from ddm.operator.render import CHART_DEFAULTS, render_objects

#: What a DDM's objects are found by (the operator's Secrets carry the same labels).
KINDS = ("Deployment", "Service", "ConfigMap", "NetworkPolicy", "Secret")


@pytest.fixture(scope="module")
def cluster(kube_client: Any) -> Cluster:
    return Cluster(kube_client)


@pytest.fixture()
def chart_operator(operator: OperatorThread) -> Iterator[OperatorConfig]:  # noqa: F811
    """The operator as the chart runs it by default (its images the tests' own)."""
    env = {**CHART_DEFAULTS, **{f"DDM_IMAGE_{family.upper()}": image
                                for family, image in DEFAULT_CONFIG.images.by_family.items()}}
    config = OperatorConfig.from_env(env)
    operator.restart(config)
    try:
        yield config
    finally:
        operator.restart(DEFAULT_CONFIG)


def _differences(rendered: Any, live: Any, path: str = "") -> list[str]:
    """Where ``live`` lacks a field of ``rendered`` or holds another value (lists must have
    the same length and match element by element; mappings may have more keys; an empty
    list or mapping may be absent: the API server does not store empty fields)."""
    if isinstance(rendered, dict):
        if not isinstance(live, dict):
            return [f"{path}: {live!r} is not a mapping"]
        return [d for key, value in rendered.items()
                for d in (_differences(value, live[key], f"{path}.{key}") if key in live
                          else [] if not value else [f"{path}.{key}: missing"])]
    if isinstance(rendered, list):
        if not isinstance(live, list) or len(live) != len(rendered):
            return [f"{path}: {live!r} differs from {rendered!r}"]
        return [d for i, (r, v) in enumerate(zip(rendered, live))
                for d in _differences(r, v, f"{path}[{i}]")]
    return [] if rendered == live else [f"{path}: {live!r} != {rendered!r}"]


def test_ddm_render_prints_what_the_operator_creates(cluster: Cluster, kube_namespace: str,
                                                     chart_operator: OperatorConfig) -> None:
    ns = kube_namespace
    document = yaml.safe_load((ROOT / "examples" / "mnist.yaml").read_text())
    document["spec"]["experts"][0]["checkpoint"] = {
        "uri": "https://store.example/ddm/e0.tar.gz?X-Amz-Signature=s"}
    name = document["metadata"]["name"]
    uid = cluster.create_ddm(ns, name, copy.deepcopy(document["spec"]))["metadata"]["uid"]
    rendered = render_objects(document, chart_operator, namespace=ns, uid=uid)
    assert {o["kind"] for o in rendered} == set(KINDS)
    expected = {(o["kind"], o["metadata"]["name"]) for o in rendered}

    def created() -> dict[tuple[str, str], dict] | None:
        found = {(kind, o["metadata"]["name"]): o for kind in KINDS
                 for o in cluster.list(kind, ns, f"ddm.dev/deployment={name}")}
        return found if set(found) == expected else None
    live = wait_for(created, 60, f"the objects ddm render shows: {sorted(expected)}")
    for obj in rendered:
        key = (obj["kind"], obj["metadata"]["name"])
        stored = copy.deepcopy(live[key])
        if "stringData" in obj:  # a random token: the operator's, never the renderer's
            assert set(stored["data"]) == set(obj["stringData"]), key
        # (a list's items carry no apiVersion and kind: the kind is in the key)
        obj = {k: v for k, v in obj.items() if k not in ("stringData", "apiVersion", "kind")}
        assert _differences(obj, stored) == [], (key, _differences(obj, stored))
