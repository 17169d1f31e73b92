"""One deployment plan, two consumers: the operator's manifests and ``ddm up``'s processes run
the same expert commands and give the router the same configuration and limits, for every
shipped example and for generated specs across every accelerator, framework and limit."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddm.checkpoints.uri import CheckpointSource
from ddm.deploy import limits
from ddm.deploy.accelerators import ACCELERATORS
from ddm.deploy.plan import COMPILE_READY_S, MEMBER_READY_S, plan_deployment
from ddm.deploy.router_config import RouterConfigFile
from ddm.deploy.spec import DDMManifest, load_manifest, parse_manifest
from ddm.operator.config import Images, OperatorConfig
from ddm.operator.manifests import ROUTER_CONFIG_FILE, build_children
from ddm.operator.names import POOL_LABEL, STAGE_LABEL
from ddm.operator.policy import AllowLists
from ddm.runtime.local import LocalRunError, plan_local
from tests.support.examples import deployment_examples

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = deployment_examples()
CONFIG = OperatorConfig(images=Images({"cpu": "reg/ddm:1", "cuda": "reg/ddm-cuda:1",
                                       "neuron": "reg/ddm-neuron:1", "tpu": "reg/ddm-tpu:1"}),
                        allowed=AllowLists(host_paths=("/",)))
#: Options each consumer sets for its place, not from the spec (each takes a value).
PLACE_OPTIONS = ("--checkpoint", "--host", "--port", "--metrics-port", "--config", "--drain-s",
                 "--log-level", "--auth-token-file")
STEPS = (1, 2, limits.DEFAULT_STEPS, limits.ROUTER_MAX_STEPS, limits.ROUTER_MAX_STEPS + 1, 300,
         limits.MAX_STEPS)
URIS = ("image:///opt/ddm/checkpoints/{name}", "pvc://models/{name}",
        "s3://bucket/{name}", "https://models.example.com/{name}.tar.gz", "file:///srv/{name}")
COUNTS = {"neuron": 2, "nvidia": 1, "tpu": 4, "cpu": 0}
#: Every (accelerator type, framework) the registry can run.
BACKEND_PAIRS = {(name, framework) for name, declared in ACCELERATORS.items()
                 for framework in declared.backends}


def _generated(seed: int) -> dict[str, Any]:
    """A valid DDMDeployment document drawn from ``seed``."""
    rng = random.Random(seed)
    pairs = sorted(BACKEND_PAIRS)
    num_experts = rng.randint(1, 4)
    num_classes = rng.choice((num_experts, 10))
    strategy = rng.choice(("oracle", "top1", f"top{num_experts}", f"topk:{num_experts}",
                           "threshold:0.25", "ensemble"))
    labels = list(range(num_classes))
    experts = []
    for i in range(num_experts):
        kind, framework = rng.choice(pairs)
        expert: dict[str, Any] = {
            "name": f"e{i}", "framework": framework,
            "accelerator": {"type": kind, **({"count": COUNTS[kind]} if COUNTS[kind] else {})},
            "checkpoint": {"uri": rng.choice(URIS).format(name=f"e{i}")},
            "classes": labels[i::num_experts], "replicas": rng.randint(0, 3)}
        if rng.random() < 0.5:
            expert["maxBatch"] = rng.randint(1, limits.MAX_BATCH)
        if rng.random() < 0.5:
            expert["maxDelayMs"] = rng.randint(0, limits.MAX_DELAY_MS)
        experts.append(expert)
    spec: dict[str, Any] = {
        "numClasses": num_classes, "experts": experts,
        "sampling": {"steps": rng.choice(STEPS), "solver": rng.choice(limits.SOLVERS),
                     "strategy": strategy}}
    if strategy != "oracle":
        spec["router"] = {"checkpoint": {"uri": rng.choice(URIS).format(name="router")}}
    return {"apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment",
            "metadata": {"name": f"gen{seed}"}, "spec": spec}


MANIFESTS = ([pytest.param(load_manifest(path), id=path.name) for path in EXAMPLES]
             + [pytest.param(parse_manifest(_generated(seed), allow_host_paths=True),
                             id=f"generated-{seed}") for seed in range(40)])


def _spec_args(argv: tuple[str, ...] | list[str]) -> list[str]:
    """``argv`` after ``serve ROLE``, without the options that say where it runs."""
    args = list(argv)
    args = args[args.index("serve"):]
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in PLACE_OPTIONS:
            skip = True
        else:  # a pool's --member NAME=DIR: the name is the spec's, the directory the place's
            kept.append(arg.partition("=")[0])
    return kept


def _without_places(config: RouterConfigFile) -> dict[str, Any]:
    """router.yaml without what differs by place: expert addresses, file paths, auth."""
    out = config.to_dict()
    for expert in out["experts"]:
        del expert["discovery"]
    out.pop("auth", None)
    out["router_checkpoint"] = out["router_checkpoint"] is not None
    for stage in ("text_encoder", "decoder", "router_network"):  # remote, or loaded in-router
        if out.get(stage) is not None:
            out[stage] = "checkpoint" if "checkpoint" in out[stage] else "remote"
    return out


def _operator(manifest: DDMManifest) -> tuple[dict[str, list[str]], dict[str, set[str]],
                                               list[str], RouterConfigFile]:
    meta = {"name": manifest.name, "namespace": "ml", "uid": "1"}
    children = build_children(manifest.spec, meta, CONFIG)
    commands, env, stages = {}, {}, {}
    router_command: list[str] = []
    config = None
    for child in children:
        if child["kind"] == "Deployment":
            (container,) = child["spec"]["template"]["spec"]["containers"]
            if container["name"] == "stager":  # fetches for the servers, runs no model
                continue
            if container["name"] == "router":
                router_command = container["command"]
            elif STAGE_LABEL in child["metadata"]["labels"]:  # a stage's own server
                stages[child["metadata"]["labels"][STAGE_LABEL]] = container["command"]
            else:
                labels = child["metadata"]["labels"]
                name = (f"pool-{labels[POOL_LABEL]}" if POOL_LABEL in labels
                        else labels["ddm.dev/expert"])
                commands[name] = container["command"]
                env[name] = {e["name"] for e in container["env"]} - {"HOME", "XDG_CACHE_HOME"}
        elif child["kind"] == "ConfigMap":
            config = RouterConfigFile.from_yaml(child["data"][ROUTER_CONFIG_FILE])
    assert config is not None
    assert sorted(stages) == sorted(_local_stages(manifest))  # separate stages: the same
    return commands, env, router_command, config


def _local_stages(manifest: DDMManifest) -> list[str]:
    plan = plan_local(manifest, itertools.count(20000).__next__, 8080,
                      locate=lambda s: Path("/fetched"),
                      token_file=Path("/run/ddm-up/router-token"),
                      expert_token_file=Path("/run/ddm-up/expert-token"))
    return [process.name.split("/")[0] for process in plan.stages]


def _local(manifest: DDMManifest) -> tuple[dict[str, list[str]], dict[str, set[str]],
                                            list[str], RouterConfigFile]:
    ports = itertools.count(20000)

    def locate(source: CheckpointSource) -> Path:
        return Path("/fetched") / source.scheme / source.location / source.path.strip("/")

    plan = plan_local(manifest, lambda: next(ports), 8080, locate=locate,
                      token_file=Path("/run/ddm-up/router-token"),
                      expert_token_file=Path("/run/ddm-up/expert-token"))
    commands, env = {}, {}
    for process in (*plan.experts, *plan.pools):
        name = process.name.split("/")[0]
        commands[name] = list(process.argv)
        # What ddm up's place decides: threads on a shared machine, one log for every process.
        env[name] = {k for k, _ in process.env} - {"OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                     "PYTHONUNBUFFERED",
                                                     "HF_HUB_DISABLE_PROGRESS_BARS"}
    # What ddm up gives the router is what it reads back from the file it writes.
    config = RouterConfigFile.from_yaml(plan.router_config.to_yaml())
    return commands, env, list(plan.router.argv), config


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_the_operator_and_ddm_up_run_the_same_plan(manifest: DDMManifest) -> None:
    op_commands, op_env, op_router, op_config = _operator(manifest)
    local_commands, local_env, local_router, local_config = _local(manifest)
    names = [*(e.name for e in manifest.spec.experts if e.pool is None),
             *(f"pool-{p.name}" for p in manifest.spec.pools)]
    assert sorted(op_commands) == sorted(local_commands) == sorted(names)
    for name in names:
        assert _spec_args(op_commands[name]) == _spec_args(local_commands[name]), name
        assert op_env[name] == local_env[name], name
    assert _spec_args(op_router) == _spec_args(local_router) == ["serve", "router"]
    # Both serve /metrics apart from the API (on a port of its own).
    for argv in (op_router, local_router, *op_commands.values(), *local_commands.values()):
        assert argv.count("--metrics-port") == 1 and argv[argv.index("--metrics-port") + 1] \
            != argv[argv.index("--port") + 1]
    assert _without_places(op_config) == _without_places(local_config)
    assert [e.name for e in op_config.experts] == [e.name for e in manifest.spec.experts]
    # Every request at the DDM's own default step count is allowed, on both.
    steps = manifest.spec.sampling.steps
    assert op_config.limits.max_steps == local_config.limits.max_steps == max(
        limits.ROUTER_MAX_STEPS, steps)


def test_with_auth_both_give_the_experts_a_token_of_their_own() -> None:
    """A spec asking for a token: the router requires it, and every expert, on both, reads
    the token the router presents to experts (``auth.expert_token_file``: a Secret's mount in
    a pod, a file ddm up writes), never the public one."""
    document = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    for auth in (False, True):
        if auth:
            document["spec"]["router"]["auth"] = {}
        manifest = parse_manifest(document, allow_host_paths=True)
        for commands, _, _, config in (_operator(manifest), _local(manifest)):
            files = {_flag_value(c, "--auth-token-file") for c in commands.values()}
            assert files == ({config.auth.expert_token_file} if auth else {None}), (
                files, config.auth)
            if auth:
                assert config.auth.expert_token_file != config.auth.token_file
    with pytest.raises(LocalRunError, match=r"digits asks for a bearer token \(spec.router.auth\)"):
        plan_local(manifest, itertools.count(20000).__next__, 8080,
                   locate=lambda source: Path("/fetched"))


def _flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_each_expert_runs_the_backend_of_its_accelerator_and_framework(
        manifest: DDMManifest) -> None:
    for spec, planned in zip(manifest.spec.experts, plan_deployment(manifest.spec).experts):
        backend, device = ACCELERATORS[spec.accelerator.type].backends[spec.framework]
        expected = ["--backend", backend, *(["--device", device] if device else [])]
        assert list(planned.args[:len(expected)]) == expected
        assert "--device" not in planned.args[len(expected):]
        assert backend in limits.EXPERT_BACKENDS


def test_the_generated_specs_cover_every_backend_and_the_step_limits() -> None:
    manifests = [p.values[0] for p in MANIFESTS]
    pairs = {(e.accelerator.type, e.framework) for m in manifests for e in m.spec.experts}
    assert pairs == BACKEND_PAIRS
    steps = {m.spec.sampling.steps for m in manifests}
    assert {limits.ROUTER_MAX_STEPS + 1, limits.MAX_STEPS} <= steps


def test_a_manifest_with_300_steps_plans_a_router_that_allows_them(tmp_path: Path) -> None:
    document = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    document["spec"]["sampling"]["steps"] = 300
    plan = plan_local(parse_manifest(document, allow_host_paths=True), iter(range(30000, 30100))
                      .__next__, 8080, locate=lambda source: tmp_path)
    config = RouterConfigFile.from_yaml(plan.router_config.to_yaml())
    assert (config.sampling.steps, config.limits.max_steps) == (300, 300)


def test_the_plan_its_consumers_and_the_cli_import_no_ml_framework() -> None:
    code = ("import sys, ddm.deploy.plan, ddm.deploy.limits, ddm.operator.runner, "
            "ddm.operator.diagram, ddm.runtime.local, ddm.cli; "
            "print(sorted({'numpy', 'torch', 'jax', 'flax'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_ddm_up_hands_its_router_options_to_the_router_command() -> None:
    """`ddm up --api-docs --deadline-s 5`: the router process is started with both, as
    `ddm serve router` parses them."""
    from ddm.cli import build_parser
    from ddm.runtime.local import DEFAULT_MANIFEST, with_router_options

    plan = plan_local(load_manifest(DEFAULT_MANIFEST), itertools.count(20000).__next__, 8080,
                      locate=lambda source: Path("/fetched") / source.path.strip("/"))
    argv = with_router_options(plan, deadline_s=5.0, api_docs=True).router.argv
    assert argv[:3] == (sys.executable, "-m", "ddm")
    served = build_parser().parse_args(list(argv[3:]))
    assert (served.command, served.api_docs, served.deadline_s) == ("serve", True, 5.0)
    plain = build_parser().parse_args(list(with_router_options(plan).router.argv[3:]))
    assert (plain.api_docs, plain.deadline_s) == (False, None)


def _startup_budgets(manifest: DDMManifest) -> dict[str, int]:
    """What the operator gives each server to become ready: its start-up probe's period times
    its failures, by ddm up's name for the server (``pool-NAME``, a stage's role, ...)."""
    budgets = {}
    for child in build_children(manifest.spec, {"name": manifest.name, "namespace": "ml",
                                                "uid": "1"},
                                CONFIG):
        labels = child["metadata"]["labels"]
        component = labels.get("app.kubernetes.io/component")
        if child["kind"] != "Deployment" or component == "stager":
            continue
        name = {"pool": f"pool-{labels.get(POOL_LABEL)}", "stage": labels.get(STAGE_LABEL),
                "router": "router"}.get(component, labels.get("ddm.dev/expert"))
        (container,) = child["spec"]["template"]["spec"]["containers"]
        probe = container["startupProbe"]
        budgets[name] = probe["periodSeconds"] * probe["failureThreshold"]
    return budgets


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_the_operator_and_ddm_up_give_each_server_the_same_time_to_become_ready(
        manifest: DDMManifest) -> None:
    plan = plan_local(manifest, itertools.count(20000).__next__, 8080,
                      locate=lambda s: Path("/fetched"),
                      token_file=Path("/run/ddm-up/router-token"),
                      expert_token_file=Path("/run/ddm-up/expert-token"))
    local = {process.name.split("/")[0]: process.ready_s
             for process in (*plan.servers, plan.router)}
    assert local == _startup_budgets(manifest)


def _pooled_text2img(**pool: Any) -> DDMManifest:
    document = yaml.safe_load((ROOT / "examples" / "text2img-pooled.yaml").read_text())
    document["spec"]["pools"][0].update(pool)
    return parse_manifest(document)


def test_a_server_has_time_for_each_member_and_each_batch_size_it_compiles() -> None:
    """A pool loads its members one after the other, and compiles every batch size of each
    compiled one before it is ready: the time it may take grows with both, where a fixed
    budget had ``ddm up`` give up on (and a pod's probe restart) a start merely long."""
    cpu, nvidia = ACCELERATORS["cpu"].startup_budget_s, ACCELERATORS["nvidia"].startup_budget_s
    eager = plan_deployment(_pooled_text2img().spec)
    (pool,) = eager.pools
    assert len(pool.members) == 7  # four experts, text encoder, decoder, router network
    assert pool.ready_s == cpu + 6 * MEMBER_READY_S
    on_gpu = _pooled_text2img(compile="reduce-overhead", maxBatch=16,
                              accelerator={"type": "nvidia"}, resources={})
    # The experts and the router network compile, at batch sizes 1, 2, 4, 8, 12 and 16; the
    # text encoder and decoder run once per generation, eagerly.
    budget = nvidia + 6 * MEMBER_READY_S + 5 * 6 * COMPILE_READY_S
    assert plan_deployment(on_gpu.spec).pools[0].ready_s == budget
    assert _startup_budgets(on_gpu)["pool-models"] == budget


def test_a_cold_start_counts_as_demand_for_as_long_as_the_server_may_take() -> None:
    """Both scalers keep what they started from zero while it starts (its scale-down delay
    runs from when it can serve): for its own ready budget, a compiling pool's included, not
    a fixed ten minutes that would stop it half way through compiling."""
    manifest = _pooled_text2img(compile="default", maxBatch=16, autoscaling={
        "minReplicas": 1, "maxReplicas": 3, "target": {"rowsPerSecond": 10}})
    plan = plan_deployment(manifest.spec)
    (unit,) = plan.autoscaled
    cpu = ACCELERATORS["cpu"].startup_budget_s
    assert unit.pool and unit.ready_s == cpu + 6 * MEMBER_READY_S + 5 * 6 * COMPILE_READY_S
