"""The test node agent plays the kubelet for the dev cluster's fake nodes (test scaffolding).

Small real pods (``python -m http.server``, one-shot ``python -c`` scripts) on the real API
server, scheduler and controllers: the agent runs them as processes, and what it reports is
what the ReplicaSet, Deployment and endpoints controllers and the cluster DNS act on. One-shot
pods report what they saw inside the container through their termination message. Every
wait polls the API with a deadline.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from node_agent import NodeAgent
from waiting import wait_for

from ddm.devcluster import ClusterInfo

TOLERATE_ALL = [{"operator": "Exists"}]  # any fake node will do




@pytest.fixture
def agent(dev_cluster: ClusterInfo, kube_namespace: str, tmp_path: Path) -> Iterator[NodeAgent]:
    """An agent for this test's namespace only; its logs stay in ``tmp_path/agent``."""
    with NodeAgent(dev_cluster, tmp_path / "agent", namespaces=[kube_namespace],
                   max_probe_period_s=0.5) as running:
        yield running


class Pods:
    """Plain-dict pod reads and writes in one namespace."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.core, self.apps = client.CoreV1Api(api_client), client.AppsV1Api(api_client)
        self.namespace = namespace

    def create(self, name: str, containers: list[dict], **spec: Any) -> None:
        self.core.create_namespaced_pod(self.namespace, {
            "metadata": {"name": name, "labels": {"test": name}},
            "spec": {"containers": containers, "tolerations": TOLERATE_ALL, **spec}})

    def get(self, name: str) -> dict | None:
        try:
            return json.loads(self.core.read_namespaced_pod(
                name, self.namespace, _preload_content=False).data)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def selected(self, selector: str) -> list[dict]:
        return json.loads(self.core.list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False).data)["items"]

    def finished(self, name: str, timeout_s: float = 20) -> dict:
        """The pod once Succeeded or Failed."""
        def done() -> dict | None:
            pod = self.get(name)
            return pod if pod and pod["status"].get("phase") in ("Succeeded", "Failed") else None
        return wait_for(done, timeout_s, f"pod {name} to finish")

    def report(self, name: str) -> dict:
        """The JSON a one-shot pod wrote to its termination log, once it succeeded."""
        pod = self.finished(name)
        (status,) = pod["status"]["containerStatuses"]
        assert pod["status"]["phase"] == "Succeeded", status
        return json.loads(status["state"]["terminated"]["message"])

    def web_deployment(self, name: str, replicas: int) -> None:
        """``replicas`` static web servers, ready once they answer HTTP on port ``http``."""
        container = {
            "name": "web", "image": "python:3.11",
            "command": ["python", "-m", "http.server", "8000", "--bind", "0.0.0.0",
                        "--directory", "/tmp"],
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        }
        self.apps.create_namespaced_deployment(self.namespace, {
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [container],
                                           "tolerations": TOLERATE_ALL}}}})

    def ready(self, selector: str, count: int, timeout_s: float = 20) -> list[dict]:
        """Exactly ``count`` live pods matching ``selector``, all Running and Ready."""
        def check() -> list[dict] | None:
            pods = [p for p in self.selected(selector)
                    if not p["metadata"].get("deletionTimestamp")]
            ok = len(pods) == count and all(
                p["status"].get("phase") == "Running" and _condition(p, "Ready") for p in pods)
            return pods if ok else None
        return wait_for(check, timeout_s, f"{count} ready pods {selector}")


def _condition(pod: dict, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True"
               for c in pod["status"].get("conditions") or [])


def one_shot(script: str, **container: Any) -> list[dict]:
    """A container that runs a Python script (which writes its report to the termination log)."""
    return [{"name": "main", "image": "python:3.11",
             "command": ["python", "-c", textwrap.dedent(script)], **container}]


def dns_over_tcp(server: str, name: str) -> tuple[int, list[str]]:
    """(rcode, A records) for ``name``, asked over TCP (pods' resolvers use UDP)."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + question + struct.pack("!HH", 1, 1)
    with socket.create_connection((server, 53), timeout=5) as connection:
        connection.sendall(struct.pack("!H", len(query)) + query)
        reader = connection.makefile("rb")
        reply = reader.read(struct.unpack("!H", reader.read(2))[0])
    _, flags, _, count = struct.unpack("!HHHH", reply[:8])
    answers = reply[12 + len(question) + 4:]
    return flags & 0xF, [socket.inet_ntoa(answers[16 * i + 12:16 * i + 16]) for i in range(count)]


@pytest.fixture
def pods(kube_client: Any, kube_namespace: str) -> Pods:
    return Pods(kube_client, kube_namespace)


def test_a_deployment_behind_a_headless_service_is_served_and_resolved(
        agent: NodeAgent, pods: Pods, kube_namespace: str) -> None:
    pods.web_deployment("web", replicas=2)
    pods.core.create_namespaced_service(kube_namespace, {
        "metadata": {"name": "web"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]}})

    ready = pods.ready("app=web", 2)
    ips = sorted(p["status"]["podIP"] for p in ready)
    assert len(set(ips)) == 2 and all(ip.startswith("198.18.") for ip in ips), ips
    for ip in ips:  # each server listens on its own pod's address
        with urllib.request.urlopen(f"http://{ip}:8000/", timeout=5) as response:
            assert response.status == 200

    def endpoints() -> list[str] | None:
        body = json.loads(pods.core.read_namespaced_endpoints(
            "web", kube_namespace, _preload_content=False).data)
        found = sorted(a["ip"] for s in body.get("subsets") or [] for a in s.get("addresses") or [])
        return found if found == ips else None
    wait_for(endpoints, 10, "the endpoints controller to list both pods")

    full_name = f"web.{kube_namespace}.svc.cluster.local"
    pods.create("resolver", one_shot("""
        import json, socket, sys
        def lookup(name):
            try:
                return sorted({i[4][0] for i in socket.getaddrinfo(name, 80, socket.AF_INET)})
            except socket.gaierror as error:
                return error.strerror
        report = {name: lookup(name) for name in sys.argv[1:]}
        open("/dev/termination-log", "w").write(json.dumps(report))
        """, args=["web", full_name, "missing", "kubernetes.default.svc"]),
        restartPolicy="Never")
    report = pods.report("resolver")
    assert report["web"] == ips  # the short name, through resolv.conf's search path
    assert report[full_name] == ips
    assert isinstance(report["missing"], str)  # NXDOMAIN: an error, not an address
    assert report["kubernetes.default.svc"] == [agent.dns_address]
    assert dns_over_tcp(agent.dns_address, full_name) == (0, ips)
    assert dns_over_tcp(agent.dns_address, f"nope.{kube_namespace}.svc.cluster.local")[0] == 3
    assert dns_over_tcp(agent.dns_address, "example.com")[0] == 5  # REFUSED: no upstream


def test_a_crashing_container_is_restarted_with_its_termination_message(
        agent: NodeAgent, pods: Pods) -> None:
    pods.create("crasher", one_shot("""
        open("/dev/termination-log", "w").write("bad config: no experts")
        raise SystemExit(3)
        """))
    pods.create("noisy", one_shot("""
        import sys
        print("loading", flush=True)
        sys.exit("the last words on stderr")
        """, terminationMessagePolicy="FallbackToLogsOnError"), restartPolicy="Never")
    pods.create("host-path", one_shot("pass"), volumes=[
        {"name": "host", "hostPath": {"path": "/var/lib/data"}}])

    def crash_looping() -> dict | None:
        pod = pods.get("crasher")
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        waiting = statuses[0].get("state", {}).get("waiting", {})
        return statuses[0] if waiting.get("reason") == "CrashLoopBackOff" else None
    status = wait_for(crash_looping, 20, "the crasher to be in CrashLoopBackOff")
    assert status["restartCount"] >= 1
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert status["lastState"]["terminated"]["message"] == "bad config: no experts"
    assert pods.get("crasher")["status"]["phase"] == "Running"  # restartPolicy Always
    assert agent.logs(pods.namespace, "crasher", "main") == ""  # it printed nothing

    noisy = pods.finished("noisy")
    assert noisy["status"]["phase"] == "Failed"
    terminated = noisy["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["message"]) == (
        1, "loading\nthe last words on stderr")
    assert agent.logs(pods.namespace, "noisy", "main") == "loading\nthe last words on stderr\n"

    failed = pods.finished("host-path")
    assert failed["status"]["phase"] == "Failed"
    assert failed["status"]["reason"] == "UnsupportedVolume"
    assert "hostPath" in failed["status"]["message"]


def test_deleting_a_pod_kills_its_process_and_the_replica_set_replaces_it(
        agent: NodeAgent, pods: Pods) -> None:
    pods.web_deployment("solo", replicas=1)
    (first,) = pods.ready("app=solo", 1)
    name, uid = first["metadata"]["name"], first["metadata"]["uid"]
    pid = agent.pids(pods.namespace, name)["web"]

    pods.core.delete_namespaced_pod(name, pods.namespace)  # the default 30 s grace period

    wait_for(lambda: pods.get(name) is None, 10, f"the agent to remove pod {name}")
    with pytest.raises(ProcessLookupError):  # the server got SIGTERM and is gone
        os.kill(pid, 0)
    (second,) = pods.ready("app=solo", 1)
    assert second["metadata"]["uid"] != uid
    assert agent.pids(pods.namespace, second["metadata"]["name"])["web"] != pid


def test_probes_decide_readiness_and_a_failed_liveness_probe_restarts_the_container(
        agent: NodeAgent, pods: Pods) -> None:
    # Healthy for about 3 s, then the liveness file disappears (the server itself stays up).
    script = ("touch /tmp/healthy; (sleep 3; rm /tmp/healthy) & "
              "exec python -m http.server 8000 --bind 0.0.0.0 --directory /tmp")
    pods.create("flaky", [{
        "name": "main", "image": "python:3.11", "command": ["sh", "-c", script],
        "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
        "livenessProbe": {"exec": {"command": ["cat", "/tmp/healthy"]}, "periodSeconds": 1,
                          "initialDelaySeconds": 1, "failureThreshold": 1},
    }])
    pods.ready("test=flaky", 1)

    def restarted() -> dict | None:
        statuses = pods.get("flaky")["status"]["containerStatuses"]
        return statuses[0] if statuses[0]["restartCount"] >= 1 else None
    status = wait_for(restarted, 15, "the liveness probe to restart the container")
    assert status["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM
    pods.ready("test=flaky", 1)  # and it comes back ready


def test_a_pod_sees_its_volumes_env_and_files_as_in_a_real_container(
        agent: NodeAgent, pods: Pods, kube_namespace: str) -> None:
    pods.core.create_namespaced_config_map(kube_namespace, {
        "metadata": {"name": "settings"}, "data": {"mode": "fast", "unused": "x"}})
    pods.core.create_namespaced_secret(kube_namespace, {
        "metadata": {"name": "creds"}, "stringData": {"password": "hunter2"}})
    script = """
        import json, os, socket
        def read(path):
            return open(path).read() if os.path.exists(path) else None
        try:
            open("/written-to-root", "w")
            root = "writable"
        except OSError as error:
            root = error.strerror
        report = {
            "cwd": os.getcwd(), "hostname": socket.gethostname(),
            "env": {k: os.environ.get(k) for k in
                    ("POD_NAME", "POD_IP", "MODE", "PASSWORD", "GREETING", "CPUS",
                     "OMP_NUM_THREADS", "KUBERNETES_SERVICE_HOST")},
            "config": sorted(os.listdir("/etc/settings")),
            "config_mode": read("/etc/settings/speed"), "secret": read("/creds/password"),
            "labels": read("/info/labels"), "from_init": read("/scratch/init.txt"),
            "token": read("/var/run/secrets/kubernetes.io/serviceaccount/token"),
            "checkpoints": sorted(os.listdir("/opt/ddm/checkpoints")) != [],
            "root": root,
        }
        open("/dev/termination-log", "w").write(json.dumps(report))
        """
    def field(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}
    env = [
        {"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_IP", **field("status.podIP")},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "GREETING", "value": "hello $(POD_NAME)"},
        {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ]
    mounts = [{"name": "settings", "mountPath": "/etc/settings", "readOnly": True},
              {"name": "creds", "mountPath": "/creds"}, {"name": "info", "mountPath": "/info"},
              {"name": "work", "mountPath": "/scratch"}]
    pods.create(
        "inspector", one_shot(script, env=env, volumeMounts=mounts, workingDir="/scratch",
                              resources={"limits": {"cpu": "1500m", "memory": "256Mi"}},
                              securityContext={"readOnlyRootFilesystem": True}),
        restartPolicy="Never", automountServiceAccountToken=False,
        initContainers=[{"name": "prepare", "image": "busybox", "command": [
            "sh", "-c", "echo from init > /scratch/init.txt"],
            "volumeMounts": [{"name": "work", "mountPath": "/scratch"}]}],
        volumes=[
            {"name": "settings", "configMap": {"name": "settings",
                                               "items": [{"key": "mode", "path": "speed"}]}},
            {"name": "creds", "secret": {"secretName": "creds"}},
            {"name": "info", "downwardAPI": {"items": [
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
            {"name": "work", "emptyDir": {}},
        ])

    report = pods.report("inspector")
    pod = pods.get("inspector")
    assert report["env"] == {
        "POD_NAME": "inspector", "POD_IP": pod["status"]["podIP"], "MODE": "fast",
        "PASSWORD": "hunter2", "GREETING": "hello inspector", "CPUS": "2",
        "OMP_NUM_THREADS": "1", "KUBERNETES_SERVICE_HOST": "127.0.0.1"}
    assert (report["cwd"], report["hostname"]) == ("/scratch", "inspector")
    assert (report["config"], report["config_mode"]) == (["speed"], "fast")
    assert report["secret"] == "hunter2"
    assert report["labels"] == 'test="inspector"'
    assert report["from_init"] == "from init\n"  # the init container ran first, same emptyDir
    assert report["token"] is None  # automountServiceAccountToken: false
    assert report["checkpoints"]  # the image's /opt/ddm is the repository
    assert report["root"] == "Read-only file system"
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["state"]["terminated"]["reason"] == "Completed"
    assert _condition(pod, "Initialized")


def test_in_cluster_credentials_work_and_rbac_applies(
        agent: NodeAgent, pods: Pods, kube_client: Any, kube_namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(kube_client)
    pods.core.create_namespaced_service_account(kube_namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(kube_namespace, {
        "metadata": {"name": "reader"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]})
    rbac.create_namespaced_role_binding(kube_namespace, {
        "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": kube_namespace}]})
    pods.core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "visible"}})
    wait_for(lambda: pods.core.read_namespaced_service_account("reader", kube_namespace).secrets,
             10, "the token controller to give the service account a token")

    pods.create("in-cluster", one_shot("""
        import json, logging, ssl, urllib.request
        import kopf
        from kubernetes import client, config

        ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
        config.load_incluster_config()
        core = client.CoreV1Api()
        report = {"configmaps": [c.metadata.name
                                 for c in core.list_namespaced_config_map(ns).items]}
        try:
            core.list_namespaced_secret(ns)
            report["secrets"] = "listed"
        except client.ApiException as error:
            report["secrets"] = error.status

        def get(info):  # one API call with the credentials a kopf login found
            context = ssl.create_default_context(cafile=info.ca_path)
            request = urllib.request.Request(f"{info.server}/api/v1/namespaces/{ns}/configmaps",
                                             headers={"Authorization": f"Bearer {info.token}"})
            return urllib.request.urlopen(request, context=context, timeout=10).status
        settings, logger = kopf.OperatorSettings(), logging.getLogger()
        report["kopf_via_client"] = get(kopf.login_via_client(logger=logger, settings=settings))
        report["kopf_service_account"] = get(
            kopf.login_with_service_account(logger=logger, settings=settings))
        open("/dev/termination-log", "w").write(json.dumps(report))
        """, terminationMessagePolicy="FallbackToLogsOnError"),
        restartPolicy="Never", serviceAccountName="reader")

    report = pods.report("in-cluster")
    assert "visible" in report["configmaps"]
    assert report["secrets"] == 403  # the Role grants ConfigMaps only
    assert report["kopf_via_client"] == 200
    assert report["kopf_service_account"] == 200  # https://kubernetes.default.svc, as in a cluster
