"""MNIST from its four IDX files, read strictly so that a damaged download fails loudly.

An IDX file is a big-endian header (magic ``0x00000801`` for a label vector, ``0x00000803``
for an image stack; the low byte is the number of dimensions, then one uint32 per
dimension) followed by exactly ``prod(dims)`` unsigned bytes. Files may be raw or gzip;
gzip is recognised by its magic bytes, not by the file name. Both common namings are
found: ``train-images-idx3-ubyte`` (LeCun's) and ``train-images.idx3-ubyte`` (mirrors),
each optionally with ``.gz``. MNIST pixels are 0 background and 255 ink, like ours.

Sizes: MNIST's digits are centred in 28x28 with a 4-pixel empty margin, so a larger size
pads that margin with background (LeNet-5's 32x32 input) and keeps every pixel exact; a
smaller size shrinks with :func:`ddm.data.resize.resize_images`.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from ddm.checkpoints.fetch import Contents
from ddm.data.resize import resize_images

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
#: File-name prefixes of the two MNIST parts: 60k training and 10k test images.
PARTS = ("train", "t10k")
NUM_CLASSES = 10
_GZIP_MAGIC = b"\x1f\x8b"


#: The four files as LeCun distributes them (gzip): what MNIST in an object store holds
#: (``ddm fetch-data``), the training images first.
DISTRIBUTED_FILES = tuple(f"{part}-{kind}-idx{rank}-ubyte.gz" for part in PARTS
                          for kind, rank in (("images", 3), ("labels", 1)))


class IDXError(ValueError):
    """An IDX file is missing, corrupt, or disagrees with its partner file."""


def load_mnist(directory: str | os.PathLike, image_size: int,
               part: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """One MNIST part -> images ``(N, 1, S, S)`` float32 in ``[0, 1]`` (ink = 1), labels int64.

    ``S = image_size``: at least 28 pads the 28x28 images with background (the odd pixel,
    if any, goes right and below); smaller shrinks them (antialiased triangle filter).
    """
    if part not in PARTS:
        raise ValueError(f"unknown MNIST part {part!r}; known: {', '.join(PARTS)}")
    root = Path(directory)
    if not root.is_dir():
        raise IDXError(f"MNIST directory {root} does not exist")
    images_path = find_idx_file(root, part, "images")
    labels_path = find_idx_file(root, part, "labels")
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.shape[0] == 0 or 0 in images.shape[1:]:
        raise IDXError(f"{images_path}: holds no images (dims {images.shape})")
    if images.shape[0] != labels.shape[0]:
        raise IDXError(f"{images_path} holds {images.shape[0]} images but {labels_path} "
                       f"holds {labels.shape[0]} labels")
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise IDXError(f"{labels_path}: label {labels[bad[0]]} at index {bad[0]} is not a "
                       f"digit 0-{NUM_CLASSES - 1}")
    pixels = fit_to_size(images.astype(np.float32) / 255.0, image_size)
    return pixels[:, None], labels.astype(np.int64)


def check_mnist(directory: str | os.PathLike) -> None:
    """Both parts in ``directory`` read as :func:`load_mnist` reads them; ``IDXError`` says
    what is wrong (a fetched copy is checked so before it is installed)."""
    for part in PARTS:
        load_mnist(directory, 28, part)


#: MNIST as the checkpoint fetcher brings it (``ddm fetch-data``): a directory of
#: ``DISTRIBUTED_FILES``, the training images first (a pin covers them), or an archive of them;
#: checked by :func:`check_mnist` before the copy is put in place.
FETCHED = Contents("MNIST data", DISTRIBUTED_FILES[0], lambda root: list(DISTRIBUTED_FILES[1:]),
                   check_mnist)


def fit_to_size(images: np.ndarray, size: int) -> np.ndarray:
    """``(N, H, W)`` -> ``(N, size, size)`` float32: centred padding when ``size >= H, W``,
    else the shared resize."""
    height, width = images.shape[1:]
    if not isinstance(size, (int, np.integer)) or size < max(height, width):
        return resize_images(images, size)
    top, left = (size - height) // 2, (size - width) // 2
    padded = np.pad(images, ((0, 0), (top, size - height - top), (left, size - width - left)))
    return padded.astype(np.float32)


def find_idx_file(directory: Path, part: str, kind: str) -> Path:
    """The first existing of the four accepted names for ``part``'s ``kind`` file."""
    rank = {"images": 3, "labels": 1}[kind]
    names = [f"{part}-{kind}-idx{rank}-ubyte", f"{part}-{kind}.idx{rank}-ubyte"]
    candidates = [directory / (name + suffix) for name in names for suffix in ("", ".gz")]
    for path in candidates:
        if path.is_file():
            return path
    raise IDXError(f"no MNIST {part} {kind} file in {directory}; looked for "
                   + ", ".join(p.name for p in candidates))


def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read an unsigned-byte IDX file whose magic must be ``magic``; shape is its dims."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise IDXError(f"{path}: {len(data)} bytes is too short for an IDX header")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        what = "images" if magic == IMAGES_MAGIC else "labels"
        raise IDXError(f"{path}: bad magic number 0x{found:08x}, expected 0x{magic:08x} "
                       f"for an IDX {what} file")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IDXError(f"{path}: truncated header ({len(data)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    expected, present = int(np.prod(dims)), len(data) - header
    if present < expected:
        raise IDXError(f"{path}: truncated data: dims {dims} need {expected} bytes, "
                       f"found {present}")
    if present > expected:
        raise IDXError(f"{path}: {present - expected} unexpected bytes after the "
                       f"{expected} that dims {dims} describe")
    return np.frombuffer(data, np.uint8, count=expected, offset=header).reshape(dims)


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if not data.startswith(_GZIP_MAGIC):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise IDXError(f"{path}: corrupt gzip data ({exc})") from None
