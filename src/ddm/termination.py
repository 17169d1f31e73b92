"""Why a server could not start, where Kubernetes shows it: the termination-message file.

An expert whose checkpoint is corrupt, or a router whose config is wrong, will never become
ready; staying alive and unready would only hide the reason in its log. Instead the server
writes one line to the file Kubernetes reads when a container ends (``terminationMessagePath``,
``/dev/termination-log`` by default; the pod's ``lastState.terminated.message``, which the
operator reports) and exits with status 1. A training command that fails leaves its error
there too (``ddm.training.cli``), which a DDMTraining's status repeats.
``DDM_TERMINATION_LOG`` names another file (the local runtime gives each process its own).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

ENV = "DDM_TERMINATION_LOG"
DEFAULT_PATH = "/dev/termination-log"
#: Kubernetes keeps at most 4096 bytes of a termination message.
MAX_BYTES = 4096
EXIT_STATUS = 1

logger = logging.getLogger(__name__)


def termination_log_path() -> Path:
    """The file named by ``DDM_TERMINATION_LOG``, else Kubernetes' default."""
    return Path(os.environ.get(ENV) or DEFAULT_PATH)


def one_line(reason: str) -> str:
    """``reason`` on one line, cut to what Kubernetes keeps (whole UTF-8 characters)."""
    text = " ".join(reason.split())
    return text.encode("utf-8")[:MAX_BYTES].decode("utf-8", "ignore")


def write_termination_message(reason: str, path: Path | None = None) -> bool:
    """Write ``reason`` as one line to the termination-message file; False when there is
    nowhere to write it (no such directory, or not writable: not in a pod)."""
    path = path or termination_log_path()
    if not path.parent.is_dir() or not os.access(path.parent if not path.exists() else path,
                                                 os.W_OK):
        return False
    try:
        path.write_text(one_line(reason) + "\n", encoding="utf-8")
    except OSError as error:
        logger.warning("cannot write the termination message to %s: %s", path, error)
        return False
    return True


def fail_start(reason: str) -> SystemExit:
    """Log ``reason``, leave it for Kubernetes, and return the exit to raise (status 1)."""
    logger.error("cannot start: %s", one_line(reason))
    write_termination_message(reason)
    return SystemExit(EXIT_STATUS)


@contextlib.contextmanager
def sigterm_handled(handler: Any) -> Iterator[None]:
    """SIGTERM goes to ``handler`` (a function, or ``signal.SIG_IGN``) until the block ends,
    then to the previous handler. Signals are the main thread's: elsewhere, nothing to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
