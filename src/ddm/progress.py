"""Progress bars for long work (sampling, evaluation, reports, training): tqdm on stderr,
shown only when stderr is a terminal, so that logs and pipes get no carriage-return noise
and stdout keeps only the command's result."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # tqdm comes with the torch and jax extras, imported only when a bar is made
    from tqdm import tqdm


def progress_bar(total: int | None, what: str, unit: str, quiet: bool = False) -> "tqdm":
    """A bar of ``total`` ``unit``s (None: a count with its rate) labelled ``what``; disabled
    (every call a no-op) when ``quiet`` or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=True if quiet else None)  # None: off unless a TTY


def quiet_library_bars() -> None:
    """Turn off the bars the model libraries draw as they load (huggingface_hub's, which
    transformers' follow): unlike ours, they draw into logs and pipes too."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when they are first imported
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


class JobProgress:
    """The progress of a whole job (a report: every model x every run x every sample), with
    the time left.

    ``plan(units)`` adds the work a part of the job will do, as soon as it is known;
    ``done(units, line, reused)`` after each piece. Work found done already (a cache's
    ``reused`` runs) leaves the plan instead of advancing it, so that the time left is
    reckoned from work actually done. On a terminal, a bar (``bar``); otherwise each piece is
    one line to ``log`` (stderr by default), ending in the count and the time left.
    """

    def __init__(self, bar: "tqdm", unit: str, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._bar, self._unit, self._clock = bar, unit, clock
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.planned = self.finished = 0
        self._spent = 0.0  # seconds spent on the finished units
        self._last = clock()

    def plan(self, units: int) -> None:
        """Add ``units`` of work to the job's total."""
        self.planned += units
        self._bar.total = self.planned
        self._bar.refresh()
        self._last = self._clock()  # what came before (loading models) is not this work

    def done(self, units: int, line: str, reused: bool = False) -> None:
        """``units`` are done (``reused``: found done, taking no time); ``line`` says which."""
        now, since = self._clock(), self._last
        self._last = now
        if reused:
            self.planned -= units
            self._bar.total = self.planned
        else:
            self.finished += units
            self._spent += now - since
            self._bar.update(units)
        self._bar.set_postfix_str(line)
        if self._bar.disable:
            self._log(f"{line} ({self.finished}/{self.planned} {self._unit}s, "
                      f"{self.time_left()})")

    def time_left(self) -> str:
        """``about N min left`` at the pace so far; ``time left unknown`` before any work."""
        if not self.finished:
            return "time left unknown"
        seconds = self._spent / self.finished * (self.planned - self.finished)
        return f"about {_duration(seconds)} left"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


#: A supervisor's progress line (``ddm train --progress-log``), read back from the logs by the
#: operator (``ddm.operator.training_status``): ``ddm-progress step DONE/TOTAL``.
PROGRESS_PREFIX = "ddm-progress step "


def progress_line(done: int, total: int) -> str:
    """The line saying ``done`` of ``total`` steps are done."""
    return f"{PROGRESS_PREFIX}{done}/{total}"


def last_progress(log: str) -> tuple[int, int] | None:
    """(done, total) of the last well-formed progress line in ``log``; None if it has none."""
    for line in reversed(log.splitlines()):
        if line.startswith(PROGRESS_PREFIX):
            done, _, total = line[len(PROGRESS_PREFIX):].strip().partition("/")
            if done.isdigit() and total.isdigit():
                return int(done), int(total)
    return None
