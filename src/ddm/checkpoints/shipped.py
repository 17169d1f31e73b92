"""Which DDMs ship with ddm, and which one every command uses unless told otherwise. No
imports beyond the standard library: the CLI and ``ddm up`` read it before any ML library."""

from __future__ import annotations

from pathlib import Path

#: The DDM every command uses unless told otherwise: the one ``make demo`` (``ddm up``) serves,
#: ``examples/mnist.yaml`` over ``checkpoints/mnist/`` (MNIST digits padded to 32x32).
DEFAULT_DDM = "mnist"
#: Where the shipped DDMs live: the repository's ``checkpoints/``, or the images' copy.
SHIPPED_ROOTS = (Path(__file__).resolve().parents[3] / "checkpoints",
                 Path("/opt/ddm/checkpoints"))
