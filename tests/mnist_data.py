"""Where the tests find real MNIST: ``$DDM_MNIST_DIR``, else ``../shared/datasets/mnist``
beside the checkout (where CI puts it). Tests that need it skip, saying why, when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]


def mnist_dir() -> Path:
    """The MNIST IDX directory, or a pytest skip naming where it was looked for."""
    path = Path(os.environ.get("DDM_MNIST_DIR", REPOSITORY.parent / "shared/datasets/mnist"))
    if not path.is_dir() or not any(path.glob("t10k-*")):
        pytest.skip(f"real MNIST not found at {path} (set DDM_MNIST_DIR to the directory "
                    "holding the four IDX files)")
    return path
