"""``ddm train-all``: run a DDMTraining's plan as local processes, no cluster needed.

The same YAML the operator reconciles is planned by the one training plan
(``ddm.deploy.training_plan``) and carried out here as ``ddm up`` carries out a DDMDeployment:
the partition first (k-means only), then every expert and the router network at once, each
with its processes (``torchrun --standalone`` for PyTorch, one process per rank with the JAX
variables for JAX, as :meth:`JobPlan.node_processes` decides), their threads sharing this
machine's cores (:func:`threads_per_process`); finally, once the outputs are checked to make
one DDM, the root index (``ddm_index.json``: the experts and router by role) and the
DDMDeployment pointing at the outputs are written beside them, for ``ddm up``.

``pvc://CLAIM/PATH`` (the output, MNIST) is ``PVC_ROOT/CLAIM/PATH`` here (``--pvc-root``, as
``ddm up`` reads it). Object stores are reached as in a pod: MNIST in a store is fetched by
the plan's data job, and each checkpoint is uploaded by its job, with the cloud's credential
chain of this machine's environment (no Secret is mounted here); the DDMDeployment then pins
each uploaded archive's sha256. A job whose output exists (and, with a store, whose upload is
recorded) is skipped (finished before); every other job
passes ``--resume``, so a rerun after Ctrl-C, SIGTERM or a failure continues each unfinished
job from its last saved state. Progress is each job's step, read from its saved state when it
changes. Ctrl-C, SIGTERM or a job that fails stops every process started.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from ddm.checkpoints.index import write_index
from ddm.checkpoints.local import claim_path, resolve_checkpoint
from ddm.checkpoints.upload import read_uploaded
from ddm.checkpoints.uri import CheckpointSource
from ddm.deploy.training_plan import (
    EXPERT_KIND,
    ROUTER_JOB,
    JobPlan,
    Paths,
    TrainingPlan,
    plan_training,
)
from ddm.deploy.training_spec import TrainingManifest, deployment_document
from ddm.runtime.local import ProcessSpec, Supervisor, free_port

#: The file, in the output root, that holds the DDMDeployment made from the outputs.
DEPLOYMENT_FILE = "deployment.yaml"
#: How often the runner looks for processes that ended and steps that were saved.
POLL_S = 0.5
#: The training state's record of its step (``ddm.training.resume.IDENTITY_FILE``).
_IDENTITY = "identity.json"


class TrainingRunError(RuntimeError):
    """A job failed, or the training cannot run here; the message says which and why."""


@dataclass(frozen=True)
class LocalTraining:
    """The plan placed here: where the output root and the data are."""

    plan: TrainingPlan
    paths: Paths

    def finished(self, job: JobPlan) -> bool:
        """Whether ``job``'s output exists (:attr:`JobPlan.finished_file`, written last) and,
        with ``upload``, the record of its complete upload."""
        output = Path(self.paths.output) / job.output
        return (Path(self.paths.output) / job.finished_file).exists() and (
            job.upload is None or read_uploaded(output) is not None)

    def sha256s(self) -> dict[str, str]:
        """The uploaded archives' SHA-256 by job output (``experts/NAME``, ``router``)."""
        return {job.output: uploaded.sha256 for job in self.plan.jobs if job.upload
                and (uploaded := read_uploaded(Path(self.paths.output) / job.output))}

    def step(self, job: JobPlan) -> int | None:
        """The step of ``job``'s last saved training state (None: none saved yet)."""
        if job.state is None:
            return None
        try:
            identity = json.loads((Path(self.paths.output) / job.state / _IDENTITY).read_text())
        except (OSError, ValueError):
            return None
        step = identity.get("step") if isinstance(identity, dict) else None
        return step if isinstance(step, int) else None


def place_training(manifest: TrainingManifest, pvc_root: Path | None) -> LocalTraining:
    """The output root (made if absent) and the data directory on this machine."""
    spec = manifest.spec
    output = _local(spec.work, pvc_root)
    output.mkdir(parents=True, exist_ok=True)
    data = resolve_checkpoint(spec.data.volume, pvc_root=pvc_root) if spec.data.volume else None
    return LocalTraining(plan_training(spec), Paths(str(output), data and str(data)))


def _local(source: CheckpointSource, pvc_root: Path | None) -> Path:
    return Path(source.path) if source.scheme == "file" else claim_path(source, pvc_root)


def run_training(manifest: TrainingManifest, pvc_root: Path | None = None, *,
                 threads: int | None = None, out: TextIO | None = None,
                 stop: threading.Event | None = None) -> Path:
    """Run every unfinished job, each as soon as those it waits for have finished; return the
    DDMDeployment file written in the output root. ``threads``: CPU threads per process
    (None: :func:`threads_per_process`). Raises ``TrainingRunError`` when a job fails (the
    others are stopped; a rerun resumes) or the outputs disagree, ``KeyboardInterrupt`` on
    Ctrl-C (after stopping everything); ``stop`` set: stop everything and raise
    ``TrainingRunError``. Progress and the processes' output go to ``out`` (default:
    stdout)."""
    local = place_training(manifest, pvc_root)
    stop, out = stop or threading.Event(), out or sys.stdout  # the caller's stdout, now
    plan, started_at = local.plan, time.monotonic()
    done = {job.name for job in plan.jobs if local.finished(job)}
    for name in sorted(done):
        _tell(out, f"{name}: finished before ({plan.job(name).output}), skipped")
    supervisor = Supervisor(out)
    running: dict[str, tuple[str, ...]] = {}  # job -> its processes' names
    steps: dict[str, int | None] = {}
    try:
        while len(done) < len(plan.jobs):
            starting = [job for job in plan.ready(done) if job.name not in running]
            if starting:
                busy = sum(len(processes) for processes in running.values())
                each = threads or threads_per_process(
                    busy + sum(job.workers.processes_per_node for job in starting))
                env = (("OMP_NUM_THREADS", str(each)), ("MKL_NUM_THREADS", str(each)),
                       ("PYTHONUNBUFFERED", "1"))
            for job in starting:
                steps[job.name] = local.step(job)
                running[job.name] = _start(job, local.paths, supervisor, env, out,
                                           steps[job.name])
            if stop.wait(POLL_S):  # external processes: polling them is the only signal
                raise TrainingRunError("stopped; rerun to resume every unfinished job")
            for name, processes in list(running.items()):
                job = plan.job(name)
                step = local.step(job)
                if step != steps[name] and step is not None:
                    steps[name] = step
                    _tell(out, f"{name}: step {step}/{job.steps} saved")
                codes = [supervisor.processes[p].poll() for p in processes]
                failed = [(p, c) for p, c in zip(processes, codes) if c not in (None, 0)]
                if failed:
                    process, code = failed[0]
                    raise TrainingRunError(
                        f"{name} failed: {process} exited with status {code} (its log lines "
                        "above say why); rerun to resume it from its last saved state")
                if all(c == 0 for c in codes):
                    del running[name]
                    if not local.finished(job):
                        raise TrainingRunError(f"{name} exited without writing {job.output}")
                    done.add(name)
                    _tell(out, f"{name}: finished ({job.output}, "
                               f"{time.monotonic() - supervisor.started_at[processes[0]]:.0f} s)")
    finally:
        if any(p.poll() is None for p in supervisor.processes.values()):
            _tell(out, f"stopping {len(supervisor.processes)} process(es)...")
        supervisor.stop()
    if manifest.spec.text2img is None:  # the text2img import checks and indexes its DDM
        _check_outputs(local)
        write_index(local.paths.output, *plan.members())
    path = Path(local.paths.output) / DEPLOYMENT_FILE
    path.write_text(yaml.safe_dump(deployment_document(manifest.spec,
                                                       sha256s=local.sha256s()),
                                   sort_keys=False))
    _tell(out, f"all {len(plan.jobs)} jobs finished ({time.monotonic() - started_at:.0f} s); "
               f"wrote the DDMDeployment {manifest.spec.deployment.name} to {path}")
    return path


def threads_per_process(processes: int) -> int:
    """This machine's cores shared equally by ``processes`` processes running at once (the
    jobs running and those starting together), at least one each: a plan's experts and
    router start together, and a job started later shares what is left."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores // max(1, processes))


def _check_outputs(local: LocalTraining) -> None:
    """Refuse outputs that do not make one DDM: the router network, trained beside the
    experts, must have learned the partition they share (the message names both)."""
    from ddm.checkpoints.format import CheckpointError
    from ddm.training.commands import check_router_partition

    output = Path(local.paths.output)
    experts = [output / job.output for job in local.plan.jobs if job.kind == EXPERT_KIND]
    router = output / local.plan.job(ROUTER_JOB).output
    try:
        check_router_partition(router, experts)
    except (CheckpointError, ValueError) as error:
        raise TrainingRunError(f"the outputs do not make one DDM: {error}") from None


def _start(job: JobPlan, paths: Paths, supervisor: Supervisor,
           env: tuple[tuple[str, str], ...], out: TextIO, saved: int | None
           ) -> tuple[str, ...]:
    """Start ``job``'s processes on this machine (resuming its state saved at step ``saved``);
    their names (log prefixes)."""
    processes = job.node_processes(
        paths, ddm=(sys.executable, "-m", "ddm"),
        torchrun=(sys.executable, "-m", "torch.distributed.run"),
        coordinator=f"127.0.0.1:{free_port()}")
    names = tuple(job.name if len(processes) == 1 else f"{job.name}/{rank}"
                  for rank in range(len(processes)))
    for name, process in zip(names, processes):
        # Training processes listen on no port of ours (torchrun and JAX pick their own).
        supervisor.start(ProcessSpec(name, process.argv, 0, (*env, *process.env)))
    what = (f"{job.workers.processes_per_node} processes" if job.distributed else "1 process")
    _tell(out, f"{job.name}: started ({what}" + (f", {job.steps} steps" if job.steps else "")
               + (f", resuming from step {saved}" if saved is not None else "")
               + (f", after {', '.join(job.after)}" if job.after else "") + ")")
    return names


def _tell(out: TextIO, line: str) -> None:
    try:
        print(line, file=out, flush=True)
    except OSError:  # Ctrl-C ends `ddm train-all | tee` too
        pass

