"""Progress bars for long work (sampling, evaluation, reports, training): tqdm on stderr,
shown only when stderr is a terminal, so that logs and pipes get no carriage-return noise
and stdout keeps only the command's result."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tqdm comes with the torch and jax extras, imported only when a bar is made
    from tqdm import tqdm


def progress_bar(total: int | None, what: str, unit: str, quiet: bool = False) -> "tqdm":
    """A bar of ``total`` ``unit``s (None: a count with its rate) labelled ``what``; disabled
    (every call a no-op) when ``quiet`` or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, dynamic_ncols=True,
                leave=False, disable=True if quiet else None)  # None: off unless a TTY
