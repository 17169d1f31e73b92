"""The DDMTraining custom resource's fields, declared once: ``crds/`` is generated from them.

Built from the constants the parser (``ddm.deploy.training_spec``) checks against, and from the
DDMDeployment's declarations (``ddm.deploy.crd``) for the shapes both resources share: the
accelerator, the pod fields, names. ``scripts/generate_crds.py`` writes the CRD and the
chart's copy (``make generate``); ``make lint`` fails while a committed file differs.

No API-server default for steps, batchSize or learningRate: the experts' and the router's
differ (the parser's apply), as does processesPerNode's (one per GPU for PyTorch).
"""

from __future__ import annotations

from ddm.checkpoints.uri import MAX_URI_LENGTH
from ddm.deploy.crd import (
    FRAMEWORK,
    LABELS,
    MEMBER_NAME,
    POD_FIELDS,
    RESOURCES,
    SECRET_KEY,
    SECRET_NAME,
    accelerator_field,
)
from ddm.deploy.limits import MAX_CLASS, MAX_EXPERTS
from ddm.deploy.schema import (
    Array,
    Boolean,
    Column,
    CustomResource,
    Field,
    Integer,
    Number,
    Object,
    String,
)
from ddm.deploy.spec import GROUP, MAX_NAME_LENGTH, NAME_PATTERN, VERSION
from ddm.deploy.training_spec import (
    API_VERSION,
    DATASETS,
    DEFAULT_MODEL_CONFIG,
    ENGINES,
    FEATURES,
    KIND,
    MAX_BATCH_SIZE,
    MAX_IMAGE_SIZE,
    MAX_KMEANS,
    MAX_LEARNING_RATE,
    MAX_MODEL_CONFIG_LENGTH,
    MAX_NODES,
    MAX_PROCESSES_PER_NODE,
    MAX_QUEUE_LENGTH,
    MAX_SEED,
    MAX_TRAIN_STEPS,
    MIN_IMAGE_SIZE,
    MIN_LEARNING_RATE,
    MODEL_CONFIG_PATTERN,
    PLURAL,
    QUEUE_PATTERN,
    SAVE_EVERY,
    STORE_URI_PATTERN,
    TEXT2IMG_CLUSTERS,
    TEXT2IMG_SIZES,
    TEXT2IMG_STEPS,
    VOLUME_URI_PATTERN,
)

IMAGE = POD_FIELDS["image"].described(
    "The training image (a plain image reference); unset: the operator's default image for "
    "the accelerator.")
VOLUME_URI = String(description="pvc://CLAIM/PATH (file:///PATH where host paths are allowed).",
                    min_length=1, max_length=MAX_URI_LENGTH, pattern=VOLUME_URI_PATTERN)
STORE_URI = String(min_length=1, max_length=MAX_URI_LENGTH, pattern=STORE_URI_PATTERN)


def store_credentials(uri: str) -> Object:
    """``storeCredentialsSecret`` beside the store URI at ``uri``."""
    return Object(
        description=f"Only when {uri} is s3:// or gs://: the key of a Secret (in this "
                    "namespace) holding the store's own credentials file (an AWS shared "
                    "credentials file for s3://, a Google service-account key for gs://), "
                    "mounted read-only into the jobs that reach the store; unset: the cloud's "
                    "credential chain (IRSA, Workload Identity).",
        required=("name", "key"), properties={"name": SECRET_NAME, "key": SECRET_KEY})


SEED = Integer(minimum=0, maximum=MAX_SEED)

# -- One job's optimisation and where it runs (``TrainSettings``, ``Workers``) -----------------
#: What the experts' and the router's jobs both take.
TRAIN_FIELDS: dict[str, Field] = {
    "steps": Integer(minimum=1, maximum=MAX_TRAIN_STEPS),
    "batchSize": Integer(description="The global batch, shared by every process of the job.",
                         minimum=1, maximum=MAX_BATCH_SIZE),
    "learningRate": Number(description="The peak learning rate.", minimum=MIN_LEARNING_RATE,
                           maximum=MAX_LEARNING_RATE),
    "seed": SEED,
    "saveEvery": Integer(
        description=f"Steps between two saves of the training state (default {SAVE_EVERY}).",
        minimum=1, maximum=MAX_TRAIN_STEPS),
}
#: The pod fields of a DDMDeployment's component, without its operator's allow-lists (a
#: DDMTraining's jobs are not held to them).
WORKER_FIELDS: dict[str, Field] = {
    "accelerator": accelerator_field("node"),
    "nodes": Integer(
        description="Nodes (pods) of the job; more than 1 needs engine kubeflow-trainer.",
        minimum=1, maximum=MAX_NODES),
    "processesPerNode": Integer(
        description="Training processes on each node (default one per device, else 1).",
        minimum=1, maximum=MAX_PROCESSES_PER_NODE),
    "resources": RESOURCES.described(
        "Requests and limits of each node's pod (quantities such as 500m, 2, 512Mi); "
        "accelerator devices come from accelerator, not from here."),
    "image": IMAGE,
    "nodeSelector": POD_FIELDS["nodeSelector"].described(
        "Node labels the pods require (label values)."),
    "tolerations": POD_FIELDS["tolerations"].described(
        "Taints the pods tolerate, as for a pod (accelerator taints are added)."),
    "affinity": POD_FIELDS["affinity"].described(
        "A pod affinity, passed through (the API server checks it)."),
}

SPEC = Object(required=("output", "deployment"), properties={
    "engine": String(
        description="job: a batch/v1 Job per job, on one node (torchrun --standalone inside); "
                    "kubeflow-trainer: a Kubeflow Trainer v2 TrainJob per job (torch-distributed "
                    "or jax-distributed runtime; many nodes; Kueue may queue it).",
        choices=ENGINES, default=ENGINES[0]),
    "image": IMAGE,
    "queue": String(
        description="The Kueue LocalQueue the jobs are submitted to (label "
                    "kueue.x-k8s.io/queue-name); unset: not queued.",
        min_length=1, max_length=MAX_QUEUE_LENGTH, pattern=QUEUE_PATTERN),
    "data": Object(description="The images every job reads.", properties={
        "dataset": String(
            description="digits (embedded in the image), mnist (the four IDX files at uri) or "
                        "coloured-mnist (the same files, coloured and captioned: the "
                        "text-to-image DDM, spec.text2img, instead of partition, experts and "
                        "router).",
            choices=DATASETS, default=DATASETS[0]),
        "uri": STORE_URI.described(
            "pvc://CLAIM/PATH (file:///PATH where host paths are allowed), or s3://BUCKET/KEY, "
            "gs://BUCKET/KEY: LeCun's four .gz files there, or a .tar.gz of them, fetched once "
            "by a first job (ddm fetch-data) into the output volume."),
        "storeCredentialsSecret": store_credentials("uri"),
    }),
    "output": Object(
        description="Where the jobs write partition.json, experts/NAME and router (and their "
                    "training states, NAME.training, from which a rerun resumes).",
        required=("uri",), properties={
            "uri": STORE_URI.described(
                "pvc://CLAIM/PATH (file:///PATH where host paths are allowed), or "
                "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX: each expert and router job uploads "
                "its checkpoint as PREFIX/experts/NAME.tar.gz, PREFIX/router.tar.gz, then a "
                "marker (.tar.gz.json) with its sha256, and the DDMDeployment reads the "
                "archives (not for dataset coloured-mnist: its DDM is imported and served "
                "on a volume)."),
            "volume": VOLUME_URI.described(
                "With a store in uri, and only then (required): the volume the jobs work on: "
                "their training states (a retried job resumes from them; an emptyDir would "
                "lose them with the pod), the partition, the fetched data, and each "
                "checkpoint before its upload."),
            "storeCredentialsSecret": store_credentials("uri"),
        }),
    "text2img": Object(
        description="The text-to-image DDM's training (dataset coloured-mnist): tokenizer, "
                    "VAE, CLIP, partition, latents, then one expert per cluster, the router "
                    "network and its text prior at once, and the import the DDMDeployment "
                    "serves.",
        properties={
            "clusters": Integer(
                description="k of the partition (k-means on CLIP's image embeddings): one "
                            f"expert per cluster (default {TEXT2IMG_CLUSTERS}).",
                minimum=2, maximum=MAX_KMEANS),
            "size": String(description="The networks' size (smoke: tests).",
                           choices=TEXT2IMG_SIZES, default=TEXT2IMG_SIZES[0]),
            "steps": Object(
                description="Steps of each trained stage (defaults: "
                            + ", ".join(f"{k} {v}" for k, v in TEXT2IMG_STEPS.items())
                            + ").",
                properties={stage: Integer(minimum=1, maximum=MAX_TRAIN_STEPS)
                            for stage in TEXT2IMG_STEPS}),
        }),
    "partition": Object(
        description="labelGroups: expert i learns the labels of group i; or kmeans: clusters of "
                    "image features fitted once (ddm partition fit) before the experts start.",
        one_of=(("labelGroups",), ("kmeans",)), properties={
            "labelGroups": Array(
                Array(Integer(minimum=0, maximum=MAX_CLASS), min_items=1),
                min_items=1, max_items=MAX_EXPERTS),
            "kmeans": Object(required=("clusters", "imageSize"), properties={
                "clusters": Integer(minimum=1, maximum=MAX_KMEANS),
                "features": String(choices=FEATURES, default=FEATURES[0]),
                "imageSize": Integer(description="The experts' image side (their model's).",
                                     minimum=MIN_IMAGE_SIZE, maximum=MAX_IMAGE_SIZE),
                "seed": SEED,
            }),
        }),
    "experts": Array(
        Object(required=("name",), properties={
            "name": MEMBER_NAME.described("The expert's name in the DDMDeployment."),
            "framework": FRAMEWORK,
            "model": String(
                description="A named UNet config (digits-small, mnist-small, reference).",
                min_length=1, max_length=MAX_MODEL_CONFIG_LENGTH, pattern=MODEL_CONFIG_PATTERN,
                default=DEFAULT_MODEL_CONFIG),
            **TRAIN_FIELDS,
            **WORKER_FIELDS,
        }),
        description="One entry per part of the partition, in its order.",
        min_items=1, max_items=MAX_EXPERTS),
    "router": Object(
        description="The router network's training (beside the experts: it reads the data "
                    "and the partition); PyTorch.",
        properties={
            **TRAIN_FIELDS,
            "useLabels": Boolean(description="Whether the router also sees the label (default "
                                             "true)."),
            **WORKER_FIELDS,
        }),
    "deployment": Object(
        description="The DDMDeployment created once every job has finished; its experts' "
                    "checkpoints, frameworks and classes and its router's checkpoint are the "
                    "outputs. Deleting the DDMTraining keeps it.",
        required=("name",), properties={
            "name": String(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN),
            "spec": Object(
                description="A DDMDeployment's spec less what the outputs decide; an experts[] "
                            "entry (by name) adds serving settings (replicas, accelerator, "
                            "resources).",
                preserve_unknown=True),
        }),
})

# -- The status the operator writes (``ddm.operator.training_status``) -------------------------
#: What ``status.phase`` says, in the order a training goes through them
#: (``ddm.operator.training_status`` decides it).
TRAINING_PHASES = ("Pending", "Fetching", "Partitioning", "Training", "Succeeded", "Failed")
EXPERTS_DONE = "experts whose job has finished / experts"
STATUS = Object(preserve_unknown=True, properties={
    "phase": String(choices=TRAINING_PHASES),
    "expertsDone": String(description=EXPERTS_DONE),
    "observedGeneration": Integer(format="int64"),
    "conditions": Array(Object(preserve_unknown=True)),
})

DDM_TRAINING = CustomResource(
    group=GROUP, version=VERSION, kind=KIND, plural=PLURAL, short_names=("ddmt",),
    labels=LABELS,
    root=Object(required=("spec",), properties={
        "apiVersion": String(),
        "kind": String(),
        "metadata": Object(),
        "spec": SPEC,
        "status": STATUS,
    }),
    columns=(
        Column("Engine", ".spec.engine"),
        Column("Phase", ".status.phase"),
        Column("Experts", ".status.expertsDone", description=EXPERTS_DONE),
        Column("Steps", ".status.steps.done", type="integer",
               description="training steps done in all (of status.steps.asked), as the jobs "
                           "log them"),
        Column("Age", ".metadata.creationTimestamp", type="date"),
    ),
    comment=f"The {KIND} custom resource ({API_VERSION}): how one Decentralized Diffusion\n"
            "Model is trained, as a plan of jobs (a partition, one job per expert, the router\n"
            "network) whose outputs become a DDMDeployment's checkpoints. Generated by\n"
            "scripts/generate_crds.py (make generate) from the declarations in\n"
            "src/ddm/deploy/training_crd.py: edit those, not this file.",
)
