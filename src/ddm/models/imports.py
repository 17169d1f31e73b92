"""A user's network, named in its checkpoint by import path (``package.module:function``).

Importing a module runs its code, with the server's rights, so a checkpoint may only name
modules that whoever runs the server allowed: ``DDM_ALLOW_IMPORT`` lists them (comma-separated
module names; each allows its submodules too). The module itself is never in the checkpoint:
it must be installed where the expert runs (the serving image; docs/experts.md shows how).

The factory is called with the checkpoint's ``architecture`` dict and returns a
``torch.nn.Module`` (framework ``torch``) or a ``flax.linen.Module`` (framework ``jax``) whose
call is ``(x (B, C, H, W) float32, t (B,) float32, y (B,) int64) -> (B, C, H, W)``: the
prediction its objective declares. Torch weights are its ``state_dict``; Flax weights are its
``params`` tree flattened with ``/`` (:func:`flax_weights`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Mapping

import numpy as np

from ddm.checkpoints.format import Checkpoint, CheckpointError, check_weight_shapes

ENV_ALLOW_IMPORT = "DDM_ALLOW_IMPORT"
#: ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int64) -> (B, C, H, W) f32``, NumPy in and out.
NetworkFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def allowed_imports() -> tuple[str, ...]:
    """The modules ``DDM_ALLOW_IMPORT`` allows checkpoints to name."""
    return tuple(m.strip() for m in os.environ.get(ENV_ALLOW_IMPORT, "").split(",") if m.strip())


def import_factory(ckpt: Checkpoint) -> Callable[[dict[str, Any]], Any]:
    """The factory ``ckpt.meta.model.factory`` names, if its module is allowed and imports."""
    factory = ckpt.meta.model.factory
    assert factory is not None, "only a model of kind 'import' names a factory"
    module_name, _, attribute = factory.partition(":")
    allowed = allowed_imports()
    if not any(module_name == m or module_name.startswith(m + ".") for m in allowed):
        top = module_name.split(".")[0]
        raise CheckpointError(
            f"checkpoint {ckpt.path} names the model factory {factory!r}; importing it runs "
            f"its code, so allow it with {ENV_ALLOW_IMPORT}={top} (allowed now: "
            f"{', '.join(allowed) or 'none'}; docs/experts.md)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CheckpointError(
            f"checkpoint {ckpt.path} names the model factory {factory!r}, but {module_name} "
            f"does not import here ({error}); install it where the expert runs "
            "(docs/experts.md)") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise CheckpointError(f"checkpoint {ckpt.path}: {module_name} has no callable "
                              f"{attribute!r} (model factory {factory!r})")
    return function


def torch_module(ckpt: Checkpoint) -> Any:
    """The user's ``torch.nn.Module`` with the checkpoint's weights (names and shapes
    checked), in eval mode on the CPU."""
    import torch
    from torch import nn

    module = import_factory(ckpt)(dict(ckpt.meta.architecture))
    if not isinstance(module, nn.Module):
        raise CheckpointError(f"checkpoint {ckpt.path}: model factory "
                              f"{ckpt.meta.model.factory!r} returned a {type(module).__name__}, "
                              "not a torch.nn.Module (its framework is torch)")
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_weight_shapes(ckpt.path, expected, ckpt.weights)
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in ckpt.weights.items()})
    return module.eval()


def flax_network(ckpt: Checkpoint, device: Any) -> NetworkFn:
    """The user's Flax module with the checkpoint's ``params``, jitted on ``device``."""
    import jax
    import jax.numpy as jnp

    apply, params = flax_model(ckpt)
    params = jax.device_put(params, device)
    apply = jax.jit(apply)

    def network(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with jax.default_device(device):
            out = apply(params, jnp.asarray(x), jnp.asarray(t), jnp.asarray(y, jnp.int32))
        return np.asarray(out, dtype=np.float32)

    return network


def flax_model(ckpt: Checkpoint) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(apply, params)``: the user's Flax module as a traceable
    ``apply(params, x, t, y) -> (B, C, H, W)`` and the checkpoint's ``params`` tree (NumPy;
    names and shapes checked against the module)."""
    import flax.linen as linen
    import jax
    import jax.numpy as jnp

    module = import_factory(ckpt)(dict(ckpt.meta.architecture))
    if not isinstance(module, linen.Module):
        raise CheckpointError(f"checkpoint {ckpt.path}: model factory "
                              f"{ckpt.meta.model.factory!r} returned a {type(module).__name__}, "
                              "not a flax.linen.Module (its framework is jax)")
    shape = ckpt.meta.model.image_shape
    assert shape is not None, "ModelSpec requires an image shape for imported models"
    example = (jnp.zeros((1, *shape), jnp.float32), jnp.zeros((1,), jnp.float32),
               jnp.zeros((1,), jnp.int32))
    abstract = jax.eval_shape(module.init, jax.random.PRNGKey(0), *example)["params"]
    expected = {k: tuple(v.shape) for k, v in flax_weights(abstract).items()}
    check_weight_shapes(ckpt.path, expected, ckpt.weights)

    def apply(params: Any, x: Any, t: Any, y: Any) -> Any:
        return module.apply({"params": params}, x, t, y)

    return apply, _unflatten(dict(ckpt.weights))


def flax_weights(params: Mapping[str, Any]) -> dict[str, Any]:
    """A Flax ``params`` tree as the checkpoint's flat ``{"Dense_0/kernel": array}``."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}/{k}": v for k, v in flax_weights(value).items()})
        else:
            flat[key] = value
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree
