"""Pure builders: a DDMTraining's plan -> its jobs, as batch/v1 Jobs or Kubeflow Trainer v2
TrainJobs (the two engines are two renderers of one plan, ``ddm.deploy.training_plan``).

- ``engine: job``: one Job per job, its pod on one node. PyTorch: one container running
  ``torchrun --standalone --nproc-per-node N``; JAX: one container per process (they share the
  pod's network, process 0 runs the coordinator on localhost), each with the JAX job's
  variables and an equal share of the node's devices.
- ``engine: kubeflow-trainer``: one TrainJob per expert and for the router, on the
  ``torch-distributed`` (``torchrun`` reads the runtime's ``PET_*`` variables) or
  ``jax-distributed`` runtime (which sets ``JAX_COORDINATOR_ADDRESS`` and the others, one
  process per pod: a JAX job's processes are pods, each with its share of the devices), with
  ``trainer.numNodes``, ``numProcPerNode`` (torch) and ``resourcesPerNode``; the node
  selector, tolerations, volumes and security settings go in a runtime patch of the runtime's
  ``node`` job and container. The partition, the data fetch and any other stage of one CPU
  process are Jobs under either engine.

Every pod is placed as serving places it (``ddm.operator.placement``: the accelerator's
resource, taint toleration and node selector), runs as the restricted Pod Security profile
asks, mounts the output root read-write at ``/output`` (with a store as the output, the
working volume ``spec.output.volume``) and the data read-only at ``/data``, and the stores'
credentials files (``storeCredentialsSecret``s) its job's arguments name read-only at
``/credentials`` (the data's for the data job, the output's for a job that uploads).
A failed pod is retried (``backoffLimit``); the job's ``--resume`` continues its saved state.

With the operator's ``network_policy`` setting each job's pods are confined by a NetworkPolicy
of the same name (:func:`build_network_policy`), made just before the job: no ingress, but
from the job's other pods where it runs several (a multi-node TrainJob: the runtime's
rendezvous and collectives, any port; a Job's processes share one pod and talk over its
loopback); egress to the cluster DNS, to those pods, and, for a job that fetches the data or
uploads a checkpoint (``JobPlan.reaches_store``), to the stores as the DDMDeployment's stager
reaches them (``access.store_egress``: ``fetch_allow_networks``; with
``fetch_cloud_identity`` the clouds' identity endpoints, ``access.identity_egress``). Never the
API server: the jobs never call it (no ServiceAccount token in a Job's pod; JAX's cluster
detection is off, ``ddm.training.distributed.jax_world``).
``meta`` needs ``name`` and ``namespace``; the handlers add ownerReferences.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from ddm.checkpoints.uri import FETCH_ALLOW_NETWORKS_ENV, CheckpointSource
from ddm.deploy.training_plan import (
    DATA_CREDENTIALS_FILE,
    OUTPUT_CREDENTIALS_FILE,
    TRAINED_KINDS,
    JobPlan,
    Paths,
    TrainingPlan,
    deployment_document,
)
from ddm.deploy.training_spec import TrainingSpec, Workers
from ddm.operator import names
from ddm.operator.access import dns_egress, identity_egress, network_policy, store_egress
from ddm.operator.config import OperatorConfig
from ddm.operator.manifests import (
    CONTAINER_SECURITY_CONTEXT,
    TERMINATION_MESSAGE,
    build_pod_spec,
    container_resources,
    literal_command,
)
from ddm.operator.placement import placement

OUTPUT_DIR = "/output"
DATA_DIR = "/data"
CREDENTIALS_DIR = "/credentials"
#: Where every job's processes find the volumes and files above.
PATHS = Paths(OUTPUT_DIR, DATA_DIR, CREDENTIALS_DIR)
TRAINER_API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_KIND = "TrainJob"
#: Trainer's runtimes by framework (the ClusterTrainingRuntimes its chart installs).
RUNTIMES = {"torch": "torch-distributed", "jax": "jax-distributed"}
#: The replicated job and container of those runtimes that run the training processes.
RUNTIME_NODE = "node"
RUNTIME_PATCH_MANAGER = "ddm.dev/operator"
TRAINING_LABEL = "ddm.dev/training"
JOB_LABEL = "ddm.dev/job"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Pod failures a job survives; each retry resumes the state the failed pod saved.
BACKOFF_LIMIT = 6
JAX_COORDINATOR = "127.0.0.1:29500"
#: What a TrainJob's runtime patch sets on the runtime's pods (the fields Trainer lets a
#: patch set, of those the operator's pods carry).
PATCHED_POD_FIELDS = ("securityContext", "nodeSelector", "tolerations", "affinity", "volumes")


def job_name(training: str, job: JobPlan) -> str:
    """``<training>-<job>``: at most 24 + 1 + 7 + 30 = 62 characters, a DNS-1123 label."""
    return f"{training}-{job.name}"


def build_training_jobs(spec: TrainingSpec, plan: TrainingPlan, meta: Mapping[str, Any],
                        config: OperatorConfig) -> list[dict[str, Any]]:
    """Every job of ``plan`` in plan order: a Job, or under kubeflow-trainer a TrainJob for
    the experts and the router (the partition, the data fetch and the text-to-image DDM's
    other stages, one CPU process each, are Jobs)."""
    return [build_trainjob(spec, job, meta, config) if _trainjob(spec, job)
            else build_job(spec, job, meta, config) for job in plan.jobs]


def job_pods(spec: TrainingSpec, job: JobPlan) -> int:
    """How many pods run ``job``: a TrainJob's ``numNodes`` (a JAX job's processes are pods
    under Trainer's jax-distributed runtime, which runs one process per pod), else one (a
    Job's processes share its pod)."""
    return job.workers.nodes * _pods_per_node(job) if _trainjob(spec, job) else 1


def build_network_policy(spec: TrainingSpec, job: JobPlan, meta: Mapping[str, Any],
                         config: OperatorConfig) -> dict[str, Any]:
    """The NetworkPolicy confining ``job``'s pods (see the module's docstring), named as the
    job. Its peers, where it has several pods, are those pods alone, on any port: the
    rendezvous (torchrun's, JAX's coordinator) and the collectives (gloo, NCCL) pick theirs."""
    pods = {TRAINING_LABEL: meta["name"], JOB_LABEL: job.name}
    peers = [{"podSelector": {"matchLabels": dict(pods)}}] if job_pods(spec, job) > 1 else []
    stores = ([store_egress(config.fetch_allow_networks),
               *([identity_egress()] if config.fetch_cloud_identity else [])]
              if job.reaches_store else [])
    return network_policy(
        job_name(meta["name"], job), meta, _labels(meta, job, "network-policy"), pods,
        ingress=[{"from": peers}] if peers else [],
        egress=[dns_egress(config), *([{"to": copy.deepcopy(peers)}] if peers else []),
                *stores])


def build_training_objects(spec: TrainingSpec, plan: TrainingPlan, meta: Mapping[str, Any],
                           config: OperatorConfig) -> dict[str, list[dict[str, Any]]]:
    """Plan job name -> what the operator creates for it, in order: its NetworkPolicy when
    ``config.network_policy`` is on (so that no pod of it runs unconfined), then the job."""
    jobs = build_training_jobs(spec, plan, meta, config)
    return {job.name: [*([build_network_policy(spec, job, meta, config)]
                         if config.network_policy else []), manifest]
            for job, manifest in zip(plan.jobs, jobs)}


def build_deployment(spec: TrainingSpec, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The DDMDeployment created once every job has finished (it outlives the DDMTraining:
    no ownerReference)."""
    document = deployment_document(spec)
    document["metadata"] = {**document["metadata"], "namespace": meta["namespace"],
                            "labels": {TRAINING_LABEL: meta["name"]}}
    return document


def build_job(spec: TrainingSpec, job: JobPlan, meta: Mapping[str, Any],
              config: OperatorConfig) -> dict[str, Any]:
    """``job`` as a batch/v1 Job: one pod on one node, its processes started as
    :meth:`JobPlan.node_processes` says."""
    workers = job.workers
    place = placement(workers.accelerator)
    processes = job.node_processes(PATHS, coordinator=JAX_COORDINATOR)
    volumes, mounts = _volumes(spec, job)
    containers = [{
        "name": "train" if len(processes) == 1 else f"rank-{rank}",
        "image": _image(spec, workers, config),
        "imagePullPolicy": config.image_pull_policy,
        "command": list(process.argv),
        "env": _env({**dict(process.env), **_store_env(job, config)}),
        "resources": container_resources(workers.pod, _shares(place.limits, len(processes))),
        "volumeMounts": copy.deepcopy(mounts),
        **TERMINATION_MESSAGE,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    } for rank, process in enumerate(processes)]
    pod = build_pod_spec(containers[0], workers.pod, volumes, [],
                         node_selector=place.node_selector, tolerations=place.tolerations)
    pod.update(restartPolicy="Never", containers=[literal_command(c) for c in containers])
    labels = _job_labels(spec, meta, job)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job_name(meta["name"], job), "namespace": meta["namespace"],
                     "labels": labels},
        "spec": {"backoffLimit": BACKOFF_LIMIT,
                 "template": {"metadata": {"labels": dict(labels)}, "spec": pod}},
    }


def build_trainjob(spec: TrainingSpec, job: JobPlan, meta: Mapping[str, Any],
                   config: OperatorConfig) -> dict[str, Any]:
    """``job`` as a Kubeflow Trainer v2 TrainJob on ``nodes`` nodes of its accelerator."""
    workers = job.workers
    place = placement(workers.accelerator)
    args = job.args(PATHS)
    torch = job.framework == "torch"
    volumes, mounts = _volumes(spec, job)
    per_node = _pods_per_node(job)
    trainer: dict[str, Any] = {
        "image": _image(spec, workers, config),
        "command": (["torchrun", "-m", "ddm", *args] if torch else ["ddm", *args]),
        "env": _env(_store_env(job, config)),
        "numNodes": job_pods(spec, job),
        **({"numProcPerNode": workers.processes_per_node} if torch else {}),
    }
    resources = container_resources(workers.pod, _shares(place.limits, per_node))
    if resources:
        trainer["resourcesPerNode"] = resources
    trainer = literal_command(trainer)
    pod = build_pod_spec(trainer, workers.pod, volumes, [], node_selector=place.node_selector,
                         tolerations=place.tolerations)
    pod_patch = {
        **{key: pod[key] for key in PATCHED_POD_FIELDS if key in pod},
        "containers": [{"name": RUNTIME_NODE, "volumeMounts": copy.deepcopy(mounts),
                        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT)}],
    }
    labels = _job_labels(spec, meta, job)
    return {
        "apiVersion": TRAINER_API_VERSION, "kind": TRAINJOB_KIND,
        "metadata": {"name": job_name(meta["name"], job), "namespace": meta["namespace"],
                     "labels": labels},
        "spec": {
            "runtimeRef": {"name": RUNTIMES[job.framework]},
            "trainer": trainer,
            "runtimePatches": [{
                "manager": RUNTIME_PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": RUNTIME_NODE,
                    "template": {"spec": {"template": {
                        "metadata": {"labels": dict(labels)}, "spec": pod_patch}}},
                }]}}},
            }],
        },
    }


def _shares(limits: Mapping[str, str], processes: int) -> dict[str, str]:
    """Each of ``processes`` processes' equal share of a node's devices (the spec's checks
    make it whole)."""
    return {resource: str(int(count) // processes) for resource, count in limits.items()}


def _pods_per_node(job: JobPlan) -> int:
    """A TrainJob's pods on each node: one for PyTorch (torchrun starts its processes);
    Trainer's jax-distributed runtime runs one process per pod, so P processes a node are P
    pods with a P-th of its devices each (as the Job engine gives P containers)."""
    return 1 if job.framework == "torch" else job.workers.processes_per_node


def _trainjob(spec: TrainingSpec, job: JobPlan) -> bool:
    """Whether ``job`` runs as a TrainJob (else as a Job)."""
    return spec.engine == "kubeflow-trainer" and job.kind in TRAINED_KINDS


def _labels(meta: Mapping[str, Any], job: JobPlan, component: str) -> dict[str, str]:
    """The labels of every object made for ``job`` (``component``: what it is)."""
    return {names.MANAGED_BY_LABEL: names.MANAGED_BY, TRAINING_LABEL: meta["name"],
            JOB_LABEL: job.name, names.COMPONENT_LABEL: component}


def _job_labels(spec: TrainingSpec, meta: Mapping[str, Any], job: JobPlan) -> dict[str, str]:
    """The job's and its pods' labels: with the Kueue queue it is submitted to."""
    labels = _labels(meta, job, f"training-{job.kind}")
    if spec.queue:
        labels[QUEUE_LABEL] = spec.queue
    return labels


def _image(spec: TrainingSpec, workers: Workers, config: OperatorConfig) -> str:
    return (workers.pod.image or spec.image
            or config.images.for_family(placement(workers.accelerator).image_family))


def _store_env(job: JobPlan, config: OperatorConfig) -> dict[str, str]:
    """For a job that reaches a store, the private networks the admin allows fetchers
    (``fetch_allow_networks``), in the variable the fetcher and the upload read: the same
    networks its NetworkPolicy admits."""
    if not job.reaches_store or not config.fetch_allow_networks:
        return {}
    return {FETCH_ALLOW_NETWORKS_ENV: ",".join(config.fetch_allow_networks)}


def _env(extra: Mapping[str, str]) -> list[dict[str, str]]:
    """HOME on the writable /tmp (the root file system is read-only), then ``extra``."""
    return [{"name": "HOME", "value": "/tmp"},
            *({"name": key, "value": value} for key, value in extra.items())]


def _volumes(spec: TrainingSpec, job: JobPlan
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The output root (read-write), the data (read-only), the stores' credentials files
    ``job`` names (read-only, owner-only; ``JobPlan.credentials_files``) and a writable
    /tmp."""
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    for name, source, path, read_only in (("output", spec.work, OUTPUT_DIR, False),
                                          ("data", spec.data.volume, DATA_DIR, True)):
        if source is None:
            continue
        volume, mount = _volume(name, source, path, read_only)
        volumes.append(volume)
        mounts.append(mount)
    secrets = [{"secret": {"name": secret.name, "items": [{"key": secret.key, "path": file}]}}
               for secret, file in ((spec.data.store_credentials, DATA_CREDENTIALS_FILE),
                                    (spec.output_credentials, OUTPUT_CREDENTIALS_FILE))
               if secret is not None and file in job.credentials_files]
    if secrets:
        volumes.append({"name": "store-credentials",
                        "projected": {"sources": secrets, "defaultMode": 0o400}})
        mounts.append({"name": "store-credentials", "mountPath": CREDENTIALS_DIR,
                       "readOnly": True})
    return volumes, mounts


def _volume(name: str, source: CheckpointSource, path: str, read_only: bool
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A claim (its sub-path mounted) or, where allowed, a host directory."""
    mount: dict[str, Any] = {"name": name, "mountPath": path, **(
        {"readOnly": True} if read_only else {})}
    if source.scheme == "pvc":
        sub_path = source.path.strip("/")
        if sub_path:
            mount["subPath"] = sub_path
        return ({"name": name, "persistentVolumeClaim": {"claimName": source.location,
                                                         **({"readOnly": True} if read_only
                                                            else {})}}, mount)
    return ({"name": name, "hostPath": {"path": source.path,
                                        "type": "Directory" if read_only
                                        else "DirectoryOrCreate"}}, mount)

