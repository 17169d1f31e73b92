"""The DDMTraining spec as frozen dataclasses: how a DDM is trained, read and checked once.

A DDMTraining names the data, where the checkpoints go, how the data are partitioned, one
entry per expert (each on its own accelerator, nodes and processes), the router network's
training, and the DDMDeployment to create from the outputs. ``ddm.deploy.training_plan``
turns it into jobs; the operator and ``ddm train-all`` carry them out. As for a DDMDeployment
(``ddm.deploy.spec``), every problem is reported at once with its field path, and the
accelerator rules are the serving ones (``ddm.deploy.accelerators``). The output root's layout
and the DDMDeployment its outputs make (:func:`deployment_document`) live here too: that
DDMDeployment is checked, as the operator would check it, when the spec is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ddm.checkpoints.uri import (
    ABSOLUTE_PATH,
    BUCKET_SCHEMES,
    BUCKET_URI,
    CLAIM_URI,
    CheckpointSource,
    archive_uri,
    parse_checkpoint,
    redact_uri,
)
from ddm.deploy.accelerators import Accelerator
from ddm.deploy.fields import FieldReader
from ddm.deploy.imported import DECODER_DIR, TEXT_ENCODER_DIR, expert_dir
from ddm.deploy.imported import ROUTER_DIR as IMPORTED_ROUTER_DIR
from ddm.deploy.limits import DEFAULT_FRAMEWORK, FRAMEWORKS, MAX_CLASS, MAX_EXPERTS
from ddm.deploy.pod_options import (
    IMAGE_PATTERN,
    MAX_IMAGE_LENGTH,
    MAX_LABEL_VALUE_LENGTH,
    PodOptions,
    parse_pod_options,
)
from ddm.deploy.spec import API_VERSION as DEPLOYMENT_API_VERSION
from ddm.deploy.spec import KIND as DEPLOYMENT_KIND
from ddm.deploy.spec import (
    EXPERT_NAME_PATTERN,
    GROUP,
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    VERSION,
    Manifest,
    SecretKey,
    SpecError,
    parse_manifest,
    read_accelerator,
    read_identity,
    read_secret_key,
    read_unit_name,
    report_node_label_conflicts,
)
from ddm.deploy.strict_yaml import load_yaml

KIND = "DDMTraining"
PLURAL = "ddmtrainings"
API_VERSION = f"{GROUP}/{VERSION}"
#: ``job``: a batch/v1 Job per job (one node; torchrun --standalone inside), which every cluster
#: has; ``kubeflow-trainer``: a Kubeflow Trainer v2 TrainJob (many nodes; Kueue may queue it).
#: The first of these choices (and of the two below) is the default.
ENGINES = ("job", "kubeflow-trainer")
#: ``digits``: embedded in the package; ``mnist``: the four IDX files on a volume or in a store;
#: ``coloured-mnist``: the same files, coloured and captioned (``ddm.data.colored_mnist``), from
#: which the text-to-image DDM is trained (:class:`Text2ImgTraining`).
DATASETS = ("digits", "mnist", "coloured-mnist")
TEXT2IMG_DATASET = "coloured-mnist"
#: The text-to-image networks' sizes (``ddm.models.text2img.SIZES``; a test pins them equal).
TEXT2IMG_SIZES = ("small", "smoke")
#: ``ddm train text2img``'s default steps per trained stage (its home: the trainer reads them
#: here, ``ddm.training.text2img.commands.DEFAULTS``), and clusters of its partition.
TEXT2IMG_STEPS = {"clip": 2000, "vae": 3000, "expert": 3000, "router": 1500}
TEXT2IMG_CLUSTERS = 4
#: What ``ddm partition fit`` clusters (``ddm.data.features``).
FEATURES = ("hog", "pixels")
#: Where the data and the outputs may live: a claim, or a host path (local runs, dev clusters);
#: the URIs of those schemes (``parse_checkpoint`` reads them).
VOLUME_SCHEMES = ("pvc", "file")
VOLUME_URI_PATTERN = rf"^({CLAIM_URI}|file://{ABSOLUTE_PATH})$"
#: The data and the output may also be in an object store: the data fetched once by a first
#: job (``ddm fetch-data``), each checkpoint uploaded by its job (``--upload``).
STORE_URI_PATTERN = rf"^({CLAIM_URI}|file://{ABSOLUTE_PATH}|{BUCKET_URI})$"
#: A named UNet config (``ddm.models.config.UNET_CONFIGS``, checked by the trainer).
MODEL_CONFIG_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_MODEL_CONFIG_LENGTH = 63
DEFAULT_MODEL_CONFIG = "digits-small"
#: A Kueue LocalQueue's name, which its jobs carry as a label value.
QUEUE_PATTERN = EXPERT_NAME_PATTERN
MAX_QUEUE_LENGTH = MAX_LABEL_VALUE_LENGTH
MAX_NODES = 64
MAX_PROCESSES_PER_NODE = 64
MAX_TRAIN_STEPS = 10_000_000
MAX_BATCH_SIZE = 1 << 16
MAX_SEED = 2**31 - 1
MAX_KMEANS = MAX_EXPERTS
MIN_IMAGE_SIZE = 4
MAX_IMAGE_SIZE = 1024
MIN_LEARNING_RATE = 1e-8
MAX_LEARNING_RATE = 10.0
#: ``ddm train``'s defaults (``ddm.training.cli``); a spec that leaves a setting out gets these.
EXPERT_DEFAULTS = {"steps": 1500, "batchSize": 128, "learningRate": 2e-3}
ROUTER_DEFAULTS = {"steps": 1500, "batchSize": 256, "learningRate": 2e-3}
SAVE_EVERY = 500
#: The output root's layout: what each job writes there (the plan's jobs, the operator and
#: ``ddm train-all`` share it).
PARTITION_FILE = "partition.json"
EXPERTS_DIR = "experts"
ROUTER_DIR = "router"
#: Where the data job puts MNIST fetched from a store (``spec.data.uri`` s3:// or gs://).
DATA_DIR = "data"
#: The text-to-image DDM's training writes its stages at the root (as
#: scripts/train_text2img.sh does), and the DDM that serves (``ddm import text2img``) here.
TEXT2IMG_DDM_DIR = "ddm"
#: Where a trainer writing OUT keeps its training state (``ddm.training.resume``).
STATE_SUFFIX = ".training"


@dataclass(frozen=True)
class DataSource:
    """The images every job reads: ``digits`` (in the image), or ``mnist`` on ``volume`` or
    in ``store`` (fetched once into the output volume, signed with ``store_credentials``
    or the cloud's chain)."""

    dataset: str = "digits"
    volume: CheckpointSource | None = None
    store: CheckpointSource | None = None
    store_credentials: SecretKey | None = None


@dataclass(frozen=True)
class PartitionSpec:
    """``label_groups``: expert ``i`` learns the labels of group ``i``; else ``kmeans``
    clusters of ``features`` fitted once (``ddm partition fit``) at ``image_size``."""

    label_groups: tuple[tuple[int, ...], ...] = ()
    kmeans: int = 0
    features: str = "hog"
    image_size: int = 0
    seed: int = 0

    @property
    def fitted(self) -> bool:
        """Whether a job fits it (k-means) before the experts start."""
        return self.kmeans > 0

    @property
    def parts(self) -> int:
        return self.kmeans or len(self.label_groups)


@dataclass(frozen=True)
class TrainSettings:
    """One job's optimisation: ``batch_size`` is the global batch (every process shares it)."""

    steps: int
    batch_size: int
    learning_rate: float
    seed: int = 0
    save_every: int = SAVE_EVERY


@dataclass(frozen=True)
class Workers:
    """Where one job runs: ``nodes`` pods (or hosts), ``processes_per_node`` training processes
    in each, every pod with ``accelerator`` and the pod settings ``pod``."""

    accelerator: Accelerator = Accelerator()
    nodes: int = 1
    processes_per_node: int = 1
    pod: PodOptions = PodOptions()

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


@dataclass(frozen=True)
class ExpertTraining:
    """One expert: it learns part ``index`` of the partition (its place in ``spec.experts``)."""

    name: str
    framework: str
    model: str
    index: int
    train: TrainSettings
    workers: Workers


@dataclass(frozen=True)
class RouterTraining:
    """The router network: p(part | x_t, t[, label]) over the experts' parts."""

    train: TrainSettings = TrainSettings(ROUTER_DEFAULTS["steps"], ROUTER_DEFAULTS["batchSize"],
                                         ROUTER_DEFAULTS["learningRate"])
    workers: Workers = Workers()
    use_labels: bool = True


@dataclass(frozen=True)
class Text2ImgTraining:
    """The text-to-image DDM of coloured MNIST: ``clusters``, the partition's k (k-means on
    the CLIP image embeddings it trains), one expert per cluster; ``size``, the networks'
    size; ``steps``, (stage, steps) of each trained stage (clip, vae, expert, router)."""

    clusters: int = TEXT2IMG_CLUSTERS
    size: str = TEXT2IMG_SIZES[0]
    steps: tuple[tuple[str, int], ...] = tuple(TEXT2IMG_STEPS.items())

    def steps_of(self, stage: str) -> int:
        return dict(self.steps)[stage]


@dataclass(frozen=True)
class DeploymentTemplate:
    """The DDMDeployment to create once every job has finished: ``name``, and ``spec`` as a
    DDMDeployment's, less what the outputs decide (each expert's checkpoint, framework and
    classes, the router's checkpoint); an expert entry there (by name) adds serving settings."""

    name: str
    spec: Mapping[str, Any]


@dataclass(frozen=True)
class TrainingSpec:
    """A validated DDMTraining spec; ``experts`` in partition order. ``queue``: the Kueue
    LocalQueue its jobs are submitted to (None: not queued). ``output``: where the
    checkpoints end up, a volume or a store; with a store, ``state`` is the volume the jobs
    work on (training states, the partition, fetched data, checkpoints before upload) and
    ``output_credentials`` the store's credentials file (None: the cloud's chain).
    ``text2img``: the text-to-image DDM's training (``dataset: coloured-mnist``; its experts
    are its clusters, so ``partition`` and ``experts`` are then empty)."""

    engine: str
    data: DataSource
    output: CheckpointSource
    partition: PartitionSpec
    experts: tuple[ExpertTraining, ...]
    router: RouterTraining
    deployment: DeploymentTemplate
    image: str | None = None
    queue: str | None = None
    state: CheckpointSource | None = None
    output_credentials: SecretKey | None = None
    text2img: Text2ImgTraining | None = None

    @property
    def work(self) -> CheckpointSource:
        """The volume every job reads and writes under (the output root's layout)."""
        return self.state or self.output

    @property
    def uploads(self) -> bool:
        """Whether each checkpoint is uploaded to a store once trained."""
        return self.output.scheme in BUCKET_SCHEMES


#: A DDMTraining read from a file.
TrainingManifest = Manifest[TrainingSpec]


def parse_training_spec(raw: Any, *, allow_host_paths: bool = False) -> TrainingSpec:
    """A checked ``TrainingSpec`` from a DDMTraining's ``spec``; raises ``SpecError``.
    ``allow_host_paths`` accepts file:// data and outputs (local runs, development clusters)."""
    problems: list[str] = []
    reader = FieldReader(raw, "spec", problems)
    engine = reader.string("engine", ENGINES[0], choices=ENGINES) or ENGINES[0]
    image = reader.string("image", None, pattern=IMAGE_PATTERN, max_length=MAX_IMAGE_LENGTH,
                          hint="an image reference such as registry.example.com/ddm:1.0")
    data = _data(reader.child("data"), allow_host_paths)
    output, state, output_credentials = _output(reader.child("output"), allow_host_paths)
    text2img, raw_experts = None, []
    if data.dataset == TEXT2IMG_DATASET:
        text2img = _text2img(reader.child("text2img"))
        if output is not None and output.scheme in BUCKET_SCHEMES:
            reader.problem("output.uri", f"not a store for dataset {TEXT2IMG_DATASET}: its "
                                         "DDM is imported (ddm import text2img) on a volume "
                                         "and served from there; give pvc://CLAIM/PATH")
        for key in ("partition", "experts", "router"):
            if reader.has(key):
                reader.value(key)
                reader.problem(key, f"not for dataset {TEXT2IMG_DATASET}: its experts are the "
                                    "clusters of spec.text2img.clusters, each trained alone, "
                                    "and its router is trained beside them")
        partition, experts = PartitionSpec(), ()
        router = RouterTraining()  # the text2img router stage's settings are its own
    else:
        if reader.has("text2img"):
            reader.value("text2img")
            reader.problem("text2img", f"only for dataset: {TEXT2IMG_DATASET}")
        partition = _partition(reader.child("partition"))
        raw_experts = reader.items("experts")
        if not 1 <= len(raw_experts) <= MAX_EXPERTS:
            reader.problem("experts",
                           f"must list 1..{MAX_EXPERTS} experts, got {len(raw_experts)}")
        experts = tuple(e for i, item in enumerate(raw_experts)
                        if (e := _expert(FieldReader(item, f"spec.experts[{i}]", problems), i)))
        router = _router(reader.child("router"))
    deployment = _deployment(reader.child("deployment"))
    queue = reader.string("queue", None, pattern=QUEUE_PATTERN, max_length=MAX_QUEUE_LENGTH,
                          hint="a Kueue LocalQueue's name")
    reader.done()
    spec = TrainingSpec(engine=engine, data=data, output=output,  # type: ignore[arg-type]
                        partition=partition, experts=experts, router=router,
                        deployment=deployment, image=image, queue=queue, state=state,
                        output_credentials=output_credentials, text2img=text2img)
    if not problems:
        problems.extend(deployment_problems(spec) if text2img else
                        _semantic_problems(spec, len(raw_experts)))
    if problems:
        raise SpecError(problems)
    return spec


def _volume(reader: FieldReader, key: str, allow_host_paths: bool, *, stores: bool = False
            ) -> CheckpointSource | None:
    """``pvc://CLAIM/PATH`` (or, allowed, ``file:///PATH``; with ``stores``, also
    ``s3://BUCKET/PREFIX`` or ``gs://BUCKET/PREFIX``) at ``key``, which is required."""
    uri = reader.value(key)
    store_hint = " or s3://BUCKET/PREFIX, gs://BUCKET/PREFIX" if stores else ""
    if uri is None:
        reader.problem(key, f"is required: pvc://CLAIM/PATH{store_hint}")
        return None
    try:
        source = parse_checkpoint(uri)
    except ValueError as error:
        reader.problem(key, str(error))
        return None
    schemes = (*(VOLUME_SCHEMES if allow_host_paths else ("pvc",)),
               *(BUCKET_SCHEMES if stores else ()))
    if source.scheme not in schemes:
        reader.problem(key, f"{redact_uri(uri)!r}: must be pvc://CLAIM/PATH{store_hint}"
                            + (" or file:///PATH" if allow_host_paths else
                               " (file:// is a host path, which this operator does not allow)"))
        return None
    return source


def _store_credentials(reader: FieldReader, source: CheckpointSource | None, where: str
                       ) -> SecretKey | None:
    """``storeCredentialsSecret``, only beside a store's URI in ``where``."""
    if not reader.has("storeCredentialsSecret"):
        return None
    if source is not None and source.scheme not in BUCKET_SCHEMES:
        reader.problem("storeCredentialsSecret", f"only for a store: {where} is not s3:// "
                                                 "or gs://")
    return read_secret_key(reader.child("storeCredentialsSecret"))


def _output(reader: FieldReader, allow_host_paths: bool
            ) -> tuple[CheckpointSource | None, CheckpointSource | None, SecretKey | None]:
    """``uri`` (a volume or a store), ``volume`` (the jobs' working volume, required with a
    store and only then) and the store's ``storeCredentialsSecret``."""
    output = _volume(reader, "uri", allow_host_paths, stores=True)
    store = output is not None and output.scheme in BUCKET_SCHEMES
    state = _volume(reader, "volume", allow_host_paths) if reader.has("volume") else None
    if reader.has("volume"):
        if output is not None and not store:
            reader.problem("volume", "only with a store in spec.output.uri: the jobs work and "
                                     "keep their training state in spec.output.uri itself")
            state = None
    elif store:
        reader.problem("volume", "is required when spec.output.uri is a store: "
                                 "pvc://CLAIM/PATH, the volume where the jobs keep their "
                                 "training state (a retried job resumes from it) and write "
                                 "each checkpoint before uploading it")
    credentials = _store_credentials(reader, output, "spec.output.uri")
    reader.done()
    return output, state, credentials


def _data(reader: FieldReader, allow_host_paths: bool) -> DataSource:
    dataset = reader.string("dataset", DATASETS[0], choices=DATASETS) or DATASETS[0]
    source = None
    if dataset != "digits":
        source = _volume(reader, "uri", allow_host_paths, stores=True)
    elif reader.has("uri"):
        reader.problem("uri", "not for dataset: digits (they are in the image)")
    credentials = _store_credentials(reader, source, "spec.data.uri")
    reader.done()
    store = source is not None and source.scheme in BUCKET_SCHEMES
    return DataSource(dataset, None if store else source, source if store else None,
                      credentials)


def _partition(reader: FieldReader) -> PartitionSpec:
    groups = reader.items("labelGroups")
    kmeans = reader.child("kmeans") if reader.has("kmeans") else None
    reader.done()
    if bool(groups) == (kmeans is not None):
        reader.problem("labelGroups", "give labelGroups or kmeans (one of them)")
        return PartitionSpec()
    if kmeans is None:
        if not all(isinstance(g, list) and g and all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_CLASS
                for c in g) for g in groups):
            reader.problem("labelGroups", f"must be non-empty lists of labels in 0..{MAX_CLASS}, "
                                          f"got {groups}")
            return PartitionSpec()
        labels = [c for g in groups for c in g]
        if len(set(labels)) != len(labels):
            reader.problem("labelGroups", f"a label is in two groups: {groups}")
        return PartitionSpec(label_groups=tuple(tuple(g) for g in groups))
    partition = PartitionSpec(
        kmeans=kmeans.integer("clusters", 0, 1, MAX_KMEANS) or 0,
        features=kmeans.string("features", FEATURES[0], choices=FEATURES) or FEATURES[0],
        image_size=kmeans.integer("imageSize", 0, MIN_IMAGE_SIZE, MAX_IMAGE_SIZE) or 0,
        seed=kmeans.integer("seed", 0, 0, MAX_SEED) or 0)
    for key in ("clusters", "imageSize"):
        if not kmeans.has(key):
            kmeans.problem(key, "is required" + (" (the experts' image side)"
                                                 if key == "imageSize" else ""))
    kmeans.done()
    return partition


def _train(reader: FieldReader, defaults: Mapping[str, Any]) -> TrainSettings:
    return TrainSettings(
        steps=reader.integer("steps", defaults["steps"], 1, MAX_TRAIN_STEPS) or 1,
        batch_size=reader.integer("batchSize", defaults["batchSize"], 1, MAX_BATCH_SIZE) or 1,
        learning_rate=reader.number("learningRate", defaults["learningRate"],
                                    MIN_LEARNING_RATE, MAX_LEARNING_RATE)
        or defaults["learningRate"],
        seed=reader.integer("seed", 0, 0, MAX_SEED) or 0,
        save_every=reader.integer("saveEvery", SAVE_EVERY, 1, MAX_TRAIN_STEPS) or SAVE_EVERY)


def _workers(reader: FieldReader, framework: str) -> Workers:
    """``accelerator`` (as a DDMDeployment's), ``nodes``, ``processesPerNode`` and the pod
    settings; PyTorch on GPUs defaults to a process per GPU, anything else to one."""
    accelerator, accelerator_ok = read_accelerator(reader, framework)
    pod = parse_pod_options(reader)
    if accelerator_ok:
        report_node_label_conflicts(reader, accelerator, pod)
    # torchrun: one process per GPU; a JAX process drives all its node's devices.
    per_device = framework == "torch" and accelerator.type == "nvidia"
    return Workers(accelerator=accelerator,
                   nodes=reader.integer("nodes", 1, 1, MAX_NODES) or 1,
                   processes_per_node=reader.integer(
                       "processesPerNode", accelerator.count if per_device else 1, 1,
                       MAX_PROCESSES_PER_NODE) or 1,
                   pod=pod)


def _expert(reader: FieldReader, index: int) -> ExpertTraining | None:
    name = read_unit_name(reader)
    framework = (reader.string("framework", DEFAULT_FRAMEWORK, choices=FRAMEWORKS)
                 or DEFAULT_FRAMEWORK)
    expert = ExpertTraining(
        name=name or "", framework=framework,
        model=reader.string("model", DEFAULT_MODEL_CONFIG, pattern=MODEL_CONFIG_PATTERN,
                            max_length=MAX_MODEL_CONFIG_LENGTH,
                            hint="a named UNet config, e.g. digits-small")
        or DEFAULT_MODEL_CONFIG,
        index=index, train=_train(reader, EXPERT_DEFAULTS), workers=_workers(reader, framework))
    reader.done()
    return expert if name else None


def _router(reader: FieldReader) -> RouterTraining:
    router = RouterTraining(train=_train(reader, ROUTER_DEFAULTS),
                            workers=_workers(reader, "torch"),
                            use_labels=_boolean(reader, "useLabels", True))
    reader.done()
    return router


def _boolean(reader: FieldReader, key: str, default: bool) -> bool:
    value = reader.value(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        reader.problem(key, f"must be true or false, got {value!r}")
        return default
    return value


def _text2img(reader: FieldReader) -> Text2ImgTraining:
    """``clusters``, ``size`` and ``steps`` (per trained stage; the trainer's defaults)."""
    steps_reader = reader.child("steps")
    steps = tuple((stage, steps_reader.integer(stage, default, 1, MAX_TRAIN_STEPS) or default)
                  for stage, default in TEXT2IMG_STEPS.items())
    steps_reader.done()
    text2img = Text2ImgTraining(
        clusters=reader.integer("clusters", TEXT2IMG_CLUSTERS, 2, MAX_KMEANS)
        or TEXT2IMG_CLUSTERS,
        size=reader.string("size", TEXT2IMG_SIZES[0], choices=TEXT2IMG_SIZES)
        or TEXT2IMG_SIZES[0],
        steps=steps)
    reader.done()
    return text2img


def _deployment(reader: FieldReader) -> DeploymentTemplate:
    name = reader.string("name", None, pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH,
                         hint="a DNS-1035 label: a lower-case letter, then letters, digits "
                              "and '-'")
    if not reader.has("name"):
        reader.problem("name", "is required: the DDMDeployment to create")
    spec = reader.mapping("spec") or {}
    reader.done()
    return DeploymentTemplate(name or "", spec)


def _semantic_problems(spec: TrainingSpec, listed: int) -> list[str]:
    """Rules across fields: experts against parts, engines against nodes and processes, and
    the DDMDeployment the outputs make (checked as the operator would check it)."""
    found: list[str] = []
    names = [e.name for e in spec.experts]
    for name in sorted({n for n in names if names.count(n) > 1}):
        found.append(f"spec.experts: the name {name!r} is used more than once")
    if spec.partition.parts != listed:
        found.append(f"spec.experts: lists {listed} experts but spec.partition has "
                     f"{spec.partition.parts} parts (expert i learns part i)")
    jobs = [(f"spec.experts[{e.index}]", e.framework, e.train, e.workers)
            for e in spec.experts]
    for path, framework, train, workers in [
            *jobs, ("spec.router", "torch", spec.router.train, spec.router.workers)]:
        found.extend(_placement_problems(spec.engine, path, framework, workers))
        if train.batch_size % workers.world_size:
            found.append(f"{path}.batchSize: {train.batch_size} is not a multiple of the "
                         f"{workers.world_size} processes that share each batch")
    if not found:
        found.extend(deployment_problems(spec))
    return found


def _placement_problems(engine: str, path: str, framework: str, workers: Workers
                        ) -> list[str]:
    """What an engine cannot run: a Job is one pod; devices are shared equally between a
    node's processes."""
    found = []
    if engine == "job" and workers.nodes > 1:
        found.append(f"{path}.nodes: a Job runs on one node; use engine: kubeflow-trainer for "
                     f"{workers.nodes} nodes")
    count = workers.accelerator.count
    if count and count % workers.processes_per_node:
        found.append(f"{path}.processesPerNode: {workers.processes_per_node} processes cannot "
                     f"share {count} devices equally")
    if workers.accelerator.declared.train_device(framework) == "xla" and workers.world_size > 1:
        found.append(f"{path}: PyTorch on {workers.accelerator.type} trains as one process for "
                     "now (--device xla is not data-parallel yet): set nodes and "
                     "processesPerNode to 1")
    return found


#: What the outputs decide in the DDMDeployment: an expert entry in spec.deployment.spec may
#: not give these (a text-to-image expert's framework is a serving choice: both load it).
DECIDED_EXPERT_FIELDS = ("checkpoint", "framework", "classes")
TEXT2IMG_DECIDED_EXPERT_FIELDS = ("checkpoint",)
#: The text-to-image stages besides the experts whose checkpoints the outputs decide, by
#: their DDMDeployment field, and their directories in the imported DDM.
TEXT2IMG_STAGES = {"textEncoder": TEXT_ENCODER_DIR, "decoder": DECODER_DIR}


def expert_names(spec: TrainingSpec) -> tuple[str, ...]:
    """The experts of the DDMDeployment the outputs make, in partition order."""
    if spec.text2img:
        return tuple(f"expert-{k}" for k in range(spec.text2img.clusters))
    return tuple(e.name for e in spec.experts)


def output_checkpoint(spec: TrainingSpec, relative: str, output_uri: str | None = None,
                      sha256: str | None = None) -> dict[str, Any]:
    """The DDMDeployment's ``checkpoint`` of the job output ``relative`` (``experts/NAME``,
    ``router``) under the output root (``output_uri``: another name for it, default
    ``spec.output``'s URI): in a store, the archive its job uploaded, pinned by ``sha256``
    when known and read with the training's store credentials."""
    uri = f"{(output_uri or spec.output.uri).rstrip('/')}/{relative}"
    if not spec.uploads:
        return {"uri": uri}
    credentials = spec.output_credentials
    return {"uri": archive_uri(uri), **({"sha256": sha256} if sha256 else {}),
            **({"storeCredentialsSecret": {"name": credentials.name, "key": credentials.key}}
               if credentials else {})}


def deployment_document(spec: TrainingSpec, output_uri: str | None = None,
                        sha256s: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The DDMDeployment to create once every job has finished: ``spec.deployment.spec`` with
    each expert's checkpoint (and, of our UNets, framework and classes, the label groups),
    the router network's checkpoint and, for the text-to-image DDM, its text encoder's and
    decoder's in its imported DDM (:func:`output_checkpoint`; ``sha256s``: the uploaded
    archives' by output, ``experts/NAME`` and ``router``)."""
    sha256s = sha256s or {}

    def checkpoint(relative: str) -> dict[str, Any]:
        return output_checkpoint(spec, relative, output_uri, sha256s.get(relative))

    template = copy.deepcopy(dict(spec.deployment.spec))
    given = {e.get("name"): e for e in template.get("experts") or []
             if isinstance(e, Mapping)}
    router = dict(template.get("router") or {})
    if spec.text2img:
        experts = [{"name": name, "framework": DEFAULT_FRAMEWORK, **dict(given.get(name, {})),
                    "checkpoint": checkpoint(f"{TEXT2IMG_DDM_DIR}/{expert_dir(k)}")}
                   for k, name in enumerate(expert_names(spec))]
        stages = {key: {**dict(template.get(key) or {}),
                        "checkpoint": checkpoint(f"{TEXT2IMG_DDM_DIR}/{directory}")}
                  for key, directory in TEXT2IMG_STAGES.items()}
        router["checkpoint"] = checkpoint(f"{TEXT2IMG_DDM_DIR}/{IMPORTED_ROUTER_DIR}")
        template.update(conditioning="text", **stages)
    else:
        experts = []
        for expert in spec.experts:
            entry = {"name": expert.name, **dict(given.get(expert.name, {})),
                     "framework": expert.framework,
                     "checkpoint": checkpoint(f"{EXPERTS_DIR}/{expert.name}")}
            if spec.partition.label_groups:
                entry["classes"] = list(spec.partition.label_groups[expert.index])
            experts.append(entry)
        router["checkpoint"] = checkpoint(ROUTER_DIR)
    return {"apiVersion": DEPLOYMENT_API_VERSION, "kind": DEPLOYMENT_KIND,
            "metadata": {"name": spec.deployment.name},
            "spec": {**template, "experts": experts, "router": router}}


def deployment_problems(spec: TrainingSpec) -> list[str]:
    """Why the DDMDeployment the outputs make would be refused, with paths under
    ``spec.deployment.spec``."""
    found = []
    names = expert_names(spec)
    decided = TEXT2IMG_DECIDED_EXPERT_FIELDS if spec.text2img else DECIDED_EXPERT_FIELDS
    for i, entry in enumerate(spec.deployment.spec.get("experts") or []):
        path = f"spec.deployment.spec.experts[{i}]"
        if not isinstance(entry, Mapping) or entry.get("name") not in names:
            found.append(f"{path}.name: must name one of the experts ({', '.join(names)})")
            continue
        found.extend(f"{path}.{key}: decided by the training (its output)"
                     for key in decided if key in entry)
    stages = ("router", *TEXT2IMG_STAGES) if spec.text2img else ("router",)
    for stage in stages:
        if "checkpoint" in (spec.deployment.spec.get(stage) or {}):
            found.append(f"spec.deployment.spec.{stage}.checkpoint: decided by the training "
                         "(its output)")
    if spec.text2img and spec.deployment.spec.get("conditioning", "text") != "text":
        found.append("spec.deployment.spec.conditioning: the text-to-image DDM is conditioned "
                     "on text")
    if found:
        return found
    try:
        parse_manifest(deployment_document(spec), allow_host_paths=True)
    except SpecError as error:
        found.extend(p.replace("spec.", "spec.deployment.spec.", 1) if p.startswith("spec.")
                     else f"spec.deployment: {p}" for p in error.problems)
    return found


def parse_training_manifest(document: Any, *, allow_host_paths: bool = False
                            ) -> TrainingManifest:
    """A whole ``kind: DDMTraining`` document (as read from YAML); raises ``SpecError``."""
    problems: list[str] = []
    name, namespace = read_identity(document, KIND, problems)
    spec = None
    try:
        spec = parse_training_spec(document.get("spec") if isinstance(document, Mapping)
                                   else None, allow_host_paths=allow_host_paths)
    except SpecError as error:
        problems.extend(error.problems)
    if problems or spec is None:
        raise SpecError([p.removeprefix("document.") for p in problems])
    return TrainingManifest(name=name or "", namespace=namespace, spec=spec)


def load_training_manifest(path: str | Path, *, allow_host_paths: bool = True
                           ) -> TrainingManifest:
    """Read one DDMTraining from a YAML file (strict: a key given twice is an error naming
    its line and column)."""
    try:
        document = load_yaml(Path(path).read_bytes(), str(path))
    except yaml.YAMLError as error:
        raise SpecError([f"{path}: not valid YAML: {error}"]) from None
    return parse_training_manifest(document, allow_host_paths=allow_host_paths)
