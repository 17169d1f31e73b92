"""Resumable training: the training state saved every few steps beside the checkpoint.

A long run (the MNIST experts: hours of CPU) is spread over sessions: every ``every`` updates
the trainer writes its whole state (weights, EMA, optimiser, step, framework RNG) to
``<out>.training/`` and ``--resume`` continues from the last one. Batches, times and noise are
functions of ``(seed, step)`` (``torch_loop._draws``, ``jax_expert._iteration``), so a resumed
run makes the same updates as an uninterrupted one: on the same machine and thread count the
result is bit-identical.

With several training processes (``ddm.training.distributed``) every one reads the saved state
and only the writer, rank 0, saves it. The state holds no trace of the world's size: progress is
the step count of updates on the global batch (``TrainConfig.batch_size``), the same whatever
the number of processes sharing each batch, so a run resumes with more or fewer processes.

The state is refused when what it was made for (``identity``: the kind, data, partition, model
and training config) differs from the run resuming it: continuing another run's optimiser would
silently train a hybrid.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

#: Default updates between two saves: at mnist-small's pace a few minutes of CPU.
SAVE_EVERY = 500
IDENTITY_FILE = "identity.json"


def state_directory(out: Path) -> Path:
    """Where a run writing the checkpoint ``out`` keeps its training state."""
    return out.with_name(out.name + ".training")


@dataclass
class Resumable:
    """Where and how often a trainer saves, and whether it continues a saved state; it also
    keeps the run's training time, earlier sessions of a resumed run included."""

    directory: Path
    identity: dict[str, Any] = field(default_factory=dict)
    every: int = SAVE_EVERY
    resume: bool = False
    writer: bool = True  # False on data-parallel ranks other than 0: they never save
    _started: float = field(default_factory=time.perf_counter, init=False, repr=False)
    _before: float = field(default=0.0, init=False, repr=False)  # the resumed state's seconds

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"the save interval must be a positive number of steps, "
                             f"got {self.every!r}")

    def saved(self, name: str) -> Path | None:
        """The state file ``name`` to continue from, or None to start afresh.

        Raises ValueError when a state exists but ``resume`` is off (it would be overwritten),
        or when it was made for another run.
        """
        path = self.directory / name
        if not path.exists():
            return None
        recorded = json.loads((self.directory / IDENTITY_FILE).read_text())
        step = recorded.pop("step", "?")
        before = float(recorded.pop("seconds", 0.0))  # states saved before it was kept: 0
        if not self.resume:
            raise ValueError(f"{self.directory} holds a training state at step {step}: pass "
                             "--resume to continue it, or delete it to start again")
        expected = json.loads(json.dumps(self.identity))
        if recorded != expected:
            differ = sorted(k for k in set(recorded) | set(expected)
                            if recorded.get(k) != expected.get(k))
            raise ValueError(f"the training state in {self.directory} was made for another run "
                             f"(differs in: {', '.join(differ)}); delete it to start again")
        self._before = before
        return path

    def elapsed(self) -> float:
        """Seconds of training so far: this process's, plus those the resumed state records
        (time lost between its save and an interruption is not counted)."""
        return self._before + time.perf_counter() - self._started

    def due(self, done: int, total: int) -> bool:
        """Whether to save after ``done`` updates (every ``every``, and after the last)."""
        return done % self.every == 0 or done == total

    def save(self, name: str, step: int, write: Callable[[Path], None]) -> None:
        """Write the state with ``write(path)``, atomically: a kill leaves the old one whole.
        The identity goes into place first, as a state is read through it: a kill between the
        two renames leaves the old state (none, on the first save) beside the new identity."""
        if not self.writer:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".{name}.partial"
        write(partial)
        identity = self.directory / f".{IDENTITY_FILE}.partial"
        identity.write_text(json.dumps({**self.identity, "step": step,
                                        "seconds": round(self.elapsed(), 1)}, indent=1))
        os.replace(identity, self.directory / IDENTITY_FILE)
        os.replace(partial, self.directory / name)
