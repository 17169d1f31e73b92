"""``python -m benchmarks operator``: the operator bringing up many DDMDeployments on a real
control plane.

The operator runs as its own process (``ddm operator``, as in its pod) under its own identity, a
ServiceAccount, so the API server can tell its requests apart: a FlowSchema of API Priority and
Fairness matches that account alone, and the server's own counter
``apiserver_flowcontrol_dispatched_requests_total`` for that schema, read before and after,
is the number of requests the operator made (watches, which are long-running, excepted).

Measured: seconds until every child exists (Deployments, Services, ConfigMaps), seconds until
every status is written with the current ``observedGeneration``, the operator's peak RSS
(``VmHWM`` in ``/proc``), and its API requests, per DDMDeployment and per child, then per
second while idle (its runs read from its watches, so there is no request per run to count
runs by).

The operator process, its identity, the CRD and the spec come from the cluster tests' harness
(``tests/support/operator_process.py``), so the benchmark measures the operator as those tests
run it; like every benchmark, it runs from a checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from kubernetes import client, config

from ddm_devcluster import down, up
from ddm.operator import names
from tests.support.operator_process import (OperatorProcess, cpu_spec, install_crd,
                                            service_account_kubeconfig)

OPERATOR_ACCOUNT = "ddm-operator"
#: Requests the API server counts for this FlowSchema are the operator's.
FLOW_SCHEMA = "ddm-bench-operator"
_FLOWCONTROL = "flowcontrol.apiserver.k8s.io"
_DISPATCHED = "apiserver_flowcontrol_dispatched_requests_total"
_POLL_S = 0.5
#: How long the operator may take to exit after SIGTERM (a pod's default grace period is 30 s).
_STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class OperatorBenchSettings:
    """``ddms`` DDMDeployments of ``experts`` experts each; ``idle_s``: how long to count the
    requests of the settled operator (pod changes still trigger runs)."""

    ddms: int = 50
    experts: int = 8
    idle_s: float = 30.0
    timeout_s: float = 600.0


class _Metrics:
    """The API server's count of the operator's requests (its /metrics, read as its admin)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api_client = api_client

    def read(self) -> float:
        """Requests dispatched for ``FLOW_SCHEMA``: the operator's."""
        total = 0.0
        for line in _get(self._api_client, "/metrics").decode().splitlines():
            if not line.startswith(_DISPATCHED + "{"):
                continue
            series, value = line.rsplit(" ", 1)
            if dict(re.findall(r'(\w+)="([^"]*)"', series)).get("flow_schema") == FLOW_SCHEMA:
                total += float(value)
        return total


def _identify_operator(api_client: client.ApiClient, namespace: str) -> None:
    """Bind the operator's account to cluster-admin and give it its own FlowSchema."""
    rbac = client.RbacAuthorizationV1Api(api_client)
    rbac.create_cluster_role_binding({
        "metadata": {"name": f"{FLOW_SCHEMA}-{namespace}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT,
                      "namespace": namespace}]})
    version = _flowcontrol_version(api_client)
    everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                  "clusterScope": True, "namespaces": ["*"]}
    client.CustomObjectsApi(api_client).create_cluster_custom_object(
        _FLOWCONTROL, version, "flowschemas", {
            "apiVersion": f"{_FLOWCONTROL}/{version}", "kind": "FlowSchema",
            "metadata": {"name": FLOW_SCHEMA},
            "spec": {
                # Where any ServiceAccount goes by default; matched before that schema.
                "priorityLevelConfiguration": {"name": "workload-low"},
                "matchingPrecedence": 500,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{
                    "subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                        "name": OPERATOR_ACCOUNT, "namespace": namespace}}],
                    "resourceRules": [everything],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}})


def _flowcontrol_version(api_client: client.ApiClient) -> str:
    """The served version of API Priority and Fairness (v1beta1 on 1.20, v1 since 1.29)."""
    groups = client.ApisApi(api_client).get_api_versions().groups
    found = [g.preferred_version.version for g in groups if g.name == _FLOWCONTROL]
    if not found:
        raise RuntimeError("the API server serves no API Priority and Fairness "
                           f"({_FLOWCONTROL}), which counts the operator's requests")
    return found[0]


def _forget_operator(api_client: client.ApiClient, namespace: str) -> None:
    """Undo ``_identify_operator`` and delete the benchmark's namespace (in the background)."""
    client.RbacAuthorizationV1Api(api_client).delete_cluster_role_binding(
        f"{FLOW_SCHEMA}-{namespace}")
    client.CustomObjectsApi(api_client).delete_cluster_custom_object(
        _FLOWCONTROL, _flowcontrol_version(api_client), "flowschemas", FLOW_SCHEMA)
    client.CoreV1Api(api_client).delete_namespace(namespace, _preload_content=False)


def _count_children(api_client: client.ApiClient, namespace: str) -> int:
    """How many Deployments, Services and ConfigMaps of the operator exist (metadata only)."""
    selector = f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}"
    metadata_only = {"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"}
    total = 0
    for path in (f"/apis/apps/v1/namespaces/{namespace}/deployments",
                 f"/api/v1/namespaces/{namespace}/services",
                 f"/api/v1/namespaces/{namespace}/configmaps"):
        listing = _get(api_client, path, [("labelSelector", selector)], metadata_only)
        total += len(json.loads(listing)["items"] or [])  # null when empty
    return total


def _get(api_client: client.ApiClient, path: str, query: list[tuple[str, str]] | None = None,
         headers: dict[str, str] | None = None) -> bytes:
    """GET what the typed clients do not offer (/metrics, metadata-only lists) as its user."""
    request = api_client.param_serialize("GET", path, query_params=query or [],
                                         header_params=headers or {},
                                         auth_settings=["BearerToken"])
    response = api_client.call_api(*request)
    body = response.read()
    if not 200 <= response.status < 300:
        raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:200]!r}")
    return body


def _statuses_written(custom: client.CustomObjectsApi, namespace: str, count: int) -> bool:
    items = [item for item in custom.list_cluster_custom_object(
        names.GROUP, names.VERSION, names.PLURAL)["items"]
        if item["metadata"]["namespace"] == namespace]
    return len(items) == count and all(
        (item.get("status") or {}).get("observedGeneration") == item["metadata"]["generation"]
        for item in items)


def run_operator_bench(settings: OperatorBenchSettings, kubeconfig: Path | None,
                       log: TextIO = sys.stderr) -> dict[str, Any]:
    """The figures as a dict; ``kubeconfig``: a cluster to use as its admin (None: a fresh dev
    cluster, stopped at the end)."""
    workdir = Path(tempfile.mkdtemp(prefix="ddm-bench-operator-"))
    try:
        if kubeconfig is None:
            print("starting a dev cluster", file=log, flush=True)
            with contextlib.redirect_stdout(log):  # `up` prints its export line: not ours
                kubeconfig = up(workdir / "cluster", log=lambda line: print(line, file=log)
                                ).kubeconfig
            try:
                return _measure(settings, kubeconfig, workdir, log)
            finally:
                down(workdir / "cluster", log=lambda line: print(line, file=log))
        return _measure(settings, kubeconfig, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _measure(settings: OperatorBenchSettings, kubeconfig: Path, workdir: Path, log: TextIO
             ) -> dict[str, Any]:
    admin = config.new_client_from_config(config_file=str(kubeconfig))
    namespace = f"ddm-bench-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
    install_crd(admin)
    _identify_operator(admin, namespace)
    try:
        return _bring_up(settings, admin, namespace, workdir, log)
    finally:
        _forget_operator(admin, namespace)


def _bring_up(settings: OperatorBenchSettings, admin: client.ApiClient, namespace: str,
              workdir: Path, log: TextIO) -> dict[str, Any]:
    identity = service_account_kubeconfig(admin, namespace, OPERATOR_ACCOUNT,
                                          workdir / "operator.kubeconfig")
    operator = OperatorProcess(identity, workdir / "operator.log")
    custom, metrics = client.CustomObjectsApi(admin), _Metrics(admin)
    expected = settings.ddms * (3 + 2 * settings.experts)
    load_before = os.getloadavg()
    operator.start()
    try:
        print(f"operator running (pid {operator.pid}); creating {settings.ddms} DDMDeployments "
              f"of {settings.experts} experts", file=log, flush=True)
        before = metrics.read()
        started = time.monotonic()
        spec = cpu_spec(settings.experts)
        for index in range(settings.ddms):
            custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace,
                                                   names.PLURAL, {
                "apiVersion": names.API_VERSION, "kind": names.KIND,
                "metadata": {"name": f"d{index:03d}"}, "spec": spec})
        created_s = time.monotonic() - started
        children_s: float | None = None
        statuses_s: float | None = None
        deadline = started + settings.timeout_s
        while children_s is None or statuses_s is None:
            if children_s is None and _count_children(admin, namespace) >= expected:
                children_s = time.monotonic() - started
            if statuses_s is None and _statuses_written(custom, namespace, settings.ddms):
                statuses_s = time.monotonic() - started
            if time.monotonic() > deadline:
                raise RuntimeError(f"not done after {settings.timeout_s:.0f} s (children "
                                   f"{children_s}, statuses {statuses_s}):\n{operator.log_tail()}")
            time.sleep(_POLL_S)
        settled = metrics.read()
        assert children_s is not None and statuses_s is not None
        print(f"children in {children_s:.1f} s, statuses in {statuses_s:.1f} s; counting idle "
              f"requests for {settings.idle_s:.0f} s", file=log, flush=True)
        time.sleep(settings.idle_s)  # a measurement window, not a wait for an event
        idle = metrics.read()
        peak_rss = operator.peak_rss_bytes()
        stopped_s = _seconds_to_exit(operator)
    finally:
        operator.kill()  # only if it is still running: something above failed
    requests = settled - before
    return {
        "settings": asdict(settings),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "kubernetes": client.VersionApi(admin).get_code().git_version,
            "python": sys.version.split()[0],
        },
        "children": expected,
        "create_s": round(created_s, 2),
        "all_children_s": round(children_s, 2),
        "all_statuses_s": round(statuses_s, 2),
        "poll_interval_s": _POLL_S,
        "operator_peak_rss_mib": round(peak_rss / 2**20, 1),
        "operator_sigterm_to_exit_s": None if stopped_s is None else round(stopped_s, 2),
        "operator_sigterm_limit_s": _STOP_TIMEOUT_S,
        "api_requests": {
            "until_statuses": int(requests),
            "per_ddm": round(requests / settings.ddms, 1),
            "per_child": round(requests / expected, 2),
            "idle_per_s": round((idle - settled) / settings.idle_s, 1),
        },
    }


def _seconds_to_exit(operator: OperatorProcess) -> float | None:
    """How long the operator takes to exit after SIGTERM; None if it was still running after
    ``_STOP_TIMEOUT_S`` (it is then killed)."""
    started = time.monotonic()
    try:
        operator.stop(timeout_s=_STOP_TIMEOUT_S)
    except RuntimeError:
        return None
    return time.monotonic() - started


def bench_operator_command(ddms: int = 50, experts: int = 8, kubeconfig: Path | None = None,
                           as_json: bool = False, out: TextIO = sys.stdout,
                           log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks operator``: the figures as JSON (``as_json``) or one line each on
    ``out``."""
    if ddms < 1:
        raise ValueError(f"ddms must be at least 1, got {ddms}")
    cpu_spec(experts)  # refuses a count it cannot build before any cluster starts
    result = run_operator_bench(OperatorBenchSettings(ddms=ddms, experts=experts), kubeconfig,
                                log)
    if as_json:
        print(json.dumps(result, indent=2), file=out)
    else:
        for key, value in result.items():
            print(f"{key}: {value}", file=out)
    return 0
