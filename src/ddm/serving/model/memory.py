"""Whether a model server's members fit its device, checked before any weight loads (one
member or many alike).

Each member costs its weights plus the activations of ``max_batch`` forward rows:

* weights: exact, from the safetensors header of the member's one weights file (dtype x
  shape of every tensor; floating tensors at ``--precision``'s width when it is given, as
  :func:`ddm.models.stages.load_stage` casts them; a label checkpoint's as stored, as it is
  served). No tensor is read.
* activations: a bound, not a measurement (nothing may load before the check, and a
  warm-up at ``max_batch`` would need the weights). Inference keeps no autograd graph, so a
  network's live activations at any moment are a few tensors of the row's positions by the
  layer's width: :data:`LIVE_TENSORS` x positions x widest x the activations' bytes per value,
  per forward row (checked once against measured figures: docs/stages.md). ``widest`` is the
  largest input width of any weight in the header (a linear layer's ``in`` features, a
  convolution's input channels: an MLP's hidden width counts, an embedding table's
  vocabulary does not). Positions: a label UNet's image pixels (H x W); a router network's
  latent tokens (H x W over ``patch_size`` squared where its config patches the latent); a
  text expert's the same plus the :data:`MAX_TEXT_TOKENS` a context may hold (its
  cross-attention's keys); a decoder's image pixels (the latent's sides times
  ``2 ** (len(block_out_channels) - 1)``, the diffusers VAE's upsamplings); a text
  encoder's ``max_position_embeddings`` tokens.
  Attention scores are left out: PyTorch's fused attention on CUDA does not hold them.

The limit: ``--memory-limit-bytes`` if given, else CUDA's free memory on a CUDA device, else
the container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), else
none (no check).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ddm.checkpoints.declared import DECODER, EXPERT, TEXT_ENCODER, read_declaration
from ddm.checkpoints.format import WEIGHTS_FILE, CheckpointError, read_meta
from ddm.deploy.limits import MAX_TEXT_TOKENS
from ddm.models.loading import expert_image_shape
from ddm.models.paris_loading import read_component_config
from ddm.models.stages import StageDeclaration, stage_weights

__all__ = ["LIVE_TENSORS", "MemberBytes", "MemoryLimit", "PoolMemory", "container_limit",
           "member_bytes", "memory_limit"]

#: Activation tensors of one row's width alive at once in a forward without autograd: a
#: block's input, its output, the residual stream and an intermediate, and the copies the
#: stage makes of its input and output (float32 NumPy in and out). Six, not four: checked
#: against the RSS growth of a batch of 32 rows, a CLIP text encoder outgrew the bound at four
#: (docs/stages.md).
LIVE_TENSORS = 6
#: Bytes per value of each safetensors dtype (its header's names).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
                "BOOL": 1}
_FLOATS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Where a limit given as ``--memory-limit-bytes`` comes from (a CPU pool's, set by the plan).
MEMORY_LIMIT_FLAG_SOURCE = "--memory-limit-bytes: the pool's resources.limits.memory"
#: The safetensors format's own cap on its JSON header.
_MAX_HEADER_BYTES = 100_000_000
#: A cgroup v1 limit at or above this is "no limit" (the kernel writes 2**63 rounded down to
#: its page size).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemberBytes:
    """One member's cost: its weights, and the activations of ``rows`` forward rows."""

    weights: int
    activations: int
    rows: int

    @property
    def total(self) -> int:
        return self.weights + self.activations


@dataclass(frozen=True)
class MemoryLimit:
    """The bytes a pool may use and where that figure came from."""

    bytes: int
    source: str


@dataclass(frozen=True)
class PoolMemory:
    """The members' costs against the limit (None: no limit known, nothing checked)."""

    members: Mapping[str, MemberBytes]
    limit: MemoryLimit | None

    @property
    def total(self) -> int:
        return sum(member.total for member in self.members.values())

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit.bytes

    def describe(self) -> dict[str, Any]:
        """The figures ``/v1/info`` reports under ``pool``."""
        return {"members": {name: {"weights_bytes": m.weights, "activation_bytes": m.activations,
                                   "activation_rows": m.rows, "bytes": m.total}
                            for name, m in self.members.items()},
                "total_bytes": self.total,
                "limit_bytes": None if self.limit is None else self.limit.bytes,
                "limit_source": None if self.limit is None else self.limit.source}

    def refusal(self) -> str:
        """Why the pool does not fit: the sum and the limit first (a pod's status keeps the
        start of a long line), then each member's bytes."""
        assert self.limit is not None, "a pool without a limit always fits"
        each = "; ".join(f"{name} {m.total:,} bytes ({m.weights:,} of weights + {m.activations:,} "
                         f"of activations for {m.rows} rows)" for name, m in self.members.items())
        activations = sum(m.activations for m in self.members.values())
        return (f"the pool's members do not fit: sum {self.total:,} bytes > limit "
                f"{self.limit.bytes:,} bytes ({self.limit.source}); {activations:,} of the sum "
                f"are activations, which the pool's maxBatch bounds: lower it or raise the "
                f"limit; {each}")


def member_bytes(directory: Path, precision: str | None, rows: int) -> MemberBytes:
    """What the checkpoint at ``directory`` (a stage checkpoint, or a label checkpoint) will
    cost loaded at ``precision`` (None: as stored) with ``rows`` forward rows in flight (see
    the module's docstring)."""
    if read_declaration(directory) is None:
        _, height, width = expert_image_shape(read_meta(directory))
        return _cost(directory / WEIGHTS_FILE, None, height * width, rows)
    config = read_component_config(directory)
    declared = StageDeclaration.from_config(directory, config)
    return _cost(stage_weights(directory, declared), precision, _positions(declared, config),
                 rows)


def _cost(weights_file: Path, precision: str | None, positions: int, rows: int) -> MemberBytes:
    """The weights in ``weights_file`` at ``precision`` and the activations of ``rows`` rows
    of ``positions`` positions each."""
    tensors = _header(weights_file)
    weights, widest, float_bytes = 0, 0, 0
    for name, dtype, shape in tensors:
        if dtype not in _DTYPE_BYTES:
            raise CheckpointError(f"{weights_file}: tensor {name!r} has dtype {dtype!r}, which "
                                  "this check does not know")
        size = _DTYPE_BYTES[dtype]
        if dtype in _FLOATS:
            size = _PRECISION_BYTES[precision] if precision is not None else size
            float_bytes = max(float_bytes, size)
            if len(shape) >= 2:
                widest = max(widest, shape[1])
        weights += math.prod(shape) * size
    per_row = LIVE_TENSORS * positions * widest * (float_bytes or 4)
    return MemberBytes(weights, rows * per_row, rows)


def memory_limit(flag: int | None, device: str | None,
                 cgroup_root: Path = Path("/sys/fs/cgroup")) -> MemoryLimit | None:
    """The pool's limit: ``flag`` (``--memory-limit-bytes``), else CUDA's free memory on a
    CUDA ``device``, else the container's limit (:func:`container_limit`), else None."""
    if flag is not None:
        return MemoryLimit(flag, MEMORY_LIMIT_FLAG_SOURCE)
    if device is not None and device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return MemoryLimit(int(free), f"free memory of {device}")
    return container_limit(cgroup_root)


def container_limit(cgroup_root: Path) -> MemoryLimit | None:
    """The container's memory limit: cgroup v2 ``memory.max``, else v1
    ``memory/memory.limit_in_bytes``; None where neither sets one."""
    v2 = cgroup_root / "memory.max"
    if v2.is_file():
        text = v2.read_text().strip()
        return None if text == "max" else MemoryLimit(int(text), f"cgroup {v2}")
    v1 = cgroup_root / "memory" / "memory.limit_in_bytes"
    if v1.is_file():
        value = int(v1.read_text().strip())
        return None if value >= _V1_UNLIMITED else MemoryLimit(value, f"cgroup {v1}")
    return None


def _positions(declared: StageDeclaration, config: Mapping[str, Any]) -> int:
    """Positions one row's activations span (see the module's docstring)."""
    if declared.role == TEXT_ENCODER:
        tokens = config.get("max_position_embeddings", MAX_TEXT_TOKENS)
        return tokens if isinstance(tokens, int) and tokens > 0 else MAX_TEXT_TOKENS
    if declared.latent_shape is not None:
        height, width = declared.latent_shape[1:]
    else:  # a library config's side: the latent's (a transformer), the image's (a VAE)
        side = config.get("sample_size")
        if not isinstance(side, int) or side < 1:
            raise CheckpointError(f"{declared.role} {declared.family}: neither _ddm.latent_shape "
                                  "nor config.json's sample_size says its size")
        return side * side
    if declared.role == DECODER:
        blocks = config.get("block_out_channels")
        scale = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 1
        return height * width * scale * scale
    patch = config.get("patch_size")
    patch = patch if isinstance(patch, int) and patch > 0 else 1
    tokens = max(1, (height // patch) * (width // patch))
    return tokens + MAX_TEXT_TOKENS if declared.role == EXPERT else tokens


def _header(path: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor in the safetensors file at ``path``, read from its
    header alone."""
    try:
        with path.open("rb") as file:
            raw = file.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if length is None or length > _MAX_HEADER_BYTES:
                raise ValueError("no header of at most 100 MB")
            header = json.loads(file.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        return [(name, str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None
