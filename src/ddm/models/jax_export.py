"""JAX's edge of the ``exported`` model kind: an expert as ``jax.export``'s serialized StableHLO.

The JAX counterpart of ``torch.export``'s ``.pt2`` (``ddm.models.torch_io``): its author traces
the network once, with a symbolic batch size, and JAX lowers it to StableHLO with the weights
as constants and serializes it (``Exported.serialize``); the expert server deserializes it
(``jax.export.deserialize``) and compiles it for each batch size it runs. No Python code of
the author's runs where it is served, so it needs neither their package nor
``DDM_ALLOW_IMPORT``. StableHLO calls native code only through ``custom_call``, whose target
names any function registered in the serving process (host callbacks into Python, LAPACK,
GPU kernels): a program is refused on load unless each target is one of
:data:`ALLOWED_CUSTOM_CALLS`.

Every expert network has one signature, checked here before a program is saved or served:
``(x f32[B, C, H, W], t f32[B], y i32[B]) -> f32[B, C, H, W]`` for every batch size ``B``
(``B`` a symbolic dimension; ``y`` int32 as JAX's integers are without x64). A program runs on
the platforms it was exported for: :data:`EXPORT_PLATFORMS` by default, so that one file
serves on CPUs, NVIDIA and AMD GPUs and TPUs alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from ddm.checkpoints.format import Checkpoint, CheckpointError, program_file_name

#: Where an exported program runs unless its author says otherwise (``jax.export`` names).
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
#: A JAX device's ``platform`` -> the export platforms whose code runs on it.
_RUNS_ON = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}
#: The ``custom_call`` targets a served program may hold: JAX's own checks of symbolic shapes
#: (every program with a symbolic batch has them) and its sharding annotations, which compute
#: nothing. Anything else (a host callback, a kernel library) is refused on load, naming it.
ALLOWED_CUSTOM_CALLS = frozenset({"shape_assertion", "Sharding", "SPMDFullToShardShape",
                                  "SPMDShardToFullShape"})
#: The name of the symbolic batch dimension.
BATCH = "batch"
#: ``(x, t, y) -> out`` as a JAX-traceable function of ``jax.Array``s.
JaxNetwork = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
#: ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int) -> (B, C, H, W) f32``, NumPy in and out.
NetworkFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def export_program(network: JaxNetwork, image_shape: tuple[int, int, int],
                   platforms: tuple[str, ...] = EXPORT_PLATFORMS) -> bytes:
    """``network`` (``(x, t, y) -> (B, C, H, W)``, any JAX-traceable function: for a Flax
    module ``functools.partial(module.apply, {"params": params})``) as the serialized
    ``jax.export`` program of an ``exported`` checkpoint, for every batch size and for
    ``platforms``. Traced at full float32 matmul precision, so that it computes the same on
    every accelerator; its signature is checked as a server would check it."""
    batch, = export.symbolic_shape(BATCH)
    specs = _arguments(batch, image_shape)
    with jax.default_matmul_precision("highest"):
        exported = export.export(jax.jit(network), platforms=platforms)(*specs)
    check_signature(exported, image_shape, "the exported network")
    return bytes(exported.serialize())


def exported_network(ckpt: Checkpoint, device: Any) -> NetworkFn:
    """The checkpoint's ``jax.export`` program (signature and platform checked), compiled on
    ``device`` (a ``jax.Device``) for each batch size it is called with."""
    name = program_file_name(ckpt.meta)
    where = f"checkpoint {ckpt.path}: {name}"
    image_shape = ckpt.meta.model.image_shape
    assert image_shape is not None, "ModelSpec requires an image shape for exported models"
    exported = read_program(Path(ckpt.path) / name, where)
    check_custom_calls(exported, where)
    check_signature(exported, image_shape, where)
    runs_here = _RUNS_ON.get(device.platform, (device.platform,))
    if not set(exported.platforms) & set(runs_here):
        raise CheckpointError(
            f"{where} was exported for {', '.join(exported.platforms)}, not for this "
            f"{device.platform} device ({' or '.join(runs_here)}); export it with that platform "
            "among export_program's platforms (docs/experts.md)")
    call = jax.jit(exported.call)

    def network(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with jax.default_device(device):
            out = call(jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32),
                       jnp.asarray(y, jnp.int32))
        return np.asarray(out, dtype=np.float32)

    return network


def read_program(path: Path, where: str) -> export.Exported:
    """Deserialize the ``jax.export`` program at ``path`` (its SHA-256 already checked)."""
    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except Exception as error:  # noqa: BLE001 - any unreadable program is a bad checkpoint
        raise CheckpointError(f"{where} is not a jax.export program this JAX ({jax.__version__})"
                              f" reads ({type(error).__name__}: {error})") from None


def check_custom_calls(exported: export.Exported, where: str) -> None:
    """Raise a ``CheckpointError`` naming the first ``custom_call`` target of ``exported``'s
    StableHLO (the module JAX compiles) outside :data:`ALLOWED_CUSTOM_CALLS`."""
    from jax.extend import mlir
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import chlo, stablehlo

    with ir.Context() as context:
        stablehlo.register_dialect(context)
        chlo.register_dialect(context)
        module = mlir.deserialize_portable_artifact(exported.mlir_module_serialized)
        for op in _operations(module.operation):
            if op.name != "stablehlo.custom_call":
                continue
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target not in ALLOWED_CUSTOM_CALLS:
                allowed = ", ".join(sorted(ALLOWED_CUSTOM_CALLS))
                raise CheckpointError(
                    f"{where} calls custom_call target {target!r}, native code outside the "
                    f"program; exported experts may call only {allowed} (docs/experts.md)")


def _operations(op: Any) -> Any:
    """``op`` and every operation nested in its regions, depth first."""
    yield op
    for region in op.regions:
        for block in region:
            for inner in block:
                yield from _operations(inner.operation)


def check_signature(exported: export.Exported, image_shape: tuple[int, int, int],
                    where: str) -> None:
    """Raise a ``CheckpointError`` naming ``exported``'s signature unless it is an expert
    network's (module doc) for ``image_shape`` ``(C, H, W)``, on one device."""
    image = f"float32[B,{','.join(map(str, image_shape))}]"
    expected = f"({image}, float32[B], int32[B]) -> {image}"
    problem = _signature_problem(exported, image_shape)
    if problem:
        actual = _describe(exported.in_avals, exported.out_avals)
        raise CheckpointError(f"{where} computes {actual}, but an expert's network is "
                              f"{expected} for every batch size B: {problem} (docs/experts.md)")


def _signature_problem(exported: export.Exported, image_shape: tuple[int, int, int]) -> str:
    if exported.in_tree != jax.tree.structure(((0, 0, 0), {})):
        return f"it takes {exported.in_tree}, not the three positional arrays (x, t, y)"
    if exported.out_tree != jax.tree.structure(0) or len(exported.out_avals) != 1:
        return f"it returns {exported.out_tree}, not one array"
    if exported.nr_devices != 1:
        return f"it was exported for {exported.nr_devices} devices; an expert runs on one"
    x, t, y = exported.in_avals
    out, = exported.out_avals
    wrong = [f"{name} is {jnp.dtype(aval.dtype).name}, not {jnp.dtype(dtype).name}"
             for name, aval, dtype in (("x", x, jnp.float32), ("t", t, jnp.float32),
                                       ("y", y, jnp.int32), ("the output", out, jnp.float32))
             if aval.dtype != dtype]
    if wrong:
        return "; ".join(wrong)
    if x.ndim != 4 or tuple(x.shape[1:]) != tuple(image_shape):
        return f"x must be (B, {', '.join(map(str, image_shape))}) (model.image_shape)"
    batch = x.shape[0]
    if not export.is_symbolic_dim(batch):
        return (f"its batch size is fixed at {batch}; export it with a symbolic batch "
                "(ddm.models.jax_export.export_program)")
    if t.shape != (batch,) or y.shape != (batch,):
        return "t and y must be (B,), one time and one label per image"
    if out.shape != x.shape:
        return "the output must have x's shape"
    return ""


def _arguments(batch: Any, image_shape: tuple[int, int, int]) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((batch, *image_shape), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


def _describe(inputs: Any, outputs: Any) -> str:
    """``(float32[batch,1,16,16], ...) -> float32[...]``: a program's signature, for errors."""
    def short(aval: Any) -> str:
        return f"{jnp.dtype(aval.dtype).name}[{','.join(map(str, aval.shape))}]"
    return f"({', '.join(map(short, inputs))}) -> {', '.join(map(short, outputs))}"
