"""One training plan: a DDMTraining spec -> its jobs (pure, no I/O, no ML imports).

A DDMTraining is a plan of jobs whose outputs become a DDMDeployment's checkpoints:

- ``data`` (MNIST in an object store only): ``ddm fetch-data`` copies it once to ``data/``
  in the output volume, which every later job reads;
- ``partition`` (k-means partitions only): ``ddm partition fit`` writes ``partition.json``
  (one CPU process, with no placement of its own);
- ``expert-NAME``, one per expert, in parallel after the partition: ``ddm train expert`` on
  its part, writing ``experts/NAME`` (its training state in ``experts/NAME.training``);
- ``router``: ``ddm train router`` on the partition the experts train on, writing
  ``router``, beside the experts (it needs only the data and the partition; it is given
  every distinct UNet config of the experts, and refuses configs whose image shape or classes
  disagree: a DDM's experts share one). ``ddm train-all`` checks
  the outputs share one partition before writing the DDMDeployment; the router checks it
  again when it serves them.

With a store as the output (``spec.output.uri`` s3:// or gs://), the jobs work on
``spec.output.volume`` exactly as above, and each expert and router job uploads its finished
checkpoint (``ddm train ... --upload``, ``ddm.checkpoints.upload``).

A coloured-MNIST DDMTraining (``spec.text2img``) plans the text-to-image DDM's stages instead
(:func:`_text2img_jobs`): tokenizer, VAE, CLIP, partition, latents, then its experts, router
network and text prior at once, and ``import`` (``ddm import text2img``), whose ``ddm/`` the
DDMDeployment serves (after the ``data`` job when its MNIST is in a store; its output is a
volume, never a store).

Every path is relative to the output root (``spec.output``); each job's arguments name the
root and the data through :class:`Paths`, which the place that runs it decides (mount paths in
a pod, directories here). Every expert and router job passes ``--resume``: a rerun continues
the state a killed job saved (none saved: it starts afresh). The engines are renderers of
these jobs: ``ddm.operator.training_manifests`` (Jobs, TrainJobs) and ``ddm.runtime.training``
(local processes, ``ddm train-all``); how processes start on one node is decided here once
(:meth:`JobPlan.node_processes`): torchrun ``--standalone`` for PyTorch, the JAX job's
variables for JAX, a plain process for a world of one.

Interface (stable; the operator's reconcile builds on it): ``plan_training(spec) ->
TrainingPlan``; ``TrainingPlan.jobs`` (``JobPlan``: ``name``, ``kind``, ``framework``,
``after``, ``output``, ``state``, ``finished_file``, ``steps``, ``workers``, ``expert``,
``upload``, ``reaches_store``, ``credentials_files``, ``args(paths)``,
``node_processes(...)``), ``TrainingPlan.ready(done)``; ``deployment_document(spec)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ddm.checkpoints.roles import ROUTER
from ddm.deploy.training_spec import (
    DATA_DIR,
    EXPERTS_DIR,
    PARTITION_FILE,
    ROUTER_DIR,
    STATE_SUFFIX,
    TEXT2IMG_DDM_DIR,
    ExpertTraining,
    Text2ImgTraining,
    TrainingSpec,
    Workers,
)
from ddm.deploy.imported import expert_dir
# Re-exported: part of this module's interface since it was first committed.
from ddm.deploy.training_spec import deployment_document as deployment_document
from ddm.deploy.training_spec import deployment_problems as deployment_problems

PARTITION_JOB = "partition"
DATA_JOB = "data"
ROUTER_JOB = "router"
#: What a job does (``JobPlan.kind``): fetch the data, fit the partition, train an expert or
#: the router network, or another stage of the text-to-image DDM.
DATA_KIND, PARTITION_KIND, EXPERT_KIND, ROUTER_KIND, STAGE_KIND = (
    "data", "partition", "expert", "router", "stage")
#: The kinds that train a network data-parallel: a TrainJob each under kubeflow-trainer, and
#: a condition each in the DDMTraining's status.
TRAINED_KINDS = (EXPERT_KIND, ROUTER_KIND)
#: The JAX job's variables (Kubeflow Trainer's jax-distributed runtime sets them; read by
#: ``ddm.training.distributed.jax_world``).
JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_OUTPUT, _DATA = "{output}", "{data}"
#: Stand for the store credentials files of the data and of the output (``Paths.credentials``).
_DATA_CREDENTIALS, _OUTPUT_CREDENTIALS = "{data-credentials}", "{output-credentials}"
#: The files' names there.
DATA_CREDENTIALS_FILE, OUTPUT_CREDENTIALS_FILE = "data", "output"
_CREDENTIALS_FLAG = "--store-credentials-file"
#: Seconds between the progress lines a training job logs (the operator's status reads them).
PROGRESS_LOG_S = 15


@dataclass(frozen=True)
class Paths:
    """Where a job's processes find the output root, the MNIST directory (None: digits or
    fetched into the output root) and the directory of the stores' credentials files
    (``DATA_CREDENTIALS_FILE``, ``OUTPUT_CREDENTIALS_FILE``, as the spec's
    ``storeCredentialsSecret``s give them; None: none mounted, the cloud's chain signs)."""

    output: str
    data: str | None = None
    credentials: str | None = None


@dataclass(frozen=True)
class Process:
    """One process to start: ``argv`` and the variables to add to its environment."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class JobPlan:
    """One job. ``kind``: one of data, partition, expert, router and stage (``*_KIND``);
    ``after``: the jobs that must have
    finished first; ``output``, ``state``: its checkpoint (or partition file) and its training
    state, relative to the output root (``state`` None: it saves none); ``steps``: the steps it
    trains (None: not a training); ``expert``: the expert's name (expert jobs); ``upload``:
    the store its checkpoint is uploaded to once trained (None: it stays on the volume);
    ``marker``: the file of its output directory written last (empty: the output, a file or
    a directory installed in one rename, is its own marker)."""

    name: str
    kind: str
    framework: str
    after: tuple[str, ...]
    output: str
    steps: int | None
    workers: Workers
    template: tuple[str, ...]
    expert: str | None = None
    upload: str | None = None
    marker: str = "config.json"

    @property
    def state(self) -> str | None:
        return self.output + STATE_SUFFIX if self.steps is not None else None

    @property
    def finished_file(self) -> str:
        """The path, relative to the output root, whose presence says the job has finished
        (its writer writes it last): ``marker`` in the output directory, or the output itself
        (``marker`` empty)."""
        return f"{self.output}/{self.marker}" if self.marker else self.output

    @property
    def reaches_store(self) -> bool:
        """Whether its processes reach an object store: the data job fetches the data, a job
        with ``upload`` uploads its checkpoint (the others read and write the volume alone)."""
        return self.kind == DATA_KIND or self.upload is not None

    @property
    def credentials_files(self) -> tuple[str, ...]:
        """The stores' credentials files its arguments name (``DATA_CREDENTIALS_FILE``,
        ``OUTPUT_CREDENTIALS_FILE``): the only ones its pods are given."""
        return tuple(name for stand, name in ((_DATA_CREDENTIALS, DATA_CREDENTIALS_FILE),
                                              (_OUTPUT_CREDENTIALS, OUTPUT_CREDENTIALS_FILE))
                     if stand in self.template)

    @property
    def distributed(self) -> bool:
        """Whether several processes train together (torchrun or the JAX variables)."""
        return self.workers.world_size > 1

    def args(self, paths: Paths) -> tuple[str, ...]:
        """``ddm``'s arguments for one process of this job."""
        args: list[str] = []
        for arg in self.template:
            if arg in (_DATA_CREDENTIALS, _OUTPUT_CREDENTIALS):
                if paths.credentials is None:  # nothing mounted: drop the flag too
                    assert args.pop() == _CREDENTIALS_FLAG, self.template
                    continue
                name = DATA_CREDENTIALS_FILE if arg == _DATA_CREDENTIALS \
                    else OUTPUT_CREDENTIALS_FILE
                args.append(f"{paths.credentials.rstrip('/')}/{name}")
                continue
            args.append(arg.replace(_OUTPUT, paths.output.rstrip("/") or "/")
                        .replace(_DATA, paths.data or ""))
        return tuple(args)

    def node_processes(self, paths: Paths, *, ddm: Sequence[str] = ("ddm",),
                       torchrun: Sequence[str] = ("torchrun",),
                       coordinator: str = "127.0.0.1:29500") -> tuple[Process, ...]:
        """The processes of this job on one node alone (a Job's pod, ``ddm train-all``):
        ``torchrun --standalone`` for a PyTorch world, one process per rank with the JAX
        variables (process 0 runs the coordinator at ``coordinator``) for JAX, else one."""
        args = self.args(paths)
        count = self.workers.processes_per_node
        if count == 1:
            return (Process((*ddm, *args)),)
        if self.framework == "jax":
            return tuple(Process((*ddm, *args), ((JAX_COORDINATOR, coordinator),
                                                 (JAX_NUM_PROCESSES, str(count)),
                                                 (JAX_PROCESS_ID, str(rank))))
                         for rank in range(count))
        return (Process((*torchrun, "--standalone", "--nproc-per-node", str(count), "-m",
                         "ddm", *args)),)


@dataclass(frozen=True)
class TrainingPlan:
    """Every job of a DDMTraining, in an order that respects ``after``."""

    jobs: tuple[JobPlan, ...]

    def job(self, name: str) -> JobPlan:
        return next(job for job in self.jobs if job.name == name)

    def ready(self, done: set[str] | frozenset[str]) -> tuple[JobPlan, ...]:
        """The jobs not in ``done`` whose every predecessor is."""
        return tuple(job for job in self.jobs
                     if job.name not in done and set(job.after) <= set(done))

    def members(self) -> tuple[list[str], dict[str, str]]:
        """The DDM its outputs make, as its root index (``ddm.checkpoints.index``) names it:
        the experts' output subfolders in partition order, and the router network's."""
        return ([job.output for job in self.jobs if job.kind == EXPERT_KIND],
                {ROUTER: job.output for job in self.jobs if job.kind == ROUTER_KIND})


def plan_training(spec: TrainingSpec) -> TrainingPlan:
    """The jobs of ``spec`` (validated by ``parse_training_spec``)."""
    jobs: list[JobPlan] = []
    first: tuple[str, ...] = ()
    mnist = _DATA
    store = spec.data.store
    if store is not None:
        mnist = f"{_OUTPUT}/{DATA_DIR}"
        jobs.append(JobPlan(
            name=DATA_JOB, kind=DATA_KIND, framework="numpy", after=(), output=DATA_DIR,
            steps=None, workers=Workers(), marker="",
            template=("fetch-data", store.uri, mnist,
                      *((_CREDENTIALS_FLAG, _DATA_CREDENTIALS)
                        if spec.data.store_credentials else ()))))
        first = (DATA_JOB,)
    if spec.text2img is not None:
        return TrainingPlan((*jobs, *_text2img_jobs(spec.text2img, spec.output.uri, mnist,
                                                    first)))
    data_arg = f"mnist:{mnist}" if spec.data.dataset == "mnist" else "digits"
    upload = _upload_args(spec)
    partition = spec.partition
    if partition.fitted:
        jobs.append(JobPlan(
            name=PARTITION_JOB, kind=PARTITION_KIND, framework="numpy", after=first,
            output=PARTITION_FILE, steps=None, workers=Workers(), marker="",
            template=("partition", "fit", "--data", data_arg, "--kmeans", str(partition.kmeans),
                      "--features", partition.features, "--image-size",
                      str(partition.image_size), "--seed", str(partition.seed),
                      "--out", f"{_OUTPUT}/{PARTITION_FILE}")))
        part_arg = f"file:{_OUTPUT}/{PARTITION_FILE}"
    else:
        part_arg = "labels:" + ";".join(",".join(map(str, g)) for g in partition.label_groups)
    after = (PARTITION_JOB,) if partition.fitted else first
    experts = [_expert_job(e, data_arg, part_arg, after, upload) for e in spec.experts]
    jobs.extend(experts)
    router = spec.router
    jobs.append(JobPlan(
        name=ROUTER_JOB, kind=ROUTER_KIND, framework="torch", after=after, output=ROUTER_DIR,
        steps=router.train.steps, workers=router.workers,
        upload=upload(ROUTER_DIR)[1] if spec.uploads else None,
        template=("train", "router", "--partition", part_arg,
                  *(arg for model in dict.fromkeys(e.model for e in spec.experts)
                    for arg in ("--config", model)), "--data", data_arg,
                  *(() if router.use_labels else ("--no-labels",)),
                  *_train_args(router.train),
                  "--device", router.workers.accelerator.declared.train_device("torch"),
                  "--out", f"{_OUTPUT}/{ROUTER_DIR}", *upload(ROUTER_DIR))))
    return TrainingPlan(tuple(jobs))


def _upload_args(spec: TrainingSpec) -> Callable[[str], tuple[str, ...]]:
    """The arguments that upload the output ``relative`` to the store (none: a volume)."""
    def upload(relative: str) -> tuple[str, ...]:
        if not spec.uploads:
            return ()
        return ("--upload", f"{spec.output.uri.rstrip('/')}/{relative}",
                *((_CREDENTIALS_FLAG, _OUTPUT_CREDENTIALS) if spec.output_credentials else ()))
    return upload


def _expert_job(expert: ExpertTraining, data_arg: str, part_arg: str, after: tuple[str, ...],
                upload: Callable[[str], tuple[str, ...]]) -> JobPlan:
    output = f"{EXPERTS_DIR}/{expert.name}"
    device = expert.workers.accelerator.declared.train_device(expert.framework)
    uploaded = upload(output)
    return JobPlan(
        name=f"expert-{expert.name}", kind=EXPERT_KIND, framework=expert.framework, after=after,
        output=output, steps=expert.train.steps, workers=expert.workers, expert=expert.name,
        upload=uploaded[1] if uploaded else None,
        template=("train", "expert", "--framework", expert.framework, "--config", expert.model,
                  "--data", data_arg, "--partition", part_arg, "--index", str(expert.index),
                  "--name", expert.name, *_train_args(expert.train), "--device", device,
                  "--out", f"{_OUTPUT}/{output}", *uploaded))


def _train_args(train: Any) -> tuple[str, ...]:
    return ("--steps", str(train.steps), "--batch-size", str(train.batch_size),
            "--lr", repr(train.learning_rate), "--seed", str(train.seed),
            "--save-every", str(train.save_every), *_RESUMABLE)


_RESUMABLE = ("--resume", "--quiet", "--progress-log", str(PROGRESS_LOG_S))


def _text2img_jobs(text2img: Text2ImgTraining, output_uri: str, mnist: str,
                   first: tuple[str, ...]) -> tuple[JobPlan, ...]:
    """The text-to-image DDM's stages (``ddm train text2img``, as scripts/train_text2img.sh
    chains them) as jobs reading MNIST in ``mnist`` once ``first`` have finished: the
    tokenizer and the VAE at once, CLIP after the tokenizer, the partition (k-means on CLIP's
    image embeddings) after CLIP, the latents after the partition and the VAE, then every
    expert, the router network and its text prior at once, and last ``ddm import text2img``
    of the root into ``ddm/``, the DDM that serves."""
    common = ("--mnist", mnist, "--root", _OUTPUT, "--size", text2img.size)

    def stage(name: str, after: tuple[str, ...], output: str, *args: str, kind: str = STAGE_KIND,
              command: str | None = None, trained: str | None = None, marker: str = "",
              expert: str | None = None) -> JobPlan:
        """The job ``name`` running ``ddm train text2img COMMAND`` (default: ``name``);
        ``trained``: the stage whose steps it trains (resumable, logging its progress)."""
        steps = text2img.steps_of(trained) if trained else None
        return JobPlan(
            name=name, kind=kind, framework="torch", after=after, output=output, steps=steps,
            workers=Workers(), expert=expert, marker=marker,
            template=("train", "text2img", command or name, *common, *args,
                      *(("--steps", str(steps), *_RESUMABLE) if steps else ("--quiet",))))

    experts = [stage(name, ("latents",), expert_dir(k), "--index", str(k), "--seed", str(k),
                     kind=EXPERT_KIND, command="expert", trained="expert", marker="config.json",
                     expert=name)
               for k, name in enumerate(f"expert-{k}" for k in range(text2img.clusters))]
    return (
        stage("tokenizer", first, "tokenizer", marker="tokenizer.json"),
        stage("vae", first, "vae", trained="vae", marker="config.json"),
        stage("clip", ("tokenizer",), "clip", trained="clip", marker="config.json"),
        stage(PARTITION_JOB, ("clip",), PARTITION_FILE, "--clusters", str(text2img.clusters),
              kind=PARTITION_KIND),
        stage("latents", (PARTITION_JOB, "vae"), "latents.safetensors"),
        *experts,
        stage(ROUTER_JOB, ("latents",), ROUTER_DIR, kind=ROUTER_KIND, trained="router",
              marker="config.json"),
        stage("text-prior", ("latents",), "text_prior.json"),
        JobPlan(name="import", kind=STAGE_KIND, framework="torch",
                after=(*(job.name for job in experts), ROUTER_JOB, "text-prior"),
                output=TEXT2IMG_DDM_DIR, steps=None, workers=Workers(), marker="ddm.yaml",
                template=("import", "text2img", _OUTPUT, "--out",
                          f"{_OUTPUT}/{TEXT2IMG_DDM_DIR}", "--checkpoint-base",
                          f"{output_uri.rstrip('/')}/{TEXT2IMG_DDM_DIR}/")),
    )
