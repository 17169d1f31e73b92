"""The DDMTraining spec and its plan: pure functions, checked without a cluster or a trainer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ddm.deploy.spec import SpecError, parse_manifest
from ddm.deploy.training_plan import (
    JAX_COORDINATOR,
    JAX_NUM_PROCESSES,
    JAX_PROCESS_ID,
    Paths,
    deployment_document,
    plan_training,
)
from ddm.deploy.training_spec import (
    load_training_manifest,
    parse_training_manifest,
    parse_training_spec,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "training.yaml"


def _document() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _problems(spec: dict, **options) -> str:
    with pytest.raises(SpecError) as caught:
        parse_training_spec(spec, **options)
    return "\n".join(caught.value.problems)


def test_the_example_plans_two_experts_and_the_router_in_parallel():
    manifest = load_training_manifest(EXAMPLE)
    plan = plan_training(manifest.spec)
    assert [job.name for job in plan.jobs] == ["expert-digits-0-4", "expert-digits-5-9",
                                               "router"]
    assert [job.name for job in plan.ready(set())] == ["expert-digits-0-4", "expert-digits-5-9",
                                                       "router"]
    assert plan.job("router").after == ()
    router = plan.job("router").args(Paths("/out"))
    assert "--experts" not in router
    assert router[router.index("--partition") + 1] == "labels:0,1,2,3,4;5,6,7,8,9"
    assert router[router.index("--config") + 1] == "digits-small"
    torch_job = plan.job("expert-digits-0-4")
    assert torch_job.state == "experts/digits-0-4.training"
    (process,) = torch_job.node_processes(Paths("/out"))
    assert process.argv[:6] == ("torchrun", "--standalone", "--nproc-per-node", "2", "-m", "ddm")
    args = process.argv[6:]
    assert args[:2] == ("train", "expert")
    assert args[args.index("--partition") + 1] == "labels:0,1,2,3,4;5,6,7,8,9"
    assert args[args.index("--out") + 1] == "/out/experts/digits-0-4"
    assert "--resume" in args and args[args.index("--index") + 1] == "0"


def test_the_router_is_given_every_distinct_expert_config():
    # Experts of several UNet configs: the router job names each once (it refuses configs
    # whose image shape or classes disagree; the spec knows model names only).
    document = _document()
    document["spec"]["experts"][0]["model"] = "mnist-small"
    document["spec"]["experts"].append({"name": "third", "model": "reference"})
    document["spec"]["experts"][1]["model"] = "reference"
    document["spec"]["partition"] = {"labelGroups": [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]}
    router = plan_training(parse_training_manifest(document).spec).job("router")
    args = router.args(Paths("/out"))
    assert [args[k + 1] for k, arg in enumerate(args) if arg == "--config"] == [
        "mnist-small", "reference"]


def test_a_jax_expert_on_one_node_is_one_process_per_rank_with_the_jax_variables():
    job = plan_training(load_training_manifest(EXAMPLE).spec).job("expert-digits-5-9")
    processes = job.node_processes(Paths("/out"), ddm=("python", "-m", "ddm"),
                                   coordinator="127.0.0.1:4000")
    assert [dict(p.env) for p in processes] == [
        {JAX_COORDINATOR: "127.0.0.1:4000", JAX_NUM_PROCESSES: "2", JAX_PROCESS_ID: str(rank)}
        for rank in (0, 1)]
    assert all(p.argv[:5] == ("python", "-m", "ddm", "train", "expert") for p in processes)


def test_kmeans_is_fitted_once_by_a_job_the_experts_and_router_wait_for():
    document = _document()
    document["spec"]["partition"] = {"kmeans": {"clusters": 2, "imageSize": 16}}
    document["spec"]["data"] = {"dataset": "mnist", "uri": "pvc://datasets/mnist"}
    plan = plan_training(parse_training_manifest(document).spec)
    assert [job.name for job in plan.ready(set())] == ["partition"]
    partition = plan.job("partition")
    assert partition.args(Paths("/out", "/data")) == (
        "partition", "fit", "--data", "mnist:/data", "--kmeans", "2", "--features", "hog",
        "--image-size", "16", "--seed", "0", "--out", "/out/partition.json")
    assert partition.state is None
    expert = plan.job("expert-digits-0-4").args(Paths("/out", "/data"))
    assert expert[expert.index("--partition") + 1] == "file:/out/partition.json"
    router = plan.job("router").args(Paths("/out", "/data"))
    assert router[router.index("--partition") + 1] == "file:/out/partition.json"
    assert plan.job("expert-digits-0-4").after == ("partition",)
    assert plan.job("router").after == ("partition",)  # beside the experts
    assert [job.name for job in plan.ready({"partition"})] == [
        "expert-digits-0-4", "expert-digits-5-9", "router"]


def test_the_deployment_points_at_the_outputs_and_keeps_the_serving_settings():
    document = _document()
    document["spec"]["deployment"]["spec"]["experts"] = [
        {"name": "digits-5-9", "replicas": 2}]
    spec = parse_training_manifest(document).spec
    made = deployment_document(spec)
    deployment = parse_manifest(made).spec
    assert [(e.name, e.framework, e.checkpoint.uri, e.classes, e.replicas)
            for e in deployment.experts] == [
        ("digits-0-4", "torch", "pvc://ddm-training/digits/experts/digits-0-4",
         (0, 1, 2, 3, 4), 1),
        ("digits-5-9", "jax", "pvc://ddm-training/digits/experts/digits-5-9",
         (5, 6, 7, 8, 9), 2)]
    assert deployment.router.checkpoint.uri == "pvc://ddm-training/digits/router"
    assert made["metadata"]["name"] == "digits-trained"
    local = deployment_document(spec, "file:///tmp/out/")
    assert local["spec"]["router"]["checkpoint"] == {"uri": "file:///tmp/out/router"}


@pytest.mark.parametrize("change, expected", [
    (lambda s: s.update(engine="slurm"), "spec.engine: must be one of job, kubeflow-trainer"),
    (lambda s: s["experts"][0].update(nodes=2),
     "spec.experts[0].nodes: a Job runs on one node; use engine: kubeflow-trainer"),
    (lambda s: s["experts"][0].update(accelerator={"type": "neuron"}, processesPerNode=2),
     "spec.experts[0]: PyTorch on neuron trains as one process for now"),
    (lambda s: s["experts"][0].update(batchSize=127),
     "spec.experts[0].batchSize: 127 is not a multiple of the 2 processes"),
    (lambda s: s["experts"].pop(), "spec.experts: lists 1 experts but spec.partition has 2"),
    (lambda s: s["experts"][0].update(accelerator={"type": "nvidia", "count": 3}),
     "spec.experts[0].processesPerNode: 2 processes cannot share 3 devices equally"),
    (lambda s: s["experts"][1].update(accelerator={"type": "neuron"}),
     "spec.experts[1].accelerator.type: neuron cannot run framework jax"),
    (lambda s: s["experts"][0].update(epochs=3), "spec.experts[0]: unknown fields ['epochs']"),
    (lambda s: s.update(partition={"labelGroups": [[0, 1], [1, 2]]}),
     "spec.partition.labelGroups: a label is in two groups"),
    (lambda s: s.update(partition={"kmeans": {"clusters": 2}}),
     "spec.partition.kmeans.imageSize: is required"),
    (lambda s: s.update(output={"uri": "s3://bucket/ddm"}),
     "spec.output.volume: is required when spec.output.uri is a store: pvc://CLAIM/PATH, the "
     "volume where the jobs keep their training state"),
    (lambda s: s.update(output={"uri": "pvc://claim/ddm", "volume": "pvc://claim/work"}),
     "spec.output.volume: only with a store in spec.output.uri"),
    (lambda s: s.update(output={"uri": "gs://bucket/ddm", "volume": "s3://bucket/state"}),
     "spec.output.volume: 's3://bucket/state': must be pvc://CLAIM/PATH"),
    (lambda s: s.update(output={"uri": "https://example.com/ddm"}),
     "spec.output.uri: 'https://example.com/ddm': must be pvc://CLAIM/PATH or "
     "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX"),
    (lambda s: s.update(output={"uri": "pvc://claim/ddm",
                                "storeCredentialsSecret": {"name": "keys", "key": "aws"}}),
     "spec.output.storeCredentialsSecret: only for a store: spec.output.uri is not s3:// or "
     "gs://"),
    (lambda s: s.update(data={"dataset": "mnist", "uri": "pvc://datasets/mnist",
                              "storeCredentialsSecret": {"name": "keys"}}),
     "spec.data.storeCredentialsSecret: only for a store"),
    (lambda s: s.update(data={"dataset": "mnist", "uri": "s3://data/mnist",
                              "storeCredentialsSecret": {"name": "keys"}}),
     "spec.data.storeCredentialsSecret.key: is required"),
    (lambda s: s.update(data={"dataset": "digits", "uri": "s3://data/mnist"}),
     "spec.data.uri: not for dataset: digits"),
    (lambda s: s.update(output={"uri": "file:///srv/ddm"}),
     "file:// is a host path, which this operator does not allow"),
    (lambda s: s.update(data={"dataset": "mnist"}), "spec.data.uri: is required"),
    (lambda s: s["deployment"]["spec"].update(experts=[{"name": "other"}]),
     "spec.deployment.spec.experts[0].name: must name one of the experts (digits-0-4, "
     "digits-5-9)"),
    (lambda s: s["deployment"]["spec"].update(
        experts=[{"name": "digits-0-4", "checkpoint": {"uri": "pvc://x/y"}}]),
     "spec.deployment.spec.experts[0].checkpoint: decided by the training"),
    (lambda s: s["deployment"]["spec"].update(numClasses=5),
     "spec.deployment.spec.experts[1].classes: [5, 6, 7, 8, 9] are outside 0..4"),
])
def test_a_bad_spec_is_refused_naming_the_field(change, expected):
    spec = copy.deepcopy(_document()["spec"])
    change(spec)
    assert expected in _problems(spec)


def test_host_paths_are_accepted_where_allowed():
    spec = _document()["spec"]
    spec["output"] = {"uri": "file:///srv/ddm"}
    assert parse_training_spec(spec, allow_host_paths=True).output.path == "/srv/ddm"


def test_a_key_given_twice_names_its_line(tmp_path):
    text = EXAMPLE.read_text().replace("  engine: job\n", "  engine: job\n  engine: job\n")
    path = tmp_path / "training.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=r"duplicate key 'engine' \(first on line \d+\)"):
        load_training_manifest(path)


def _store_spec(**output):
    document = _document()
    document["spec"]["data"] = {"dataset": "mnist", "uri": "s3://data/mnist.tar.gz",
                                "storeCredentialsSecret": {"name": "keys", "key": "aws"}}
    document["spec"]["output"] = {"uri": "s3://models/digits/", "volume": "pvc://work/digits",
                                  **output}
    return parse_training_manifest(document).spec


def test_data_in_a_store_is_fetched_once_by_a_first_job_into_the_output_volume():
    spec = _store_spec()
    assert spec.work.uri == "pvc://work/digits" and spec.data.volume is None
    plan = plan_training(spec)
    assert [job.name for job in plan.ready(set())] == ["data"]
    data = plan.job("data")
    assert data.args(Paths("/out", credentials="/credentials")) == (
        "fetch-data", "s3://data/mnist.tar.gz", "/out/data",
        "--store-credentials-file", "/credentials/data")
    # no Secret mounted (ddm train-all): the cloud's chain of the environment signs
    assert data.args(Paths("/out")) == ("fetch-data", "s3://data/mnist.tar.gz", "/out/data")
    expert = plan.job("expert-digits-0-4")
    assert expert.after == ("data",)
    args = expert.args(Paths("/out"))
    assert args[args.index("--data") + 1] == "mnist:/out/data"


def test_an_output_in_a_store_is_uploaded_by_each_job_and_the_deployment_reads_archives():
    spec = _store_spec(storeCredentialsSecret={"name": "keys", "key": "aws"})
    plan = plan_training(spec)
    expert, router = plan.job("expert-digits-0-4"), plan.job("router")
    assert expert.upload == "s3://models/digits/experts/digits-0-4"
    assert router.upload == "s3://models/digits/router"
    args = expert.args(Paths("/out", credentials="/credentials"))
    assert args[args.index("--out") + 1:] == (
        "/out/experts/digits-0-4", "--upload", "s3://models/digits/experts/digits-0-4",
        "--store-credentials-file", "/credentials/output")
    assert router.args(Paths("/out"))[-2:] == ("--upload", "s3://models/digits/router")
    document = deployment_document(spec, sha256s={"router": "ab" * 32})
    assert document["spec"]["experts"][0]["checkpoint"] == {
        "uri": "s3://models/digits/experts/digits-0-4.tar.gz",
        "storeCredentialsSecret": {"name": "keys", "key": "aws"}}
    assert document["spec"]["router"]["checkpoint"]["sha256"] == "ab" * 32
    parse_manifest(document)  # a DDMDeployment the operator takes


TEXT2IMG = EXAMPLE.with_name("training-text2img.yaml")


def _text2img() -> dict:
    return yaml.safe_load(TEXT2IMG.read_text())


def test_coloured_mnist_plans_the_text2img_stages_with_the_router_beside_the_experts():
    spec = load_training_manifest(TEXT2IMG).spec
    plan = plan_training(spec)
    experts = [f"expert-{k}" for k in range(4)]
    assert [job.name for job in plan.ready(set())] == ["tokenizer", "vae"]
    assert [job.name for job in plan.ready({"tokenizer", "vae"})] == ["clip"]
    assert [job.name for job in plan.ready({"tokenizer", "vae", "clip"})] == ["partition"]
    before = {"tokenizer", "vae", "clip", "partition", "latents"}
    assert [job.name for job in plan.ready(before)] == [*experts, "router", "text-prior"]
    assert plan.job("import").after == (*experts, "router", "text-prior")
    paths = Paths("/out", "/data")
    for name, steps in (("clip", 2000), ("vae", 3000), ("expert-2", 3000), ("router", 1500)):
        job = plan.job(name)
        args = job.args(paths)
        assert job.steps == steps and args[args.index("--steps") + 1] == str(steps)
        assert "--resume" in args and args[args.index("--progress-log") + 1] == "15"
        assert job.state == f"{job.output}.training"
    expert = plan.job("expert-2").args(paths)
    assert expert[:3] == ("train", "text2img", "expert")
    assert expert[expert.index("--index") + 1] == "2" and "--mnist" in expert
    partition = plan.job("partition")
    assert partition.args(paths)[partition.args(paths).index("--clusters") + 1] == "4"
    assert (partition.steps, partition.finished_file) == (None, "partition.json")
    assert plan.job("import").args(paths) == (
        "import", "text2img", "/out", "--out", "/out/ddm",
        "--checkpoint-base", "pvc://ddm-training/text2img/ddm/")
    assert plan.job("import").finished_file == "ddm/ddm.yaml"
    assert plan.job("tokenizer").finished_file == "tokenizer/tokenizer.json"


def test_the_text2img_deployment_serves_the_imported_stages():
    document = _text2img()
    document["spec"]["text2img"]["clusters"] = 2
    document["spec"]["deployment"]["spec"]["experts"] = [{"name": "expert-1",
                                                           "framework": "jax"}]
    made = deployment_document(parse_training_manifest(document).spec)
    deployment = parse_manifest(made).spec
    base = "pvc://ddm-training/text2img/ddm"
    assert deployment.conditioning == "text"
    assert [(e.name, e.framework, e.checkpoint.uri) for e in deployment.experts] == [
        ("expert-0", "torch", f"{base}/expert_0"), ("expert-1", "jax", f"{base}/expert_1")]
    assert made["spec"]["textEncoder"]["checkpoint"] == {"uri": f"{base}/text_encoder"}
    assert made["spec"]["decoder"]["checkpoint"] == {"uri": f"{base}/decoder"}
    assert deployment.router.checkpoint.uri == f"{base}/router"


def test_text2img_defaults_are_the_trainers():
    from ddm.deploy.training_spec import TEXT2IMG_SIZES, TEXT2IMG_STEPS
    from ddm.models.text2img import SIZES
    from ddm.training.text2img.commands import CLUSTERS, DEFAULTS

    assert sorted(TEXT2IMG_SIZES) == sorted(SIZES)
    assert {stage: DEFAULTS[stage].steps for stage in TEXT2IMG_STEPS} == TEXT2IMG_STEPS
    document = _text2img()
    document["spec"]["text2img"] = {}
    text2img = parse_training_manifest(document).spec.text2img
    assert (text2img.clusters, text2img.size, dict(text2img.steps)) == (
        CLUSTERS, "small", TEXT2IMG_STEPS)


@pytest.mark.parametrize("change, expected", [
    (lambda s: s.update(experts=[{"name": "a"}]),
     "spec.experts: not for dataset coloured-mnist: its experts are the clusters"),
    (lambda s: s.update(partition={"labelGroups": [[0]]}), "spec.partition: not for dataset "
                                                           "coloured-mnist"),
    (lambda s: s.update(router={"steps": 3}), "spec.router: not for dataset coloured-mnist"),
    (lambda s: s["text2img"].update(size="large"),
     "spec.text2img.size: must be one of small, smoke, got 'large'"),
    (lambda s: s["text2img"].update(clusters=1),
     "spec.text2img.clusters: must be an integer in 2..16, got 1"),
    (lambda s: s["text2img"]["steps"].update(monolith=5),
     "spec.text2img.steps: unknown fields ['monolith']"),
    (lambda s: s["text2img"]["steps"].update(vae=0),
     "spec.text2img.steps.vae: must be an integer in 1..10000000, got 0"),
    (lambda s: s["text2img"].update(features="hog"),
     "spec.text2img: unknown fields ['features']"),
    (lambda s: s["data"].pop("uri"), "spec.data.uri: is required"),
    (lambda s: s["deployment"]["spec"].update(experts=[{"name": "expert-4"}]),
     "spec.deployment.spec.experts[0].name: must name one of the experts (expert-0, expert-1, "
     "expert-2, expert-3)"),
    (lambda s: s["deployment"]["spec"].update(decoder={"checkpoint": {"uri": "pvc://a/b"}}),
     "spec.deployment.spec.decoder.checkpoint: decided by the training"),
    (lambda s: s["deployment"]["spec"].update(conditioning="labels"),
     "spec.deployment.spec.conditioning: the text-to-image DDM is conditioned on text"),
])
def test_a_bad_text2img_spec_is_refused_naming_the_field(change, expected):
    spec = copy.deepcopy(_text2img()["spec"])
    change(spec)
    assert expected in _problems(spec)


def test_text2img_is_only_for_coloured_mnist():
    spec = _document()["spec"]
    spec["text2img"] = {"size": "smoke"}
    assert "spec.text2img: only for dataset: coloured-mnist" in _problems(spec)


def test_coloured_mnist_in_a_store_is_fetched_first_and_every_root_stage_reads_it():
    document = _text2img()
    document["spec"]["data"] = {"dataset": "coloured-mnist", "uri": "s3://data/mnist.tar.gz"}
    spec = parse_training_manifest(document).spec
    assert (spec.data.store.uri, spec.data.volume) == ("s3://data/mnist.tar.gz", None)
    plan = plan_training(spec)
    assert [job.name for job in plan.ready(set())] == ["data"]
    assert plan.job("data").args(Paths("/out")) == (
        "fetch-data", "s3://data/mnist.tar.gz", "/out/data")
    assert plan.job("data").finished_file == "data"
    assert [job.name for job in plan.ready({"data"})] == ["tokenizer", "vae"]
    for job in plan.jobs[1:-1]:
        args = job.args(Paths("/out"))
        assert args[args.index("--mnist") + 1] == "/out/data", job.name


def test_a_text2img_output_in_a_store_is_refused_naming_the_field():
    spec = _text2img()["spec"]
    spec["output"] = {"uri": "s3://models/text2img", "volume": "pvc://work/text2img"}
    assert "spec.output.uri: not a store for dataset coloured-mnist" in _problems(spec)
