"""Pure builders: a validated spec and the owner's metadata -> the children's manifests.

No API calls and no kopf: the handlers add ownerReferences, hash and apply what these return.
Every pod meets the restricted Pod Security profile (non-root uid 10001, read-only root file
system, no privilege escalation, all capabilities dropped, RuntimeDefault seccomp, no host
namespaces or ports), with emptyDirs for the few places a server writes: /tmp, a cache
directory and, on Neuron, the compile cache. Volumes are emptyDir, configMap, secret and
persistentVolumeClaim, with one exception: a file:// checkpoint is a hostPath, which the
restricted profile forbids; the operator builds one only when its operator-wide setting
``DDM_ALLOW_HOST_PATHS`` lists a node directory above it (single-node and development
clusters; ``policy``).
A container that fails says why in its termination message (the server writes it; when it
could not, Kubernetes takes the end of its log), which the status reports.
``meta`` needs ``name`` and ``namespace`` (kopf's ``meta`` or a plain dict).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ddm.operator import names
from ddm.operator.access import (
    EXPERT_TOKEN_DIR,
    EXPERT_TOKEN_FILE,
    ROUTER_TOKEN_DIR,
    ROUTER_TOKEN_FILE,
    build_network_policies,
    expert_token,
    router_token,
)
from ddm.checkpoints.declared import PLAN_NAMES, ROUTER
from ddm.checkpoints.uri import (
    FETCHED_SCHEMES,
    STAGER_PORT,
    CheckpointMount,
    CheckpointSource,
    checkpoint_mount,
)
from ddm.deploy.accelerators import Accelerator
from ddm.deploy.limits import PULL_S
from ddm.deploy.plan import RouterPlan, plan_deployment, plan_expert, plan_pool, plan_stage
from ddm.deploy.pod_options import PodOptions
from ddm.deploy.router_config import Auth, Discovery, DnsDiscovery, RouterConfigFile
from ddm.deploy.spec import DDMSpec, ExpertSpec, FetchOptions, PoolSpec, RouterAuth, StageSpec
from ddm.operator.config import OperatorConfig
from ddm.operator.fetcher import (
    ROUTER_KEY,
    copy_step,
    expert_key,
    fetch_step,
    fetched,
    serve_step,
    stage_key,
    staged_key,
)
from ddm.operator.placement import placement

USER_ID = 10001
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID,
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
}
CACHE_DIR = "/var/cache/ddm"
ROUTER_CONFIG_DIR = "/etc/ddm"
ROUTER_CONFIG_FILE = "router.yaml"
EXPERT_CHECKPOINT_DIR = "/models/expert"
ROUTER_CHECKPOINT_DIR = "/models/router"
#: A separate stage's checkpoint in its own pod; a stage in the router's pod is under
#: ``/models/<role>`` there.
STAGE_CHECKPOINT_DIR = "/models/stage"
#: Where the stager's fetch steps leave each checkpoint (``fetcher.staged_key``).
STAGE_DIR = "/stage"
#: Kubernetes writes a failed container's reason into its status from this file, or from the
#: end of its log when the file is empty.
TERMINATION_MESSAGE = {"terminationMessagePath": "/dev/termination-log",
                       "terminationMessagePolicy": "FallbackToLogsOnError"}
#: The router container's resources when the spec sets none (``spec.router.resources``
#: replaces them whole). Measured with examples/digits.yaml: 264 MiB resident after start,
#: 284 MiB after generations of 60 images; the limit leaves room for ``max_concurrent``
#: generations and their bodies, and bounds what a flood of requests can take from the node.
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "384Mi"},
                    "limits": {"cpu": "2", "memory": "1Gi"}}
#: Seconds a terminating expert or router keeps serving (``--drain-s``) while Services and the
#: routers' DNS caches stop sending it traffic; with the servers' 20 s for requests in flight,
#: within the pods' default 30 s termination grace period.
DRAIN_S = 5
_PROBE_PERIOD_S = 10


def build_children(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                   ) -> list[dict[str, Any]]:
    """Every child the operator applies, in order: the NetworkPolicies (when on), the
    checkpoint stager (when the DDM fetches one), experts, the router's config, the router.
    Not the operator's Secrets, which it creates once and never applies
    (``children.desired_children`` has both). ``meta`` needs ``name``, ``namespace`` and
    ``uid`` (the Secrets' names derive from it)."""
    fetches = bool(fetched(spec))
    children: list[dict[str, Any]] = (
        build_network_policies(meta, config, fetches=fetches,
                               stages=any(s.separate for s in spec.stages.values()),
                               pools=bool(spec.pools))
        if config.network_policy else [])
    if fetches:
        children.append(build_stager_service(meta))
        children.append(build_stager_deployment(spec, meta, config))
    for expert in spec.experts:
        if expert.pool is None:
            children.append(build_expert_service(expert, meta))
            children.append(build_expert_deployment(expert, meta, config,
                                                    expert_token(spec, meta, config)))
    for role, stage in spec.stages.items():
        if stage.separate:
            children.append(build_stage_service(role, meta))
            children.append(build_stage_deployment(role, stage, meta, config,
                                                   expert_token(spec, meta, config)))
    for pool in spec.pools:
        children.append(build_pool_service(pool, meta))
        children.append(build_pool_deployment(spec, pool, meta, config,
                                              expert_token(spec, meta, config)))
    children.append(build_router_configmap(spec, meta, config))
    children.append(build_router_service(meta))
    children.append(build_router_deployment(spec, meta, config))
    return children


def build_expert_deployment(expert: ExpertSpec, meta: Mapping[str, Any], config: OperatorConfig,
                            token: RouterAuth | None = None) -> dict[str, Any]:
    """The expert's Deployment: one pod per replica on its accelerator, ready once loaded.

    With ``token`` (the router's expert token, ``access.expert_token``), the expert answers
    ``/v1/*`` only to callers that present it (the router does): no other pod can call the
    model around the router's authentication, and the expert never holds the public token."""
    owner = meta["name"]
    planned = plan_expert(expert)
    # An autoscaled expert's replicas are the scaler's (ddm.operator.scaler): left out here,
    # so that applying this manifest never resets them.
    replicas = None if expert.autoscaling is not None else expert.replicas
    return _model_server(
        names.expert_name(owner, expert.name), "expert", meta, config, replicas,
        names.labels(owner, "expert", expert.name), names.selector(owner, "expert", expert.name),
        accelerator=expert.accelerator, pod=expert.pod, ready_s=planned.ready_s,
        checkpoints=[_Checkpoint(expert.checkpoint, expert.fetch, expert_key(expert.name),
                                 EXPERT_CHECKPOINT_DIR)],
        command=lambda paths, token_file: planned.command(
            paths[0], names.POD_HOST, names.EXPERT_PORT, names.METRICS_PORT, token_file),
        token=token)


def build_stage_deployment(role: str, stage: StageSpec, meta: Mapping[str, Any],
                           config: OperatorConfig, token: RouterAuth | None = None
                           ) -> dict[str, Any]:
    """A separate stage's Deployment (``ddm serve stage``): as an expert's, on its own
    accelerator, answering only the router (``token``: the router's expert token)."""
    owner = meta["name"]
    planned = plan_stage(role, stage)
    return _model_server(
        names.stage_name(owner, role), "stage", meta, config, stage.replicas,
        names.labels(owner, "stage", stage=role), names.selector(owner, "stage", stage=role),
        accelerator=stage.accelerator, pod=stage.pod, ready_s=planned.ready_s,
        checkpoints=[_Checkpoint(stage.checkpoint, stage.fetch, _stage_key(role),
                                 STAGE_CHECKPOINT_DIR)],
        command=lambda paths, token_file: planned.command(
            paths[0], names.POD_HOST, names.EXPERT_PORT, names.METRICS_PORT, token_file),
        token=token)


def build_pool_deployment(spec: DDMSpec, pool: PoolSpec, meta: Mapping[str, Any],
                          config: OperatorConfig, token: RouterAuth | None = None
                          ) -> dict[str, Any]:
    """A pool's Deployment (``ddm serve pool``): one pod per replica on the pool's
    accelerator (requested once per pod, whatever its members), each member's checkpoint
    under ``/models/<member>``; it answers only the router (``token``), as an expert does."""
    owner = meta["name"]
    planned = plan_pool(spec, pool)
    members = spec.members(pool.name)
    checkpoints = [_Checkpoint(member.checkpoint, member.fetch,
                               expert_key(name) if isinstance(member, ExpertSpec)
                               else _stage_key(name), f"/models/{name}", f"checkpoint-{name}")
                   for name, member in members.items()]
    return _model_server(
        names.pool_name(owner, pool.name), "pool", meta, config,
        None if pool.autoscaling is not None else pool.replicas,  # autoscaled: the scaler's
        names.labels(owner, "pool", pool=pool.name),
        names.selector(owner, "pool", pool=pool.name),
        accelerator=pool.accelerator, pod=pool.pod, ready_s=planned.ready_s,
        checkpoints=checkpoints,
        command=lambda paths, token_file: planned.command(
            dict(zip(members, paths)), names.POD_HOST, names.EXPERT_PORT, names.METRICS_PORT,
            token_file), token=token)


def build_pool_service(pool: PoolSpec, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A headless Service: its DNS name resolves to every ready replica of the pool."""
    owner = meta["name"]
    return _service(names.pool_name(owner, pool.name), meta,
                    names.labels(owner, "pool", pool=pool.name),
                    names.selector(owner, "pool", pool=pool.name), names.EXPERT_PORT,
                    headless=True)


def _stage_key(role: str) -> str:
    """The fetch key of a stage's checkpoint (the router network's is the router's)."""
    return ROUTER_KEY if role == PLAN_NAMES[ROUTER] else stage_key(role)


def build_stage_service(role: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A headless Service: its DNS name resolves to every ready replica of the stage."""
    owner = meta["name"]
    return _service(names.stage_name(owner, role), meta, names.labels(owner, "stage", stage=role),
                    names.selector(owner, "stage", stage=role), names.EXPERT_PORT, headless=True)


@dataclass(frozen=True)
class _Checkpoint:
    """One checkpoint a model server's pod gets: its fetch ``key`` (``fetcher``), where it is
    mounted and under which volume name."""

    source: CheckpointSource
    fetch: FetchOptions
    key: str
    mount_path: str
    volume: str = "checkpoint"


def _model_server(name: str, container_name: str, meta: Mapping[str, Any],
                  config: OperatorConfig, replicas: int | None, labels: dict[str, str],
                  selector: dict[str, str], *, accelerator: Accelerator, pod: PodOptions,
                  ready_s: int, checkpoints: list[_Checkpoint],
                  command: Callable[[list[str], str | None], tuple[str, ...]],
                  token: RouterAuth | None
                  ) -> dict[str, Any]:
    """The Deployment of a model server (an expert, a stage or a pool): one pod per replica on
    its accelerator, ready once loaded, given ``ready_s`` to get there (``replicas`` None:
    left to the scaler);
    ``command(checkpoint_dirs, token_file)``: its arguments, given where each of
    ``checkpoints`` is in the pod."""
    place = placement(accelerator)
    image = pod.image or config.images.for_family(place.image_family)
    models = [_checkpoint(c.source, c.fetch, c.mount_path, image, config, meta, c.key,
                           volume=c.volume) for c in checkpoints]
    arguments = ["ddm", *command([m.path for m in models],
                                 EXPERT_TOKEN_FILE if token is not None else None),
                 "--drain-s", str(DRAIN_S)]
    scratch_env, volumes, mounts = _scratch()
    if token is not None:
        _mount_token(token, "expert-token", EXPERT_TOKEN_DIR, volumes, mounts)
    cache = accelerator.declared.cache
    if cache is not None:  # e.g. the Neuron backend's compile caches
        scratch_env += [{"name": n, "value": value}
                        for n, value in cache.environment(cache.directory)]
        volumes.append({"name": cache.volume, "emptyDir": {}})
        mounts.append({"name": cache.volume, "mountPath": cache.directory})
    resources = container_resources(pod, place.limits)
    container = {
        "name": container_name,
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": arguments,
        "ports": _ports(names.EXPERT_PORT),
        "env": scratch_env,
        **({"resources": resources} if resources else {}),
        "volumeMounts": mounts + [m for mount in models for m in mount.mounts],
        **_probes(ready_s),
        **TERMINATION_MESSAGE,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    pod_spec = build_pod_spec(container, pod,
                              volumes + [v for mount in models for v in mount.volumes],
                              [c for mount in models for c in mount.init_containers],
                              node_selector=place.node_selector, tolerations=place.tolerations)
    # A replica may take its ready budget to start: not "no progress" (Kubernetes' 600 s).
    return _deployment(name, meta, replicas, labels, selector, pod_spec,
                       {**names.SCRAPE_ANNOTATIONS,
                        **_checkpoint_annotation(*(c.source for c in checkpoints))},
                       strategy=update_strategy(place.limits),
                       progress_deadline_s=PULL_S + ready_s)


def update_strategy(device_limits: Mapping[str, str]) -> dict[str, Any] | None:
    """How a model server's Deployment replaces its pods when its spec changes (None:
    Kubernetes' default).

    A pod that holds a device (``device_limits``) is replaced one at a time, the old pod
    first: a new one made beside it (the default's surge) would wait for a device that a DDM
    on as few accelerators as its weights need never has spare, and the update would never
    happen. Meanwhile the router treats the missing replicas by the DDM's missing-expert
    policy. A CPU pod keeps the default (a quarter of the replicas more, a quarter fewer,
    rounded: one new replica ready before an old one goes, for one or two)."""
    if not device_limits:
        return None
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def _mount_token(token: RouterAuth, volume: str, directory: str,
                 volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    """The token's Secret key as the file ``token`` in ``directory``, read-only."""
    volumes.append({"name": volume, "secret": {
        "secretName": token.secret_name, "defaultMode": 0o440,
        "items": [{"key": token.key, "path": "token"}]}})
    mounts.append({"name": volume, "mountPath": directory, "readOnly": True})


def build_expert_service(expert: ExpertSpec, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A headless Service: its DNS name resolves to every ready replica, for the router."""
    owner = meta["name"]
    return _service(names.expert_name(owner, expert.name), meta,
                    names.labels(owner, "expert", expert.name),
                    names.selector(owner, "expert", expert.name), names.EXPERT_PORT,
                    headless=True)


def build_router_config(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                        ) -> RouterConfigFile:
    """router.yaml (the plan's): the experts behind their headless Services, the operator's
    trusted proxies (the cluster's ingress) naming the clients of its per-client limit, and
    its strategies (``DDM_ALLOWED_STRATEGIES``: the only ones the router serves)."""
    owner, namespace = meta["name"], meta["namespace"]
    discovery: dict[str, Discovery] = {
        e.name: DnsDiscovery(dns=names.expert_dns(owner, e.name, namespace,
                                                  config.cluster_domain),
                             port=names.EXPERT_PORT)
        for e in spec.experts if e.pool is None}
    places: dict[str, str | Discovery] = {
        role: DnsDiscovery(dns=names.stage_dns(owner, role, namespace, config.cluster_domain),
                           port=names.EXPERT_PORT)
        for role, stage in spec.stages.items() if stage.separate}
    places.update({role: _pod_dir(*place) for role, place in _router_stages(spec).items()})
    pools: dict[str, Discovery] = {
        p.name: DnsDiscovery(dns=names.pool_dns(owner, p.name, namespace,
                                                config.cluster_domain), port=names.EXPERT_PORT)
        for p in spec.pools}
    made = plan_deployment(spec).router_config(
        discovery, None, Auth(token_file=ROUTER_TOKEN_FILE, expert_token_file=EXPERT_TOKEN_FILE)
        if router_token(spec, meta, config) else None,
        config.router_trusted_proxies, places, pools)
    # The operator's strategies (ddm.operator.policy has checked the spec's own is one).
    return dataclasses.replace(made, sampling=dataclasses.replace(
        made.sampling, strategies=config.allowed.strategies))


def _router_stages(spec: DDMSpec) -> dict[str, tuple[StageSpec, str]]:
    """Role -> (stage, its mount path) of every stage the router's pods load themselves."""
    return {role: (stage, ROUTER_CHECKPOINT_DIR if role == PLAN_NAMES[ROUTER]
                   else f"/models/{role}")
            for role, stage in spec.stages.items() if stage.in_router}


def _pod_dir(stage: StageSpec, mount_path: str) -> str:
    """Where a pod finds the stage's checkpoint: in its image, or where it is mounted."""
    return stage.checkpoint.path if stage.checkpoint.scheme == "image" else mount_path


def build_router_configmap(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                           ) -> dict[str, Any]:
    owner = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(names.router_config_name(owner), meta,
                              names.labels(owner, "router")),
        "data": {ROUTER_CONFIG_FILE: build_router_config(spec, meta, config).to_yaml()},
    }


def build_router_deployment(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                            ) -> dict[str, Any]:
    """The router's Deployment; its pods roll whenever router.yaml changes."""
    owner = meta["name"]
    router = spec.router
    image = router.pod.image or config.images.cpu
    checkpoints = [
        _checkpoint(stage.checkpoint, stage.fetch, path, image, config, meta, _stage_key(role),
                    volume="checkpoint" if role == PLAN_NAMES[ROUTER] else f"checkpoint-{role}")
        for role, (stage, path) in _router_stages(spec).items()]
    env, volumes, mounts = _scratch()
    volumes.append({"name": "config", "configMap": {"name": names.router_config_name(owner)}})
    mounts.append({"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True})
    token, experts_token = router_token(spec, meta, config), expert_token(spec, meta, config)
    if token is not None and experts_token is not None:
        _mount_token(token, "router-token", ROUTER_TOKEN_DIR, volumes, mounts)
        _mount_token(experts_token, "expert-token", EXPERT_TOKEN_DIR, volumes, mounts)
    resources = (container_resources(router.pod, {}) if router.pod.resources
                 else copy.deepcopy(ROUTER_RESOURCES))
    container = {
        "name": "router",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["ddm", *RouterPlan.command(f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
                                               names.POD_HOST, names.ROUTER_PORT,
                                               names.METRICS_PORT),
                    "--drain-s", str(DRAIN_S)],
        "ports": _ports(names.ROUTER_PORT),
        "env": env,
        **({"resources": resources} if resources else {}),
        "volumeMounts": mounts + [m for mount in checkpoints for m in mount.mounts],
        **_probes(plan_deployment(spec).router.ready_s),
        **TERMINATION_MESSAGE,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    pod = build_pod_spec(container, router.pod,
                         volumes + [v for mount in checkpoints for v in mount.volumes],
                         [c for mount in checkpoints for c in mount.init_containers],
                         node_selector={}, tolerations=[])
    config_text = build_router_config(spec, meta, config).to_yaml()
    pod_annotations = {**names.SCRAPE_ANNOTATIONS,
                       names.CONFIG_HASH_ANNOTATION: names.digest(config_text),
                       **_checkpoint_annotation(*(stage.checkpoint for stage, _ in
                                                  _router_stages(spec).values()))}
    return _deployment(names.router_name(owner), meta, router.replicas,
                       names.labels(owner, "router"), names.selector(owner, "router"), pod,
                       pod_annotations)


def build_router_service(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The router's stable address (a ClusterIP Service): ``names.router_url``."""
    owner = meta["name"]
    return _service(names.router_name(owner), meta, names.labels(owner, "router"),
                    names.selector(owner, "router"), names.ROUTER_PORT, headless=False)


def with_spec_hash(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` annotated with the hash of everything else in it."""
    out = copy.deepcopy(dict(manifest))
    out["metadata"].setdefault("annotations", {}).pop(names.SPEC_HASH_ANNOTATION, None)
    out["metadata"]["annotations"][names.SPEC_HASH_ANNOTATION] = names.digest(
        json.dumps(out, sort_keys=True, separators=(",", ":")))
    return out


def _metadata(name: str, meta: Mapping[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": meta["namespace"], "labels": labels}


def _ports(api_port: int) -> list[dict[str, Any]]:
    """A server's named ports: ``http`` (its API and probes) and ``metrics`` (``/metrics``
    alone, which a NetworkPolicy opens to scrapers without opening the API)."""
    return [{"name": "http", "containerPort": api_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"}]


def _scratch() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volumes, mounts) for the writable directories every server needs."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR}]
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return env, volumes, mounts


def build_stager_deployment(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                            ) -> dict[str, Any]:
    """The checkpoint stager: one fetch step per fetched checkpoint (``fetcher.fetch_step``)
    into its emptyDir, then ``ddm serve-checkpoints`` hands them to the DDM's pods. The only
    pod of the DDM whose NetworkPolicy reaches the stores; it runs our code only, in the
    operator's own image, and never loads a model."""
    owner = meta["name"]
    steps = fetched(spec)
    base = _fetcher(config.images.cpu, config)
    staged_bytes = config.fetch_max_bytes * len(steps)
    volumes = [{"name": "tmp", "emptyDir": {}},
               {"name": "stage", "emptyDir": {"sizeLimit": str(staged_bytes)}}]
    init_containers = []
    for key, checkpoint, options in steps:
        step, more = fetch_step(
            checkpoint, options, meta=meta, key=key,
            dest=f"{STAGE_DIR}/{staged_key(key, checkpoint)}",
            base={**base, "volumeMounts": [*base["volumeMounts"],
                                           {"name": "stage", "mountPath": STAGE_DIR}]},
            allow_networks=config.fetch_allow_networks, max_bytes=config.fetch_max_bytes)
        init_containers.append(step)
        volumes += more
    server = serve_step(STAGE_DIR, {**base, "volumeMounts": [
        *base["volumeMounts"], {"name": "stage", "mountPath": STAGE_DIR, "readOnly": True}]},
        staged_bytes)
    pod = build_pod_spec(server, PodOptions(), volumes, init_containers, node_selector={},
                         tolerations=[])
    digests = {names.CHECKPOINT_HASH_ANNOTATION: names.digest(",".join(
        staged_key(key, checkpoint) for key, checkpoint, _ in steps))}
    return _deployment(names.stager_name(owner), meta, 1, names.labels(owner, "stager"),
                       names.selector(owner, "stager"), pod, digests)


def build_stager_service(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The stager's name (``names.stager_host``), the one the serving pods copy from."""
    owner = meta["name"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(names.stager_name(owner), meta, names.labels(owner, "stager")),
            "spec": {"selector": names.selector(owner, "stager"),
                     "ports": [{"name": "http", "port": STAGER_PORT, "targetPort": "http",
                                "protocol": "TCP"}]}}


def _fetcher(image: str, config: OperatorConfig) -> dict[str, Any]:
    """A fetch or copy step's container, less its name, command and checkpoint volume."""
    return {
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        **TERMINATION_MESSAGE,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }


def _checkpoint(checkpoint: CheckpointSource, options: FetchOptions, mount_path: str,
                image: str, config: OperatorConfig, meta: Mapping[str, Any], key: str,
                volume: str = "checkpoint") -> CheckpointMount:
    """How the pod gets its checkpoint; a fetched one is copied from the DDM's stager
    (``fetcher.copy_step``), into an emptyDir of the fetch's cap."""
    if checkpoint.scheme not in FETCHED_SCHEMES:
        return checkpoint_mount(checkpoint, volume=volume, mount_path=mount_path)
    fetcher = _fetcher(image, config)
    fetcher["volumeMounts"].append({"name": volume, "mountPath": mount_path})
    copy_container = copy_step(
        checkpoint, options, key=key, owner=meta["name"], namespace=meta["namespace"],
        cluster_domain=config.cluster_domain, dest=mount_path, base=fetcher,
        max_bytes=config.fetch_max_bytes)
    if volume != "checkpoint":  # a second copy into the same pod (the router's stages)
        copy_container["name"] = f"copy-{volume}"
    return CheckpointMount(
        path=mount_path,
        volumes=[{"name": volume, "emptyDir": {"sizeLimit": str(config.fetch_max_bytes)}}],
        mounts=[{"name": volume, "mountPath": mount_path, "readOnly": True}],
        init_containers=[copy_container])


def _checkpoint_annotation(*checkpoints: CheckpointSource) -> dict[str, str]:
    """The pod template's hash of its fetched URIs (the URIs themselves are in Secrets)."""
    uris = [c.uri for c in checkpoints if c.scheme in FETCHED_SCHEMES]
    if not uris:
        return {}
    return {names.CHECKPOINT_HASH_ANNOTATION: names.digest(",".join(uris))}


def container_resources(pod: PodOptions, accelerator_limits: dict[str, str]) -> dict[str, Any]:
    """The user's resources with the accelerator's limits added (requests follow limits).

    Quantities become strings (``cpu: 2`` -> ``"2"``): server-side apply wants strings.
    """
    resources = {kind: {name: str(amount) for name, amount in amounts.items()}
                 for kind, amounts in (pod.resources or {}).items()}
    if accelerator_limits:
        resources["limits"] = {**resources.get("limits", {}), **accelerator_limits}
    return resources


def _probes(startup_budget_s: int) -> dict[str, Any]:
    """Ready only once the model is loaded (/readyz); restarted if the process hangs (/healthz).

    The startup probe gives a load or compile ``startup_budget_s`` before liveness applies.
    """
    def get(path: str, period_s: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s,
                "timeoutSeconds": 5, "failureThreshold": failures}

    return {
        "startupProbe": get("/readyz", _PROBE_PERIOD_S,
                            -(-startup_budget_s // _PROBE_PERIOD_S)),  # rounded up
        "readinessProbe": get("/readyz", 5, 2),
        "livenessProbe": get("/healthz", _PROBE_PERIOD_S, 3),
    }


def build_pod_spec(container: dict[str, Any], options: PodOptions, volumes: list[dict[str, Any]],
                   init_containers: list[dict[str, Any]], *, node_selector: dict[str, str],
                   tolerations: list[dict[str, str]]) -> dict[str, Any]:
    """The pod: the user's placement passes through (the spec's checks leave no clash with the
    accelerator's selectors). Every ``$`` in a command is doubled: Kubernetes would expand
    ``$(VAR)`` in a URI or path, and nothing the operator passes is meant to be expanded."""
    selector = {**(options.node_selector or {}), **node_selector}
    extra = [dict(t) for t in options.tolerations if dict(t) not in tolerations]
    init_containers = [literal_command(c) for c in init_containers]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # servers never call the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [literal_command(container)],
        "volumes": volumes,
    }
    if selector:
        pod["nodeSelector"] = selector
    if tolerations or extra:
        pod["tolerations"] = copy.deepcopy(tolerations) + copy.deepcopy(extra)
    if options.affinity:
        pod["affinity"] = copy.deepcopy(dict(options.affinity))
    return pod


def literal_command(container: dict[str, Any]) -> dict[str, Any]:
    """``container`` with every ``$`` in its command doubled, so that Kubernetes expands no
    ``$(VAR)`` in it."""
    return {**container, "command": [arg.replace("$", "$$") for arg in container["command"]]}


def _deployment(name: str, meta: Mapping[str, Any], replicas: int | None,
                labels: dict[str, str],
                selector: dict[str, str], pod: dict[str, Any],
                pod_annotations: dict[str, str] | None = None,
                strategy: dict[str, Any] | None = None,
                progress_deadline_s: int | None = None) -> dict[str, Any]:
    template_meta: dict[str, Any] = {"labels": dict(labels)}
    if pod_annotations:
        template_meta["annotations"] = pod_annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, meta, labels),
        "spec": {
            **({"replicas": replicas} if replicas is not None else {}),
            **({"strategy": strategy} if strategy is not None else {}),
            **({"progressDeadlineSeconds": progress_deadline_s}
               if progress_deadline_s is not None else {}),
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            "template": {"metadata": template_meta, "spec": pod},
        },
    }


def _service(name: str, meta: Mapping[str, Any], labels: dict[str, str],
             selector: dict[str, str], port: int, *, headless: bool) -> dict[str, Any]:
    # ``metrics`` as well, so that a Prometheus Operator ServiceMonitor (which selects Services
    # and names a port) finds it; the NetworkPolicy still admits only the configured scrapers.
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"},
                  {"name": "metrics", "port": names.METRICS_PORT, "targetPort": "metrics",
                   "protocol": "TCP"}],
    }
    if headless:
        # Only ready pods get DNS records: the router never sends work to a loading expert.
        spec.update(clusterIP="None", publishNotReadyAddresses=False)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(name, meta, labels), "spec": spec}
