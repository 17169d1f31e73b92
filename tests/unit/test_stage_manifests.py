"""A text DDM's stages in the plan, router.yaml and the operator's children: a stage placed
``separate`` is a Deployment + headless Service running ``ddm serve stage`` on its own
accelerator, reached by the router through DNS; one placed ``router`` is mounted into the
router's pod and loaded there; precision reaches every server's flags."""

from __future__ import annotations

import dataclasses

from podsecurity import violations

from ddm.deploy.plan import plan_deployment
from ddm.deploy.router_config import DnsDiscovery, RouterConfigFile, StageEntry
from ddm.deploy.spec import parse_spec
from ddm.operator import names
from ddm.operator.config import Images, OperatorConfig
from ddm.operator.fetcher import fetched
from ddm.operator.manifests import build_children

META = {"name": "paris", "namespace": "ml", "uid": "1234", "generation": 1}
CONFIG = OperatorConfig(images=Images({"cpu": "reg/ddm:1", "cuda": "reg/ddm-cuda:1",
                                       "neuron": "reg/ddm-neuron:1", "tpu": "reg/ddm-tpu:1"}))


def _text_spec(**changes) -> dict:
    spec = {
        "conditioning": "text",
        "sampling": {"steps": 50, "strategy": "top2", "guidanceScale": 7.5},
        "textEncoder": {"checkpoint": {"uri": "pvc://models/paris/text_encoder"},
                        "precision": "float32"},
        "decoder": {"checkpoint": {"uri": "pvc://models/paris/decoder"},
                    "placement": "separate", "accelerator": {"type": "nvidia"},
                    "replicas": 2, "precision": "bfloat16"},
        "router": {"checkpoint": {"uri": "pvc://models/paris/router"},
                   "network": {"placement": "separate", "accelerator": {"type": "neuron"}}},
        "experts": [{"name": f"expert-{k}", "accelerator": {"type": "nvidia"},
                     "precision": "bfloat16",
                     "checkpoint": {"uri": f"pvc://models/paris/expert_{k}"}}
                    for k in range(2)],
    }
    spec.update(changes)
    return spec


def _children(raw: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c
            for c in build_children(parse_spec(raw), META, CONFIG)}


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_plan_has_every_stage_with_its_servers_flags() -> None:
    plan = plan_deployment(parse_spec(_text_spec()))
    stages = {s.role: s for s in plan.stages}
    assert set(stages) == {"text-encoder", "decoder", "router-network"}
    assert [s.role for s in plan.separate_stages] == ["decoder", "router-network"]
    assert stages["decoder"].command("/c", "0.0.0.0", 8000, 9090) == (
        "serve", "stage", "--checkpoint", "/c", "--host", "0.0.0.0", "--port", "8000",
        "--metrics-port", "9090", "--backend", "torch", "--device", "cuda", "--precision",
        "bfloat16")
    assert stages["router-network"].args == ("--backend", "neuron")
    assert stages["router-network"].env("/cache")  # Neuron's compile caches
    assert plan.experts[0].args == ("--backend", "torch", "--device", "cuda",
                                    "--precision", "bfloat16")


def test_router_yaml_loads_in_router_stages_and_discovers_separate_ones() -> None:
    plan = plan_deployment(parse_spec(_text_spec()))
    experts = {e.name: DnsDiscovery(f"{e.name}.dns", 8000) for e in plan.experts}
    config = plan.router_config(
        experts, checkpoint_dir=None,
        stage_places={"decoder": DnsDiscovery("decoder.dns", 8000),
                      "router-network": DnsDiscovery("network.dns", 8000),
                      "text-encoder": "/models/text-encoder"})
    assert config.conditioning == "text"
    assert config.text_encoder == StageEntry(checkpoint="/models/text-encoder",
                                             precision="float32")
    assert config.decoder == StageEntry(discovery=DnsDiscovery("decoder.dns", 8000))
    assert config.router_network == StageEntry(discovery=DnsDiscovery("network.dns", 8000))
    assert config.router_checkpoint is None
    assert (config.sampling.guidance_scale, config.sampling.steps) == (7.5, 50)
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_a_text_ddms_router_network_in_the_router_is_a_stage_entry() -> None:
    raw = _text_spec()
    raw["router"] = {"checkpoint": {"uri": "pvc://models/paris/router"}}
    plan = plan_deployment(parse_spec(raw))
    config = plan.router_config(
        {e.name: DnsDiscovery(e.name, 8000) for e in plan.experts},
        checkpoint_dir="/models/router",
        stage_places={"decoder": DnsDiscovery("decoder", 8000),
                      "text-encoder": "/models/text-encoder"})
    assert config.router_network == StageEntry(checkpoint="/models/router")
    assert config.router_checkpoint is None


def test_a_separate_stage_is_a_deployment_and_headless_service_on_its_accelerator() -> None:
    children = _children(_text_spec())
    decoder = children[("Deployment", "paris-stage-decoder")]
    assert decoder["spec"]["replicas"] == 2
    container = _container(decoder)
    assert container["image"] == "reg/ddm-cuda:1"
    assert container["command"][:5] == ["ddm", "serve", "stage", "--checkpoint",
                                        "/models/stage"]
    assert container["command"][-6:] == ["--device", "cuda", "--precision", "bfloat16",
                                         "--drain-s", "5"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert decoder["spec"]["template"]["metadata"]["labels"][names.STAGE_LABEL] == "decoder"
    service = children[("Service", "paris-stage-decoder")]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == decoder["spec"]["selector"]["matchLabels"]
    network = _container(children[("Deployment", "paris-stage-router-network")])
    assert network["image"] == "reg/ddm-neuron:1"
    assert network["resources"]["limits"]["aws.amazon.com/neuron"] == "1"
    # The router network's pod mounts the router's checkpoint.
    assert {"name": "checkpoint", "mountPath": "/models/stage", "readOnly": True,
            "subPath": "paris/router"} in network["volumeMounts"]
    assert ("Deployment", "paris-stage-text-encoder") not in children
    for deployment in (decoder, children[("Deployment", "paris-stage-router-network")]):
        assert violations(deployment["spec"]["template"]["spec"]) == []


def test_the_router_pod_mounts_only_the_stages_it_loads() -> None:
    children = _children(_text_spec())
    router = children[("Deployment", "paris-router")]
    mounts = {m["mountPath"]: m for m in _container(router)["volumeMounts"]}
    assert mounts["/models/text-encoder"]["subPath"] == "paris/text_encoder"
    assert "/models/router" not in mounts and "/models/decoder" not in mounts
    config = RouterConfigFile.from_yaml(
        children[("ConfigMap", "paris-router-config")]["data"]["router.yaml"])
    assert config.text_encoder == StageEntry(checkpoint="/models/text-encoder",
                                             precision="float32")
    assert config.decoder.discovery == DnsDiscovery(
        "paris-stage-decoder.ml.svc.cluster.local", names.EXPERT_PORT)
    assert config.router_network.discovery.dns == (
        "paris-stage-router-network.ml.svc.cluster.local")


def test_stages_behind_network_policies_admit_their_router() -> None:
    config = dataclasses.replace(CONFIG, network_policy=True)
    policies = {c["metadata"]["name"]: c["spec"]
                for c in build_children(parse_spec(_text_spec()), META, config)
                if c["kind"] == "NetworkPolicy"}
    stages = policies["paris-stages"]
    assert stages["podSelector"]["matchLabels"] == names.selector("paris", "stage")
    assert stages["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": names.selector("paris", "router")}}]
    egress = [rule["to"][0].get("podSelector", {}).get("matchLabels")
              for rule in policies["paris-router"]["egress"]]
    assert names.selector("paris", "stage") in egress


def test_fetched_stage_checkpoints_go_through_the_stager() -> None:
    raw = _text_spec()
    raw["decoder"]["checkpoint"] = {"uri": "https://models.example/paris/decoder.tar.gz"}
    raw["textEncoder"]["checkpoint"] = {"uri": "s3://bucket/paris/text_encoder"}
    keys = [key for key, _, _ in fetched(parse_spec(raw))]
    assert keys == ["stage-text-encoder", "stage-decoder"]
    children = _children(raw)
    assert ("Deployment", "paris-stager") in children
    router_pod = children[("Deployment", "paris-router")]["spec"]["template"]["spec"]
    assert [c["name"] for c in router_pod["initContainers"]] == [
        "copy-checkpoint-text-encoder"]
    decoder_pod = children[("Deployment", "paris-stage-decoder")]["spec"]["template"]["spec"]
    assert [c["name"] for c in decoder_pod["initContainers"]] == ["copy-checkpoint"]


def _ready(name: str, ready: int) -> tuple[str, dict]:
    return name, {"status": {"readyReplicas": ready}}


def test_status_reports_separate_stages_and_waits_for_them() -> None:
    from ddm.operator.status import ready_status

    spec = parse_spec(_text_spec())
    running = dict([_ready("paris-router", 1), _ready("paris-expert-expert-0", 1),
                    _ready("paris-expert-expert-1", 1), _ready("paris-stage-decoder", 1),
                    _ready("paris-stage-router-network", 1)])
    crash = {"metadata": {"name": "paris-stage-decoder-x", "labels": names.labels(
                 "paris", "stage", stage="decoder")},
             "status": {"containerStatuses": [{
                 "name": "stage", "restartCount": 3,
                 "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": 1,
                                              "message": "CUDA out of memory"}}}]}}
    status = ready_status(spec, META, deployments=running, previous={}, now="T1", pods=[crash])
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["StagesReady"]["status"] == "False"
    assert conditions["StagesReady"]["message"].startswith("decoder: 1/2 ready: ")
    assert "CUDA out of memory" in conditions["StagesReady"]["message"]
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False", "StagesNotReady")
    assert status["stages"][0]["name"] == "decoder"
    assert (status["stages"][0]["replicas"], status["stages"][0]["readyReplicas"],
            status["stages"][0]["reason"]) == (2, 1, "CrashLoopBackOff")
    assert status["stages"][1] == {"name": "router-network", "placement": "separate",
                                   "accelerator": "neuron x1", "replicas": 1,
                                   "readyReplicas": 1}
    running.update([_ready("paris-stage-decoder", 2)])
    ready = ready_status(spec, META, deployments=running, previous=status, now="T2")
    assert ready["phase"] == "Ready"
    assert {c["type"]: c["status"] for c in ready["conditions"]}["StagesReady"] == "True"


def test_the_mixed_deployment_of_docs_paris_md_is_valid() -> None:
    import re
    from pathlib import Path

    import yaml

    from ddm.deploy.spec import parse_manifest

    text = (Path(__file__).resolve().parents[2] / "docs" / "paris.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
                 if "kind: DDMDeployment" in b)
    spec = parse_manifest(yaml.safe_load(block)).spec
    assert [e.accelerator.type for e in spec.experts] == ["nvidia", "neuron"] * 4
    children = {(c["kind"], c["metadata"]["name"])
                for c in build_children(spec, META, CONFIG)}
    assert {("Deployment", "paris-stage-decoder"),
            ("Deployment", "paris-stage-router-network")} <= children
    assert ("Deployment", "paris-stage-text-encoder") not in children


def test_the_diagram_shows_separate_stages_on_their_hardware_and_the_routers_own() -> None:
    from ddm.operator.diagram import render_mermaid

    text = render_mermaid(parse_spec(_text_spec()), "paris")
    assert "paris router<br/>strategy top2, 50 euler steps<br/>1 replica on CPU<br/>with its " \
           "text encoder" in text
    nvidia = text[text.index('subgraph nvidia'):text.index("end", text.index("subgraph nvidia"))]
    assert 'stage_decoder["decoder<br/>2 replicas with nvidia x1 each"]' in nvidia
    assert 'stage_router_network["router network<br/>1 replica with neuron x1 each"]' in text
    assert "router --> stage_decoder" in text and "router --> expert1" in text
