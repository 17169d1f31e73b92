"""A DDMTraining's jobs as Jobs and Kubeflow Trainer v2 TrainJobs: the TrainJobs validate against
Trainer's own CRD schema (vendored: tests/data/kubeflow-trainer), strictly (an unknown field,
which the API server would drop, is an error here)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ddm.deploy.training_plan import JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID
from ddm.deploy.training_plan import (
    DATA_KIND,
    EXPERT_KIND,
    PARTITION_KIND,
    ROUTER_KIND,
    STAGE_KIND,
    TRAINED_KINDS,
    plan_training,
)
from ddm.deploy.training_spec import parse_training_manifest
from ddm.operator.config import OperatorConfig
from ddm.operator.render import render_file, render_training
from ddm.operator.training_manifests import QUEUE_LABEL, build_training_jobs
from ddm.operator.training_status import training_status

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "training.yaml"
TRAINJOB_CRD = ROOT / "tests" / "data" / "kubeflow-trainer" / "trainer.kubeflow.org_trainjobs.yaml"
CONFIG = OperatorConfig()


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused where the API server would prune them."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        found["additionalProperties"] = False
    return found


@pytest.fixture(scope="module")
def trainjob_schema() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(TRAINJOB_CRD.read_text())
    (version,) = crd["spec"]["versions"]
    assert (crd["spec"]["group"], version["name"], crd["spec"]["names"]["kind"]) == (
        "trainer.kubeflow.org", "v1alpha1", "TrainJob")
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _document(engine: str = "job") -> dict:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["engine"] = engine
    return document


def _paris_scale() -> dict:
    """8 experts on 2 nodes of 8 NVIDIA GPUs each, one on Trainium, one JAX on a TPU slice."""
    document = _document("kubeflow-trainer")
    spec = document["spec"]
    spec["data"] = {"dataset": "mnist", "uri": "pvc://datasets/mnist"}
    spec["partition"] = {"kmeans": {"clusters": 10, "imageSize": 32}}
    spec["queue"] = "training"
    spec["experts"] = [
        {"name": f"cluster-{i}", "framework": "torch", "model": "mnist-small",
         "accelerator": {"type": "nvidia", "count": 8, "product": "NVIDIA-A100-SXM4-80GB"},
         "nodes": 2, "batchSize": 256} for i in range(8)]
    spec["experts"].append({"name": "cluster-8", "framework": "torch", "model": "mnist-small",
                            "accelerator": {"type": "neuron", "count": 16},
                            "resources": {"limits": {"vpc.amazonaws.com/efa": 8}}})
    spec["experts"].append({"name": "cluster-9", "framework": "jax", "model": "mnist-small",
                            "accelerator": {"type": "tpu", "count": 4}})
    return document


def test_trainjobs_validate_against_trainers_crd_with_nodes_and_devices(trainjob_schema):
    objects = render_training(_paris_scale(), CONFIG)
    kinds = [o["kind"] for o in objects]
    assert kinds == ["Job", *["TrainJob"] * 11, "DDMDeployment"]
    trainjobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "TrainJob"}
    for name, trainjob in trainjobs.items():
        # The CEL rule of Trainer's schema that applies on creation (jsonschema runs no CEL).
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
        errors = sorted(trainjob_schema.iter_errors(trainjob), key=str)
        assert not errors, f"{trainjob['metadata']['name']}: {errors[0].message} at " \
                           f"{list(errors[0].absolute_path)}"
        assert trainjob["metadata"]["labels"][QUEUE_LABEL] == "training"

    def pod(trainjob: dict) -> dict:
        (patch,) = trainjob["spec"]["runtimePatches"]
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert node["name"] == "node"
        return node["template"]["spec"]["template"]["spec"]

    gpu = trainjobs["digits-expert-cluster-0"]["spec"]
    assert gpu["runtimeRef"] == {"name": "torch-distributed"}
    assert (gpu["trainer"]["numNodes"], gpu["trainer"]["numProcPerNode"]) == (2, 8)
    assert gpu["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert gpu["trainer"]["command"][:5] == ["torchrun", "-m", "ddm", "train", "expert"]
    args = gpu["trainer"]["command"]
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--partition") + 1] == "file:/output/partition.json"
    assert pod(trainjobs["digits-expert-cluster-0"])["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod(
        trainjobs["digits-expert-cluster-0"])["tolerations"]

    neuron = trainjobs["digits-expert-cluster-8"]["spec"]["trainer"]
    assert neuron["resourcesPerNode"] == {"limits": {"vpc.amazonaws.com/efa": "8",
                                                     "aws.amazon.com/neuron": "16"}}
    assert neuron["command"][neuron["command"].index("--device") + 1] == "xla"

    tpu = trainjobs["digits-expert-cluster-9"]["spec"]
    assert tpu["runtimeRef"] == {"name": "jax-distributed"}
    assert "numProcPerNode" not in tpu["trainer"]
    assert tpu["trainer"]["command"][:3] == ["ddm", "train", "expert"]
    assert tpu["trainer"]["resourcesPerNode"] == {"limits": {"google.com/tpu": "4"}}
    assert pod(trainjobs["digits-expert-cluster-9"])["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x2"}
    data_mount = {"name": "data", "mountPath": "/data", "readOnly": True, "subPath": "mnist"}
    assert data_mount in pod(trainjobs["digits-router"])["containers"][0]["volumeMounts"]


def test_the_strict_schema_refuses_what_trainer_does_not_know(trainjob_schema):
    (trainjob, *_) = [o for o in render_training(_document("kubeflow-trainer"), CONFIG)
                      if o["kind"] == "TrainJob"]
    assert trainjob_schema.is_valid(trainjob)
    wrong = copy.deepcopy(trainjob)
    wrong["spec"]["trainer"]["numProcesses"] = 2
    assert not trainjob_schema.is_valid(wrong)
    wrong = copy.deepcopy(trainjob)
    wrong["spec"]["trainer"]["numNodes"] = "2"
    assert not trainjob_schema.is_valid(wrong)


def test_a_jax_jobs_processes_are_pods_under_trainer():
    objects = render_training(_document("kubeflow-trainer"), CONFIG)
    (jax,) = [o for o in objects if o["metadata"]["name"] == "digits-expert-digits-5-9"]
    assert jax["spec"]["trainer"]["numNodes"] == 2
    assert jax["spec"]["runtimeRef"] == {"name": "jax-distributed"}


def test_jobs_start_torchrun_or_one_container_per_jax_process():
    jobs = {o["metadata"]["name"]: o for o in render_training(_document("job"), CONFIG)}
    torch_pod = jobs["digits-expert-digits-0-4"]["spec"]["template"]["spec"]
    (container,) = torch_pod["containers"]
    assert container["command"][:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    assert torch_pod["restartPolicy"] == "Never"
    jax_pod = jobs["digits-expert-digits-5-9"]["spec"]["template"]["spec"]
    assert [c["name"] for c in jax_pod["containers"]] == ["rank-0", "rank-1"]
    for rank, container in enumerate(jax_pod["containers"]):
        env = {e["name"]: e["value"] for e in container["env"]}
        assert (env[JAX_COORDINATOR], env[JAX_NUM_PROCESSES], env[JAX_PROCESS_ID]) == (
            "127.0.0.1:29500", "2", str(rank))
        assert container["command"][:3] == ["ddm", "train", "expert"]
        assert {"name": "output", "mountPath": "/output", "subPath": "digits"} in \
            container["volumeMounts"]
    assert jax_pod["volumes"][1] == {"name": "output",
                                     "persistentVolumeClaim": {"claimName": "ddm-training"}}
    deployment = jobs["digits-trained"]
    assert deployment["kind"] == "DDMDeployment"
    assert deployment["metadata"]["namespace"] == "default"


def test_a_jax_job_shares_the_nodes_devices_between_its_processes():
    document = _document("job")
    document["spec"]["experts"][1]["accelerator"] = {"type": "nvidia", "count": 4}
    spec = parse_training_manifest(document).spec
    from ddm.operator.training_manifests import build_job

    job = build_job(spec, plan_training(spec).job("expert-digits-5-9"),
                    {"name": "digits", "namespace": "ml"}, CONFIG)
    containers = job["spec"]["template"]["spec"]["containers"]
    assert [c["resources"]["limits"]["nvidia.com/gpu"] for c in containers] == ["2", "2"]
    assert containers[0]["image"] == CONFIG.images.by_family["cuda"]


def test_ddm_render_dispatches_on_the_kind(tmp_path):
    path = tmp_path / "training.yaml"
    document = _document("job")
    document["spec"]["output"]["uri"] = "pvc://ddm-training/a$(HOME)b"
    path.write_text(yaml.safe_dump(document))
    text = render_file(path, {"DDM_NETWORK_POLICY": "false"})
    assert text.startswith("# The jobs the operator runs for")
    objects = list(yaml.safe_load_all(text))
    assert [o["kind"] for o in objects] == ["Job", "Job", "Job", "DDMDeployment"]
    command = objects[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-1] == "/output/experts/digits-0-4"  # the sub-path is in the mount
    assert objects[0]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][1][
        "subPath"] == "a$(HOME)b"


def _stores(engine: str) -> dict:
    """MNIST in S3, the output to S3 with the store's keys in the training's Secret."""
    document = _document(engine)
    keys = {"name": "digits-aws", "key": "credentials"}
    document["spec"]["data"] = {"dataset": "mnist", "uri": "s3://datasets/mnist",
                                "storeCredentialsSecret": keys}
    document["spec"]["output"] = {"uri": "s3://models/digits", "volume": "pvc://work/digits",
                                  "storeCredentialsSecret": keys}
    return document


@pytest.mark.parametrize("engine", ["job", "kubeflow-trainer"])
def test_with_stores_the_pods_work_on_the_volume_and_read_the_keys_as_files(
        engine, trainjob_schema):
    objects = render_training(_stores(engine), CONFIG)
    data = objects[0]
    assert (data["kind"], data["metadata"]["name"]) == ("Job", "digits-data")
    (fetch,) = data["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == ["ddm", "fetch-data", "s3://datasets/mnist", "/output/data",
                                "--store-credentials-file", "/credentials/data"]
    for job in objects[1:-1]:
        if job["kind"] == "TrainJob":
            assert not sorted(trainjob_schema.iter_errors(job), key=str)
            (patch,) = job["spec"]["runtimePatches"]
            (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            pod = node["template"]["spec"]["template"]["spec"]
            command = job["spec"]["trainer"]["command"]
        else:
            pod = job["spec"]["template"]["spec"]
            command = pod["containers"][0]["command"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["output"]["persistentVolumeClaim"] == {"claimName": "work"}
        assert volumes["store-credentials"]["projected"] == {"defaultMode": 0o400, "sources": [
            {"secret": {"name": "digits-aws", "items": [{"key": "credentials",
                                                          "path": "output"}]}}]}
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "store-credentials", "mountPath": "/credentials",
                "readOnly": True} in mounts
        assert {"name": "output", "mountPath": "/output", "subPath": "digits"} in mounts
        name = job["metadata"]["name"].removeprefix("digits-expert-")
        where = "router" if name == "digits-router" else f"experts/{name}"
        assert command[command.index("--upload"):] == [
            "--upload", f"s3://models/digits/{where}", "--store-credentials-file",
            "/credentials/output"]
        assert command[command.index("--data") + 1] == "mnist:/output/data"
    checkpoint = objects[-1]["spec"]["router"]["checkpoint"]
    assert checkpoint == {"uri": "s3://models/digits/router.tar.gz",
                          "storeCredentialsSecret": {"name": "digits-aws",
                                                     "key": "credentials"}}


def test_the_text2img_training_renders_its_stages_as_jobs_and_its_trainers_as_trainjobs(
        trainjob_schema):
    document = yaml.safe_load(EXAMPLE.with_name("training-text2img.yaml").read_text())
    jobs = render_training(document, CONFIG)
    assert [(o["kind"], o["metadata"]["name"]) for o in jobs] == [
        ("Job", f"text2img-{name}") for name in (
            "tokenizer", "vae", "clip", "partition", "latents", "expert-0", "expert-1",
            "expert-2", "expert-3", "router", "text-prior", "import")] + [
        ("DDMDeployment", "text2img-trained")]
    (container,) = jobs[5]["spec"]["template"]["spec"]["containers"]
    assert container["command"][:4] == ["ddm", "train", "text2img", "expert"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True, "subPath": "mnist"} in \
        container["volumeMounts"]
    document["spec"]["engine"] = "kubeflow-trainer"
    kinds = {o["metadata"]["name"]: o for o in render_training(document, CONFIG)}
    for name in ("expert-0", "router"):
        trainjob = kinds[f"text2img-{name}"]
        assert trainjob["kind"] == "TrainJob"
        trainjob_schema.validate(trainjob)
    assert {kinds[f"text2img-{name}"]["kind"] for name in ("clip", "latents", "import")} == {
        "Job"}


def test_coloured_mnist_in_a_store_is_fetched_by_a_first_job_that_the_stages_read():
    document = yaml.safe_load(EXAMPLE.with_name("training-text2img.yaml").read_text())
    document["spec"]["data"] = {"dataset": "coloured-mnist", "uri": "gs://datasets/mnist",
                                "storeCredentialsSecret": {"name": "text2img-gcs",
                                                           "key": "key.json"}}
    jobs = render_training(document, CONFIG)
    (fetch,) = jobs[0]["spec"]["template"]["spec"]["containers"]
    assert fetch["command"] == ["ddm", "fetch-data", "gs://datasets/mnist", "/output/data",
                                "--store-credentials-file", "/credentials/data"]
    (tokenizer,) = jobs[1]["spec"]["template"]["spec"]["containers"]
    assert tokenizer["command"][tokenizer["command"].index("--mnist") + 1] == "/output/data"
    assert not any(m["name"] == "data" for m in tokenizer["volumeMounts"])


def test_the_trained_kinds_alone_run_as_trainjobs_and_have_a_condition_each():
    # One set of kinds: the plan emits them, the renderer makes TrainJobs of TRAINED_KINDS
    # and the status gives each of those a condition.
    document = yaml.safe_load(EXAMPLE.with_name("training-text2img.yaml").read_text())
    document["spec"]["engine"] = "kubeflow-trainer"
    document["spec"]["data"] = {"dataset": "coloured-mnist", "uri": "gs://datasets/mnist"}
    spec = parse_training_manifest(document, allow_host_paths=True).spec
    plan = plan_training(spec)
    assert {job.kind for job in plan.jobs} == {DATA_KIND, PARTITION_KIND, EXPERT_KIND,
                                               ROUTER_KIND, STAGE_KIND}
    trained = [job.name for job in plan.jobs if job.kind in TRAINED_KINDS]
    assert trained == [*(f"expert-{k}" for k in range(4)), "router"]
    rendered = build_training_jobs(spec, plan, {"name": "t", "namespace": "ns"}, CONFIG)
    assert [job.name for job, obj in zip(plan.jobs, rendered)
            if obj["kind"] == "TrainJob"] == trained
    status = training_status(plan, {}, {}, {"name": "t"}, previous={},
                             now="2026-01-01T00:00:00Z", deployment=None)
    assert [c["type"] for c in status["conditions"]] == [
        *(f"Expert-expert-{k}" for k in range(4)), "Router"]


def _credentials(pod: dict) -> list[str]:
    """The credentials files a pod's projected volume holds."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    if "store-credentials" not in volumes:
        return []
    return [item["path"] for source in volumes["store-credentials"]["projected"]["sources"]
            for item in source["secret"]["items"]]


def test_each_job_mounts_only_the_credentials_its_arguments_name():
    jobs = render_training(_stores("job"), CONFIG)[:-1]
    assert {job["metadata"]["name"]: _credentials(job["spec"]["template"]["spec"])
            for job in jobs} == {"digits-data": ["data"], "digits-expert-digits-0-4": ["output"],
                                 "digits-expert-digits-5-9": ["output"],
                                 "digits-router": ["output"]}
    document = yaml.safe_load(EXAMPLE.with_name("training-text2img.yaml").read_text())
    document["spec"]["data"] = {"dataset": "coloured-mnist", "uri": "gs://datasets/mnist",
                                "storeCredentialsSecret": {"name": "text2img-gcs",
                                                           "key": "key.json"}}
    (data, *stages) = render_training(document, CONFIG)[:-1]
    assert _credentials(data["spec"]["template"]["spec"]) == ["data"]
    for stage in stages:  # they read the copy on the volume: no key of the store
        pod = stage["spec"]["template"]["spec"]
        assert _credentials(pod) == []
        assert not any(m["name"] == "store-credentials"
                       for m in pod["containers"][0]["volumeMounts"])
