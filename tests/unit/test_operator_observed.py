"""The operator's cache of what its watches showed (``ddm.operator.observed``): a copy that is
behind never replaces a newer one, a deletion never removes another object of the same name,
and a reconcile finds an owner's children and pods by the owner's label."""

from __future__ import annotations

from typing import Any

from ddm.operator import names
from ddm.operator.observed import Observed


def _obj(kind: str, name: str, uid: str, version: int, owner: str | None = "d",
         **extra: Any) -> dict[str, Any]:
    labels = {names.DEPLOYMENT_LABEL: owner} if owner else {}
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "uid": uid,
                                       "resourceVersion": str(version), "labels": labels},
            **extra}


def test_an_event_older_than_the_operators_own_write_does_not_take_it_back() -> None:
    observed = Observed()
    observed.seen(_obj("ConfigMap", "d-router-config", "u1", 12, data={"router.yaml": "new"}))
    observed.seen(_obj("ConfigMap", "d-router-config", "u1", 11, data={"router.yaml": "old"}))
    assert observed.get("ConfigMap", "ns", "d-router-config")["data"] == {"router.yaml": "new"}
    observed.seen(_obj("ConfigMap", "d-router-config", "u1", 13, data={"router.yaml": "newer"}))
    assert observed.get("ConfigMap", "ns", "d-router-config")["data"] == {"router.yaml": "newer"}


def test_an_object_made_again_under_the_same_name_replaces_the_old_one_whatever_its_version(
        ) -> None:
    observed = Observed()
    observed.seen(_obj("Service", "d-router", "old-uid", 50))
    observed.seen(_obj("Service", "d-router", "new-uid", 7))
    assert observed.get("Service", "ns", "d-router")["metadata"]["uid"] == "new-uid"


def test_the_deletion_of_an_old_object_leaves_the_one_made_since_under_its_name() -> None:
    observed = Observed()
    observed.seen(_obj("Service", "d-router", "new-uid", 60))
    observed.gone(_obj("Service", "d-router", "old-uid", 50))
    assert observed.get("Service", "ns", "d-router") is not None
    observed.gone(_obj("Service", "d-router", "new-uid", 61))
    assert observed.get("Service", "ns", "d-router") is None
    assert observed.owned("ns", "d", {"Service"}) == {}


def test_an_owners_children_and_pods_are_found_by_its_label_and_kind() -> None:
    observed = Observed()
    observed.seen(_obj("Deployment", "d-router", "u1", 1))
    observed.seen(_obj("Service", "d-router", "u2", 2))
    observed.seen(_obj("Pod", "d-router-abc", "u3", 3))
    observed.seen(_obj("Deployment", "e-router", "u4", 4, owner="e"))
    observed.seen(_obj("Deployment", "loose", "u5", 5, owner=None))
    assert set(observed.owned("ns", "d", {"Deployment", "Service"})) == {
        ("Deployment", "d-router"), ("Service", "d-router")}
    assert set(observed.owned("ns", "d", {"Pod"})) == {("Pod", "d-router-abc")}
    # a child whose label now names another owner moves with it
    observed.seen(_obj("Service", "d-router", "u2", 9, owner="e"))
    assert set(observed.owned("ns", "d", {"Service"})) == set()
    assert set(observed.owned("ns", "e", {"Service"})) == {("Service", "d-router")}


def test_a_copy_handed_out_is_the_callers_own() -> None:
    observed = Observed()
    observed.seen(_obj("ConfigMap", "d-router-config", "u1", 1, data={"router.yaml": "x"}))
    copy = observed.get("ConfigMap", "ns", "d-router-config")
    copy["data"]["router.yaml"] = "changed by the caller"
    assert observed.get("ConfigMap", "ns", "d-router-config")["data"] == {"router.yaml": "x"}
