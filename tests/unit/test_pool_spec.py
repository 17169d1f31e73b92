"""spec.pools (issue 37): the spec's rules with their messages, the CRD's limits, the plan's
``ddm serve pool`` command, and what ``ddm up``, ``ddm render`` and ``ddm diagram`` make of a
pool: one model server for all its members, the accelerator requested once."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddm.checkpoints.declared import PLAN_NAMES
from ddm.deploy import crd, limits, pools, spec
from ddm.deploy.plan import plan_deployment
from ddm.deploy.router_config import DnsDiscovery, StaticDiscovery
from ddm.deploy.spec import SpecError, load_manifest, parse_spec
from ddm.operator.diagram import render_mermaid
from ddm.operator.render import render_file
from ddm.runtime.local import plan_local

ROOT = Path(__file__).resolve().parents[2]
POOLED_EXAMPLE = ROOT / "examples" / "text2img-pooled.yaml"


def _paris(experts: int = 8) -> dict[str, Any]:
    """A Paris-shaped text DDM: ``experts`` experts, text encoder, decoder and router network,
    all in one nvidia pool."""
    def checkpoint(name: str) -> dict[str, Any]:
        return {"uri": f"image:///opt/ddm/checkpoints/paris/{name}"}

    return {
        "conditioning": "text",
        "sampling": {"strategy": "top2", "guidanceScale": 7.5},
        "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}, "maxBatch": 64}],
        "textEncoder": {"checkpoint": checkpoint("clip"), "pool": "gpu"},
        "decoder": {"checkpoint": checkpoint("vae"), "pool": "gpu"},
        "router": {"checkpoint": checkpoint("router"), "network": {"pool": "gpu"}},
        "experts": [{"name": f"expert-{i}", "checkpoint": checkpoint(f"expert_{i}"),
                     "pool": "gpu"} for i in range(experts)],
    }


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    return list(caught.value.problems)


def _document(raw: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": spec.API_VERSION, "kind": spec.KIND, "metadata": {"name": "paris"},
            "spec": raw}


def test_a_pool_holds_experts_and_stages_and_mixes_with_unpooled_ones() -> None:
    raw = _paris()
    raw["experts"][7] = {"name": "expert-7", "checkpoint": {"uri": "image:///e7"},
                         "accelerator": {"type": "neuron"}}  # alone, on Trainium
    parsed = parse_spec(raw)
    assert list(parsed.members("gpu")) == [
        *(f"expert-{i}" for i in range(7)), "text-encoder", "decoder", "router-network"]
    assert parsed.experts[7].pool is None and parsed.experts[7].accelerator.type == "neuron"
    plan = plan_deployment(parsed)
    assert [e.name for e in plan.unpooled_experts] == ["expert-7"]
    (pool,) = plan.pools
    assert (pool.backend, pool.device, pool.replicas) == ("torch", "cuda", 1)


def test_the_pool_command_is_the_pool_servers_interface() -> None:
    raw = _paris(experts=2)
    raw["textEncoder"]["precision"] = raw["decoder"]["precision"] = "bfloat16"
    raw["router"]["network"]["precision"] = "bfloat16"
    for expert in raw["experts"]:
        expert["precision"] = "bfloat16"
    raw["pools"][0]["maxDelayMs"] = 5
    (pool,) = plan_deployment(parse_spec(raw)).pools
    dirs = {name: f"/models/{name}" for name, _ in pool.members}
    assert pool.command(dirs, "0.0.0.0", 8000, 9090, "/token") == (
        "serve", "pool",
        "--member", "expert-0=/models/expert-0", "--member", "expert-1=/models/expert-1",
        "--member", "text-encoder=/models/text-encoder", "--member", "decoder=/models/decoder",
        "--member", "router-network=/models/router-network",
        "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "9090",
        "--auth-token-file", "/token", "--backend", "torch", "--device", "cuda",
        "--precision", "bfloat16", "--max-batch", "64", "--max-delay-ms", "5")


def test_render_of_a_paris_shaped_pool_requests_one_gpu_in_the_whole_output(
        tmp_path: Path) -> None:
    path = tmp_path / "paris.yaml"
    path.write_text(yaml.safe_dump(_document(_paris())))
    text = render_file(path, {})
    assert text.count("nvidia.com/gpu: '1'") == 1, text
    objects = [o for o in yaml.safe_load_all(text) if o is not None]
    deployments = [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"]
    assert deployments == ["paris-pool-gpu", "paris-router"]
    (pool,) = [o for o in objects if o["metadata"]["name"] == "paris-pool-gpu"
               and o["kind"] == "Deployment"]
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    assert container["command"][1:3] == ["serve", "pool"]
    assert container["command"].count("--member") == 11
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    router = yaml.safe_load(config["data"]["router.yaml"])
    dns = "paris-pool-gpu.default.svc.cluster.local"
    assert [e["discovery"] for e in router["experts"]] == [
        {"dns": dns, "port": limits.EXPERT_PORT, "member": f"expert-{i}"} for i in range(8)]
    for key, name in (("text_encoder", "text-encoder"), ("decoder", "decoder"),
                      ("router_network", "router-network")):
        assert router[key] == {"dns": dns, "port": limits.EXPERT_PORT, "member": name}


def test_the_pooled_text2img_example_runs_one_model_process_that_serves_every_member() -> None:
    manifest = load_manifest(POOLED_EXAMPLE)
    plan = plan_local(manifest, itertools.count(20000).__next__, 8080,
                      locate=lambda source: Path("/fetched") / source.path.strip("/"))
    (server,) = plan.servers
    assert server.argv[server.argv.index("serve"):][:2] == ("serve", "pool")
    members = [server.argv[i + 1].partition("=")[0] for i, arg in enumerate(server.argv)
               if arg == "--member"]
    assert members == ["expert-0", "expert-1", "expert-2", "expert-3", "text-encoder",
                       "decoder", "router-network"]
    endpoint = (f"127.0.0.1:{server.port}",)
    config = plan.router_config
    assert [e.discovery for e in config.experts] == [
        StaticDiscovery(endpoint, member=f"expert-{i}") for i in range(4)]
    assert config.text_encoder.discovery == StaticDiscovery(endpoint, member="text-encoder")
    assert config.decoder.discovery == StaticDiscovery(endpoint, member="decoder")
    assert config.router_network.discovery == StaticDiscovery(endpoint, member="router-network")
    assert config.router_network.checkpoint is None  # in the pool, not in the router
    # The same DDM as the unpooled example, but for its placement.
    unpooled = load_manifest(ROOT / "examples" / "text2img.yaml").spec
    assert manifest.spec.sampling == unpooled.sampling
    assert [e.checkpoint for e in manifest.spec.experts] == [
        e.checkpoint for e in unpooled.experts]


def test_the_diagram_shows_a_pool_as_one_box_naming_its_members() -> None:
    text = render_mermaid(load_manifest(POOLED_EXAMPLE).spec, "text2img-pooled")
    assert ('pool_models["pool models<br/>expert-0, expert-1, expert-2, expert-3, text '
            'encoder, decoder, router network<br/>1 replica on CPU"]') in text
    assert "expert0" not in text and "stage_" not in text
    assert "router --> pool_models" in text


@pytest.mark.parametrize("key, value", [
    ("accelerator", {"type": "nvidia"}), ("replicas", 2), ("resources", {}),
    ("image", "reg/ddm:1"), ("nodeSelector", {}), ("tolerations", []), ("affinity", {}),
    ("maxBatch", 8), ("maxDelayMs", 1),
    ("autoscaling", {"minReplicas": 1, "maxReplicas": 2})])
def test_a_pooled_expert_carries_no_placement_of_its_own(key: str, value: Any) -> None:
    raw = _paris(experts=2)
    raw["experts"][1][key] = value
    assert (f"spec.experts[1].{key}: the component is in pool 'gpu', which places it "
            f"(spec.pools): give {key} there, not here") in _problems(raw)


@pytest.mark.parametrize("key, value", [("placement", "separate"), ("replicas", 2),
                                        ("accelerator", {"type": "cpu"}), ("image", "r/d:1")])
@pytest.mark.parametrize("stage", ["textEncoder", "decoder", "router.network"])
def test_a_pooled_stage_carries_no_placement_of_its_own(stage: str, key: str,
                                                        value: Any) -> None:
    raw = _paris(experts=2)
    where = raw["router"]["network"] if stage == "router.network" else raw[stage]
    where[key] = value
    assert any(p.startswith(f"spec.{stage}.{key}: the component is in pool 'gpu'")
               for p in _problems(raw)), _problems(raw)


def test_a_pooled_stage_s_placement_is_to_be_left_out_a_pool_has_none() -> None:
    raw = _paris(experts=2)
    raw["textEncoder"]["placement"] = "separate"
    assert _problems(raw) == [
        "spec.textEncoder.placement: the component is in pool 'gpu', which places it "
        "(spec.pools): leave it out: the pool's server serves it"]
    raw["textEncoder"].pop("placement")
    raw["pools"][0]["placement"] = "separate"  # what the advice must not have been
    assert _problems(raw) == ["spec.pools[0]: unknown fields ['placement']"]


def test_a_pool_name_that_cannot_be_one_says_what_one_is() -> None:
    raw = _paris(experts=2)
    raw["experts"][0]["pool"] = "Models_1"
    assert ("spec.experts[0].pool: 'Models_1' is not valid: a pool's name, a DNS-1123 label: "
            "lower-case letters, digits and '-'") in _problems(raw)


def test_an_unknown_pool_is_named() -> None:
    raw = _paris(experts=2)
    raw["experts"][0]["pool"] = "gpus"
    assert ("spec.experts[0].pool: no pool named 'gpus' in spec.pools (there are: 'gpu')"
            in _problems(raw))


def test_an_empty_pool_is_named() -> None:
    raw = _paris(experts=2)
    raw["pools"].append({"name": "spare", "accelerator": {"type": "nvidia"}})
    assert any(p.startswith("spec.pools[1]: pool 'spare' has no members")
               for p in _problems(raw))


def test_a_pool_name_twice_is_refused() -> None:
    raw = _paris(experts=2)
    raw["pools"].append(copy.deepcopy(raw["pools"][0]))
    assert "spec.pools: the name 'gpu' is used more than once" in _problems(raw)


def test_a_framework_the_pools_accelerator_cannot_run_is_named() -> None:
    raw = _paris(experts=2)
    raw["pools"][0]["accelerator"] = {"type": "neuron"}
    raw["experts"][0]["framework"] = "jax"
    problems = _problems(raw)
    assert ("spec.experts[0].framework: pool 'gpu' runs on neuron, which cannot run "
            "framework jax") in problems
    # torch on Neuron is the neuron backend, which serves no stage checkpoint yet
    assert any(p.startswith("spec.experts[1].pool: pool 'gpu' would serve it with the neuron "
                            "backend") for p in problems), problems


def test_a_pool_runs_one_backend_so_stages_need_torch_experts() -> None:
    raw = _paris(experts=2)
    for expert in raw["experts"]:
        expert["framework"] = "jax"
    assert ("spec.pools[0]: pool 'gpu' runs its members on one backend, but jax for "
            "spec.experts[0].framework, spec.experts[1].framework; torch for spec.textEncoder, "
            "spec.decoder, spec.router.network (give every member the same framework; a text "
            "encoder, decoder or router network runs on torch only)") in _problems(raw)
    # The odd one out comes first, named by the field to change: not the members that agree.
    raw["experts"][1]["framework"] = "torch"
    assert ("spec.pools[0]: pool 'gpu' runs its members on one backend, but jax for "
            "spec.experts[0].framework; torch for spec.experts[1].framework, spec.textEncoder, "
            "spec.decoder, spec.router.network (give every member the same framework; a text "
            "encoder, decoder or router network runs on torch only)") in _problems(raw)


def test_a_pools_members_share_one_precision() -> None:
    raw = _paris(experts=2)
    raw["decoder"]["precision"] = "bfloat16"
    assert ("spec.pools[0]: pool 'gpu' casts every member to one precision, but bfloat16 for "
            "spec.decoder.precision; as stored for spec.experts[0], spec.experts[1], "
            "spec.textEncoder, spec.router.network (give every member the same precision)"
            ) in _problems(raw)


def test_two_members_of_one_name_are_refused() -> None:
    raw = _paris(experts=2)
    raw["experts"][1]["name"] = "decoder"
    assert any(p.startswith("spec.pools[0]: pool 'gpu' has two members named 'decoder'")
               for p in _problems(raw))


def test_a_text_ddms_experts_batch_a_guided_row_so_their_max_batch_is_2_or_more() -> None:
    """A guided row runs as two forward rows (with its unconditional twin), and any request
    may ask for guidance: at maxBatch 1 every guided generation would be refused (422)."""
    raw = _paris(experts=2)
    raw["pools"][0]["maxBatch"] = 1
    assert _problems(raw) == [
        "spec.pools[0].maxBatch: 1 cannot hold a guided row, which runs as 2 forward rows "
        "(the row and its unconditional twin); a text DDM's experts need 2 or more"]
    raw["pools"][0]["maxBatch"] = 2
    parse_spec(raw)
    # An expert of its own, likewise; a pool of stages only, or of a label DDM, may take 1.
    raw["experts"][0] = {"name": "expert-0", "checkpoint": {"uri": "image:///e0"},
                         "maxBatch": 1}
    raw["pools"].append({"name": "stages", "maxBatch": 1})
    raw["decoder"]["pool"] = "stages"
    assert _problems(raw) == [
        "spec.experts[0].maxBatch: 1 cannot hold a guided row, which runs as 2 forward rows "
        "(the row and its unconditional twin); a text DDM's experts need 2 or more"]
    label = {"sampling": {"strategy": "oracle"}, "pools": [{"name": "cpu", "maxBatch": 1}],
             "experts": [{"name": "a", "checkpoint": {"uri": "image:///a"}, "classes": [0],
                          "pool": "cpu"}], "numClasses": 1}
    parse_spec(label)


def test_a_label_ddms_experts_join_a_pool() -> None:
    """The one model server holds label checkpoints too (issue 36)."""
    raw = {"sampling": {"strategy": "oracle"},
           "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}}],
           "experts": [{"name": "a", "checkpoint": {"uri": "image:///a"}, "classes": [0],
                        "pool": "gpu"}], "numClasses": 1}
    (pool,) = plan_deployment(parse_spec(raw)).pools
    assert [name for name, _ in pool.members] == ["a"]


def test_too_many_pools_are_refused() -> None:
    raw = _paris(experts=2)
    raw["pools"] = [{"name": f"p{i}"} for i in range(spec.MAX_POOLS + 1)]
    assert any(p.startswith(f"spec.pools: must list at most {spec.MAX_POOLS} pools")
               for p in _problems(raw))


def test_the_api_server_fills_in_nothing_a_pooled_component_may_not_set() -> None:
    # A default there would make every pooled component invalid once the API server stored it.
    for where in (crd.EXPERT, crd.SPEC.properties["textEncoder"]):
        for field in spec.POOL_PLACED_FIELDS:
            declared = where.properties.get(field)
            assert declared is None or declared.default is None, field
    assert set(pools.STAGE_FIELDS) == set(PLAN_NAMES.values())


def test_the_operator_gives_a_pools_pods_a_networkpolicy_the_router_reaches(
        tmp_path: Path) -> None:
    path = tmp_path / "paris.yaml"
    path.write_text(yaml.safe_dump(_document(_paris(experts=2))))
    objects = [o for o in yaml.safe_load_all(render_file(path, {})) if o is not None]
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}
    pools = policies["paris-pools"]["spec"]
    assert pools["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "pool"
    egress = policies["paris-router"]["spec"]["egress"]
    assert any(rule.get("to", [{}])[0].get("podSelector", {}).get("matchLabels", {}).get(
        "app.kubernetes.io/component") == "pool" for rule in egress), egress


def test_dns_discovery_of_a_member_round_trips_through_router_yaml() -> None:
    manifest = load_manifest(POOLED_EXAMPLE)
    config = plan_deployment(manifest.spec).router_config(
        {}, None, stage_places={"router-network": "/r"},
        pool_discovery={"models": DnsDiscovery("pool.example", 8000)})
    again = type(config).from_yaml(config.to_yaml())
    assert again.experts[2].discovery == DnsDiscovery("pool.example", 8000, "expert-2")
    assert again == config


def test_ddm_up_runs_a_process_per_pool_replica_behind_one_discovery() -> None:
    document = yaml.safe_load(POOLED_EXAMPLE.read_text())
    document["spec"]["pools"][0]["replicas"] = 2
    plan = plan_local(spec.parse_manifest(document, allow_host_paths=True),
                      itertools.count(20000).__next__, 8080,
                      locate=lambda source: Path("/fetched") / source.path.strip("/"))
    assert [p.name for p in plan.servers] == ["pool-models/0", "pool-models/1"]
    endpoints = tuple(f"127.0.0.1:{p.port}" for p in plan.servers)
    assert plan.router_config.experts[0].discovery == StaticDiscovery(endpoints, "expert-0")
