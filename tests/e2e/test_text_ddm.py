"""A text-conditioned latent DDM on the dev cluster's real node (issue 22).

A tiny Paris release (random weights, the release's layout and key names) is imported with
``ddm import paris`` into a node directory the operator is allowed to mount (``file://``
checkpoints: the cheapest route for checkpoints a test makes). Its DDMDeployment places the
text encoder, the decoder and the router network ``separate``: the operator (in this process,
against the real API server) gives each a Deployment and a Service of its own, and the kubelet
runs them, the two experts and the router from the CPU image. The router answers
``POST /v1/images/generations`` with an RGB PNG equal, within 2/255, to what the in-process
sampler (``load_ddm`` + ``generate_text``) and Paris's published sampler
(tests/support/paris_reference.py) make from the same initial latents: with the router network
on a server of its own, the router must still walk FlowMatchEulerDiscrete's time grid.

Every wait polls the API or the router with a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import yaml
from kubernetes import client
from PIL import Image
from podwatch import new_namespace
from waiting import wait_for

from ddm.cli import main
from ddm.models.ddm import load_ddm
from ddm.operator.config import Images, OperatorConfig
from ddm.operator.policy import AllowLists
from ddm.sampling.pipeline import generate_text
from ddm.checkpoints.declared import PLAN_NAMES
from ddm_devcluster import ClusterInfo
from ddm_devcluster import images as dev_images
from tests.support.operator_process import install_crd, operator_in_thread
from tests.support.paris_reference import ParisReference
from tests.support.paris_release import write_paris_release

NAMESPACE, NAME = "text-demo", "paris"
GROUP, VERSION_API, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
SEPARATE = ("textEncoder", "decoder")
STAGES = set(PLAN_NAMES.values())  # every stage a text DDM has
PROMPT = "a photo of a red car on the beach"
STEPS, SEED, GUIDANCE = 4, 2, 7.5
READY_TIMEOUT_S = 600
GENERATION_S = 300
# Six server pods on a two-core node: small requests; the text stages load torch and
# transformers (a few hundred MiB each).
RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1536Mi"}}


@pytest.fixture(scope="module")
def imported() -> Iterator[tuple[Path, Path]]:
    """(the release, its import) under a new directory of /tmp: a node directory the pods
    (uid 10001) can read, as a pytest temporary directory (mode 0700) is not."""
    base = Path(tempfile.mkdtemp(prefix="ddm-e2e-text-", dir="/tmp"))
    try:
        release = write_paris_release(base / "release", seed=7)
        out = base / "paris"
        assert main(["import", "paris", str(release), "--out", str(out)]) == 0
        for directory, _, files in os.walk(base):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(Path(directory) / name, 0o644)
        yield release, out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _manifest(out: Path) -> dict[str, Any]:
    """The imported ddm.yaml with the text encoder, decoder and router network on servers of
    their own (CPU), every pod with a small request."""
    document = yaml.safe_load((out / "ddm.yaml").read_text())
    document["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = document["spec"]
    for stage in (*(spec[key] for key in SEPARATE), spec["router"]["network"]):
        stage.update(placement="separate", accelerator={"type": "cpu"}, replicas=1,
                     resources=RESOURCES)
    spec["router"]["resources"] = RESOURCES
    del spec["router"]["auth"]  # the stages are under test here, not the token
    for expert in spec["experts"]:
        expert["resources"] = RESOURCES
    return document


@pytest.fixture(scope="module")
def api(dev_cluster: ClusterInfo, kube_client: Any, imported: tuple[Path, Path]
        ) -> Iterator[dict[str, Any]]:
    """The CRD installed, the operator running (allowed to mount the import's directory),
    the namespace made."""
    install_crd(kube_client)
    core = client.CoreV1Api(kube_client)
    new_namespace(core, NAMESPACE)
    config = OperatorConfig(images=Images.defaults(dev_images.VERSION),
                            image_pull_policy="Never",
                            allowed=AllowLists(host_paths=(f"{imported[1].parent}/",)))
    try:
        with operator_in_thread(dev_cluster.kubeconfig, config, (NAMESPACE,)):
            yield {"core": core, "apps": client.AppsV1Api(kube_client),
                   "custom": client.CustomObjectsApi(kube_client), "cluster": dev_cluster}
    finally:
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)


def _status(api: dict[str, Any]) -> dict[str, Any]:
    return api["custom"].get_namespaced_custom_object(
        GROUP, VERSION_API, NAMESPACE, PLURAL, NAME).get("status") or {}


def _explain(api: dict[str, Any]) -> str:
    lines = [f"status: {_status(api)}"]
    for pod in api["core"].list_namespaced_pod(NAMESPACE).items:
        lines.append(f"--- {pod.metadata.name}: {pod.status.phase}")
        try:
            lines.append(api["core"].read_namespaced_pod_log(
                pod.metadata.name, NAMESPACE, tail_lines=30))
        except client.ApiException as error:
            lines.append(f"(no log: {error.reason})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def deployed(api: dict[str, Any], imported: tuple[Path, Path]) -> dict[str, Any]:
    """The DDM applied and Ready; the router's address (pods are reachable from this host)
    and how long it took."""
    started = time.monotonic()
    api["custom"].create_namespaced_custom_object(GROUP, VERSION_API, NAMESPACE, PLURAL,
                                                  _manifest(imported[1]))
    status = wait_for(lambda: (s if (s := _status(api)).get("phase") == "Ready" else None),
                      READY_TIMEOUT_S, f"the {NAME} DDMDeployment to be Ready",
                      lambda: _explain(api))
    ready_s = time.monotonic() - started
    (router,) = [p for p in api["core"].list_namespaced_pod(
        NAMESPACE, label_selector=f"ddm.dev/deployment={NAME},"
                                  "app.kubernetes.io/component=router").items
                 if p.metadata.deletion_timestamp is None]
    print(f"\n{NAME}: Ready {ready_s:.0f} s after it was applied")
    return {"status": status, "url": f"http://{router.status.pod_ip}:8080"}


def test_each_separate_stage_runs_in_its_own_deployment_from_our_image(
        api: dict[str, Any], deployed: dict[str, Any]) -> None:
    stages = {s["name"]: s for s in deployed["status"]["stages"]}
    assert set(stages) == STAGES
    assert all(s["readyReplicas"] == s["replicas"] == 1 for s in stages.values()), stages
    conditions = {c["type"]: c["status"] for c in deployed["status"]["conditions"]}
    assert conditions["StagesReady"] == conditions["Ready"] == "True", conditions
    for role in STAGES:
        deployment = api["apps"].read_namespaced_deployment(f"{NAME}-stage-{role}", NAMESPACE)
        (container,) = deployment.spec.template.spec.containers
        assert container.command[:3] == ["ddm", "serve", "stage"], container.command
    for pod in api["core"].list_namespaced_pod(
            NAMESPACE, label_selector=f"ddm.dev/deployment={NAME}").items:
        (container,) = pod.spec.containers
        assert container.image == dev_images.CPU.name, pod.metadata.name
        assert pod.spec.node_name == "ddm-real-0", pod.metadata.name


def test_kubectl_get_ddm_shows_it_ready(api: dict[str, Any], deployed: dict[str, Any]
                                        ) -> None:
    env = {**os.environ, "KUBECONFIG": str(api["cluster"].kubeconfig)}
    table = subprocess.run(["kubectl", "get", "ddm", "-n", NAMESPACE], env=env, check=True,
                           capture_output=True, text=True).stdout
    header, row = table.splitlines()
    assert header.split()[:3] == ["NAME", "READY", "EXPERTS"], table
    assert row.split()[:3] == [NAME, "True", "2/2"], table


def test_the_router_draws_the_in_process_samplers_image(
        deployed: dict[str, Any], imported: tuple[Path, Path]) -> None:
    release, out = imported
    reference = ParisReference(release)
    latents = reference.initial_latents(SEED)
    buffer = io.BytesIO()
    np.save(buffer, latents.numpy())
    started = time.monotonic()
    reply = httpx.post(f"{deployed['url']}/v1/images/generations", timeout=GENERATION_S, json={
        "prompt": PROMPT, "steps": STEPS, "strategy": "top2", "guidance_scale": GUIDANCE,
        "response_format": "b64_json", "latents": base64.b64encode(buffer.getvalue()).decode()})
    served_s = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    (item,) = reply.json()["data"]
    png = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert png.format == "PNG" and png.mode == "RGB"
    image = np.asarray(png).astype(int)

    with torch.random.fork_rng():
        local = generate_text(load_ddm(out), [PROMPT], steps=STEPS, strategy="top2",
                              guidance_scale=GUIDANCE, latents=latents.numpy())
    expected = reference.generate(PROMPT, routing="top2", cfg_scale=GUIDANCE,
                                  num_steps=STEPS, latents=latents)
    (in_process,) = local.images.astype(int)
    assert image.shape == in_process.shape == expected.image.shape == (16, 16, 3)
    from_local = int(np.abs(image - in_process).max())
    from_reference = int(np.abs(image - expected.image.astype(int)).max())
    print(f"\n/v1/images/generations: {served_s:.1f} s for {STEPS} guided steps; max pixel "
          f"difference {from_local}/255 from the in-process sampler, {from_reference}/255 "
          "from Paris's sampler")
    assert from_local <= 2 and from_reference <= 2, (from_local, from_reference)
