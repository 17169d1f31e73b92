"""Sampled runs kept on disk, so that a long ``ddm report`` resumes where it was stopped.

A full MNIST table is about an hour of CPU; a run (one row, one seed) is minutes. Each run is
stored once it is sampled, under a key made of everything that decides its images: the
checkpoints' configs (which carry their weights' sha256), the routing strategy, solver,
steps, seed and labels. A rerun with the same models and settings reuses it; a retrained
expert or a different setting is a different key. The key does not cover the sampler's code:
after changing it, point the report at a fresh directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ddm.fileio import atomic_path
from ddm.models.ddm import DDM
from ddm.progress import JobProgress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledRun:
    """What the report keeps of one generation."""

    images: np.ndarray       # (N, H, W) uint8
    labels: np.ndarray       # (N,) int64
    expert_calls: np.ndarray  # (N,) expert forward passes per image
    step_masks: np.ndarray   # (N, steps) int64, bit k: expert k ran at that step
    cpu_seconds: float       # CPU time the sampling took when it ran


def model_fingerprint(ddm: DDM) -> str:
    """sha256 over the configs of the checkpoints ``ddm`` was assembled from."""
    return configs_fingerprint(list(ddm.paths))


def configs_fingerprint(checkpoints: list[Path]) -> str:
    """sha256 over the ``config.json`` of each checkpoint directory (they record their
    weights' sha256, so a retrained checkpoint changes it)."""
    digest = hashlib.sha256()
    for path in sorted(checkpoints):
        digest.update(hashlib.sha256((path / "config.json").read_bytes()).digest())
    return digest.hexdigest()


class RunCache:
    """Runs on disk under ``directory`` (None: nothing is kept, every run is sampled);
    ``progress`` hears each run, in samples (a full table takes an hour)."""

    def __init__(self, directory: Path | None, progress: JobProgress | None = None) -> None:
        self.directory = directory
        if directory is not None:  # a cache, unlike an output, is made where it is asked for
            directory.mkdir(parents=True, exist_ok=True)
        self.reused = 0
        self.sampled = 0
        self._progress = progress

    def expect(self, runs: int, samples: int) -> None:
        """The report will ask for ``runs`` runs of ``samples`` images each."""
        if self._progress is not None:
            self._progress.plan(runs * samples)

    def run(self, ddm: DDM, strategy: str, solver: str, steps: int, seed: int,
            labels: np.ndarray, sample: Callable[[], SampledRun]) -> SampledRun:
        """The stored run for these settings, else ``sample()``, stored before returning."""
        what = f"{ddm.source.name} {strategy} seed {seed}"
        path = (self.directory / f"{self._key(ddm, strategy, solver, steps, seed, labels)}.npz"
                if self.directory is not None else None)
        stored = _load(path) if path is not None else None
        if stored is not None:
            self.reused += 1
            if self._progress is not None:
                self._progress.done(len(labels), f"{what}: reused {path}", reused=True)
            return stored
        fresh = sample()
        if path is not None:
            _save(path, fresh)
        self.sampled += 1
        if self._progress is not None:
            self._progress.done(len(labels), f"{what}: sampled in {fresh.cpu_seconds:.0f} CPU-s")
        return fresh

    @staticmethod
    def _key(ddm: DDM, strategy: str, solver: str, steps: int, seed: int,
             labels: np.ndarray) -> str:
        settings = {"models": model_fingerprint(ddm), "strategy": strategy, "solver": solver,
                    "steps": steps, "seed": seed,
                    "labels": hashlib.sha256(np.asarray(labels, np.int64).tobytes()).hexdigest()}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def _save(path: Path, run: SampledRun) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, images=run.images, labels=run.labels, expert_calls=run.expert_calls,
                     step_masks=run.step_masks, cpu_seconds=np.float64(run.cpu_seconds))


def _load(path: Path) -> SampledRun | None:
    """The run in ``path``; None when absent, or unreadable (then it is sampled again and
    the file replaced: it is a cache, the models are the source of truth)."""
    if not path.exists():
        return None
    try:
        with np.load(path) as stored:
            return SampledRun(images=stored["images"], labels=stored["labels"],
                              expert_calls=stored["expert_calls"],
                              step_masks=stored["step_masks"],
                              cpu_seconds=float(stored["cpu_seconds"]))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        log.warning("sampled run %s is unreadable (%s); sampling it again", path, error)
        return None
