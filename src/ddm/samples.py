"""The samples file: what ``ddm sample`` writes and ``ddm eval`` and the report read.

An ``.npz`` with ``images`` uint8 ``(N, H, W)`` (0 background, 255 ink), ``labels`` int
``(N,)`` (the class each sample was conditioned on), optionally ``expert_calls`` int ``(N,)``
(expert forward passes per sample), and scalar settings (strategy, steps, solver, seed,
source) recorded for provenance. One module reads and writes it, so the two cannot drift.

A text DDM's samples file (``ddm sample --prompt``) holds ``prompts`` (N,) str in place of
``labels``, RGB ``images`` ``(N, H, W, 3)``, and its guidance settings too; ``ddm eval``, which
scores digits against their labels, refuses it by name.

The PNGs ``ddm sample`` writes beside or instead of it (in-process or from a router) are
written here too, so the two drivers write the same files.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ddm.fileio import atomic_path, check_output
from ddm.imaging import grid, png_bytes

_REQUIRED_KEYS = ("images", "labels")
_OPTIONAL_KEYS = ("expert_calls",)
#: Scalar provenance written by ``ddm sample``; read back as plain Python values.
SETTINGS_KEYS = ("strategy", "steps", "solver", "seed", "source")
#: A text DDM's settings besides those (the negative prompt only where one was given).
TEXT_SETTINGS_KEYS = ("guidance_scale", "guidance_cutoff", "negative_prompt")


class SamplesFileError(ValueError):
    """A samples file is missing, unreadable, or does not hold the arrays it should."""


@dataclass(frozen=True, eq=False)
class SampleSet:
    """``images`` uint8 ``(N, H, W)``, ``labels`` int64 ``(N,)``, ``expert_calls`` int64 or None."""

    images: np.ndarray
    labels: np.ndarray
    expert_calls: np.ndarray | None = None


def load_samples_npz(path: str | os.PathLike) -> SampleSet:
    """Read and validate a samples file; every problem raises :class:`SamplesFileError`."""
    path = Path(path)
    if not path.is_file():
        raise SamplesFileError(f"samples file {path} does not exist")
    if not zipfile.is_zipfile(path):  # else NumPy reads it as a pickle, and refuses that
        with open(path, "rb") as file:
            what = "a single .npy array" if file.read(6) == b"\x93NUMPY" else "not a .npz file"
        raise SamplesFileError(f"samples file {path} is {what}: expected a .npz with images "
                               "and labels, as `ddm sample --out` writes")
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile)
    try:
        archive = np.load(path, allow_pickle=False)
    except unreadable as exc:
        raise SamplesFileError(f"samples file {path} is not a readable .npz ({exc})") from None
    with archive:
        keys = set(archive.files)
        if "prompts" in keys:
            raise SamplesFileError(f"samples file {path} holds a text DDM's images (prompts, "
                                   "RGB); only a label DDM's digits can be scored")
        try:
            arrays = {k: archive[k] for k in keys & {*_REQUIRED_KEYS, *_OPTIONAL_KEYS}}
        except unreadable as exc:
            raise SamplesFileError(f"samples file {path} has a corrupt array ({exc})") from None
    missing = [k for k in _REQUIRED_KEYS if k not in keys]
    unknown = sorted(keys - {*_REQUIRED_KEYS, *_OPTIONAL_KEYS, *SETTINGS_KEYS})
    if missing or unknown:
        raise SamplesFileError(f"samples file {path}: missing keys {missing}, unknown keys "
                               f"{unknown}; expected images, labels and optionally expert_calls")
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.ndim != 3:
        raise SamplesFileError(f"samples file {path}: images must be uint8 (N, H, W), got "
                               f"{images.dtype} {images.shape}")
    n = images.shape[0]
    _check_counts(path, "labels", labels, n)
    calls = arrays.get("expert_calls")
    if calls is not None:
        _check_counts(path, "expert_calls", calls, n)
    return SampleSet(images=images, labels=labels.astype(np.int64),
                     expert_calls=None if calls is None else calls.astype(np.int64))


def _check_counts(path: Path, key: str, values: np.ndarray, n: int) -> None:
    if values.dtype.kind not in "iu" or values.shape != (n,):
        raise SamplesFileError(f"samples file {path}: {key} must be integers of shape ({n},), "
                               f"got {values.dtype} {values.shape}")
    if n and values.min() < 0:
        raise SamplesFileError(f"samples file {path}: {key} must be non-negative")


def save_samples_npz(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray,
                     expert_calls: np.ndarray | None = None,
                     settings: dict[str, Any] | None = None) -> Path:
    """Write a samples file atomically; ``settings`` keys must be in ``SETTINGS_KEYS``."""
    return _save(path, {"images": np.asarray(images, np.uint8),
                        "labels": np.asarray(labels, np.int64)},
                 expert_calls, settings, SETTINGS_KEYS)


def save_text_samples_npz(path: str | os.PathLike, images: np.ndarray, prompts: Sequence[str],
                          expert_calls: np.ndarray, settings: dict[str, Any]) -> Path:
    """Write a text DDM's samples file atomically: RGB ``images`` (N, H, W, 3) uint8, one
    prompt per image; ``settings`` keys in ``SETTINGS_KEYS`` or ``TEXT_SETTINGS_KEYS``."""
    images = np.asarray(images, np.uint8)
    if images.ndim != 4 or images.shape[3] != 3 or len(prompts) != len(images):
        raise ValueError(f"expected (N, H, W, 3) images and N prompts, got {images.shape} "
                         f"and {len(prompts)} prompts")
    return _save(path, {"images": images, "prompts": np.asarray(list(prompts), np.str_)},
                 expert_calls, settings, SETTINGS_KEYS + TEXT_SETTINGS_KEYS)


def _save(path: str | os.PathLike, arrays: dict[str, np.ndarray],
          expert_calls: np.ndarray | None, settings: dict[str, Any] | None,
          known: tuple[str, ...]) -> Path:
    unknown = sorted(set(settings or {}) - set(known))
    if unknown:
        raise ValueError(f"unknown samples settings {unknown}; known: {', '.join(known)}")
    if expert_calls is not None:
        arrays["expert_calls"] = np.asarray(expert_calls, np.int64)
    arrays |= {k: np.array(v) for k, v in (settings or {}).items()}
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
    return Path(path)


def check_text_outputs(out: Path, png: Path | None) -> None:
    """A text DDM's ``--out`` (.npz or .png) and ``--png``, checked before anything runs."""
    if out.suffix not in (".npz", ".png"):
        raise ValueError(f"--out must end with .npz (samples) or .png (images), got {out}")
    check_output(out, out.suffix, "--out")
    if png is not None:
        check_output(png, ".png", "--png")


def write_text_samples(out: Path, png: Path | None, images: np.ndarray,
                       prompts: Sequence[str], calls: np.ndarray,
                       settings: dict[str, Any]) -> dict[str, Any]:
    """Write a text DDM's images: ``out`` (.npz samples or .png) and ``png``; ``ddm sample``'s
    summary. A ``negative_prompt`` of None is left out of the file."""
    for path in (out, png):
        if path is not None and path.suffix == ".png":
            write_images_png(path, images)
    if out.suffix == ".npz":
        save_text_samples_npz(out, images, prompts, calls,
                              {k: v for k, v in settings.items() if v is not None})
    return {"out": str(out), "n": len(prompts), "strategy": settings["strategy"],
            "steps": settings["steps"], "guidance_scale": settings["guidance_scale"],
            "mean_expert_calls": float(calls.mean())}


def write_images_png(path: Path, images: np.ndarray) -> None:
    """RGB ``images`` (N, H, W, 3) as one PNG at their own size (the router's pixels): the
    image itself when N is 1, else a row of them."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(png_bytes(images[0] if len(images) == 1
                                  else grid(images, columns=len(images))))


def write_png_grid(path: Path, images: np.ndarray, columns: int) -> None:
    """Digits ``images`` (N, H, W) uint8 as one PNG grid, ``columns`` a row, at twice their
    size."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(png_bytes(grid(images, columns), scale=2))
