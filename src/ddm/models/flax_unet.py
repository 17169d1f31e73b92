"""The conditional UNet in Flax linen, layer for layer the twin of ``ddm.models.torch_unet``.

Callers see the neutral layout only: images ``(B, C, H, W)`` float32 in model space, ``t``
``(B,)`` in ``[0, 1]``, labels ``y`` ``(B,)`` int; the output is the velocity of
``ddm.convention``, same shape as the image. NHWC exists only inside ``FlaxUNet.__call__``.

Every submodule is named by its PyTorch ``state_dict`` prefix (``down.0.blocks.0.conv1``), so
the canonical name of a Flax leaf is its joined path with ``kernel``/``scale``/``embedding``
read as ``weight``; conversion only transposes (conv ``HWIO <-> OIHW``, dense
``(in, out) <-> (out, in)``) and is therefore bit exact both ways.

Parity with PyTorch. Convolutions pad explicitly by one pixel as torch's ``padding=1`` does
(``'SAME'`` pads a stride-2 conv on one side only), GroupNorm uses eps 1e-5 and two-pass
variance, upsampling repeats pixels. Measured on CPU in float32 against the torch UNet with the
same weights (``tests/unit/test_flax_unet.py``, velocities of order 1): max |dv| 6.0e-7 for
``smoke`` and 1.4e-6 for ``digits-small``, against a tolerance of 1e-4. On accelerators,
:func:`make_velocity_fn` traces under ``jax.default_matmul_precision("highest")`` so GPUs do
not round convs to TF32 nor TPUs to bf16; when checking parity there also set
``XLA_FLAGS=--xla_allow_excess_precision=false`` so XLA keeps float32 rounding where it fuses
ops, and route with exact ``jax.lax.top_k``, never ``jax.lax.approx_max_k``, so both
frameworks pick the same experts.

This module never imports torch: the JAX serving image may not have it.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ddm.checkpoints.format import check_weight_shapes
from ddm.convention import TIME_EMBEDDING_SCALE
from ddm.models.config import UNetConfig

Params = dict[str, Any]

#: PyTorch's GroupNorm default; Flax's is 1e-6.
GROUP_NORM_EPS = 1e-5
#: Torch's ``padding=1`` for 3x3 convs, stride 1 or 2.
PAD_1 = ((1, 1), (1, 1))


def timestep_features(t: jax.Array, dim: int) -> jax.Array:
    """Sinusoidal features of ``t * TIME_EMBEDDING_SCALE``: ``(B,) -> (B, dim)``, cos then sin."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = (t.astype(jnp.float32) * TIME_EMBEDDING_SCALE)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def _conv(features: int, name: str, stride: int = 1) -> nn.Conv:
    return nn.Conv(features, (3, 3), strides=(stride, stride), padding=PAD_1, name=name)


def _norm(groups: int, name: str) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, epsilon=GROUP_NORM_EPS, use_fast_variance=False,
                        name=name)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the joint embedding added between, plus a skip (NHWC)."""

    out_ch: int
    groups: int

    @nn.compact
    def __call__(self, x: jax.Array, emb: jax.Array) -> jax.Array:
        h = _conv(self.out_ch, "conv1")(nn.silu(_norm(self.groups, "norm1")(x)))
        h = h + nn.Dense(self.out_ch, name="emb_proj")(nn.silu(emb))[:, None, None, :]
        h = _conv(self.out_ch, "conv2")(nn.silu(_norm(self.groups, "norm2")(h)))
        if x.shape[-1] != self.out_ch:
            x = nn.Conv(self.out_ch, (1, 1), padding="VALID", name="skip")(x)
        return x + h


class Upsample(nn.Module):
    """Nearest-neighbour 2x (NHWC), then a 3x3 conv."""

    ch: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv(self.ch, "conv")(x)


class FlaxUNet(nn.Module):
    """Velocity network ``v(x_t, t, y)``: ``(B, C, H, W), (B,), (B,) -> (B, C, H, W)``."""

    config: UNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array, y: jax.Array) -> jax.Array:
        c = self.config
        e, g, widths = c.embed_dim, c.norm_groups, c.level_channels
        emb = nn.Dense(e, name="time_mlp.0")(timestep_features(t, c.time_features))
        emb = nn.Dense(e, name="time_mlp.2")(nn.silu(emb))
        emb = emb + nn.Embed(c.num_classes, e, name="class_embed")(y.astype(jnp.int32))

        h = _conv(widths[0], "conv_in")(jnp.transpose(x, (0, 2, 3, 1)))
        skips = []
        for i, w in enumerate(widths):
            for j in range(c.num_res_blocks):
                h = ResBlock(w, g, name=f"down.{i}.blocks.{j}")(h, emb)
                skips.append(h)
            if i != len(widths) - 1:
                h = _conv(w, f"down.{i}.resample", stride=2)(h)
        h = ResBlock(h.shape[-1], g, name="mid")(h, emb)
        for k, (i, w) in enumerate(reversed(list(enumerate(widths)))):
            for j in range(c.num_res_blocks):
                h = ResBlock(w, g, name=f"up.{k}.blocks.{j}")(
                    jnp.concatenate([h, skips.pop()], axis=-1), emb)
            if i != 0:
                h = Upsample(w, name=f"up.{k}.resample")(h)
        h = _conv(c.in_channels, "conv_out")(nn.silu(_norm(g, "norm_out")(h)))
        return jnp.transpose(h, (0, 3, 1, 2))


# --- parameters: PyTorch's initialisation, canonical (state_dict) layout <-> Flax ----------

def _example_inputs(config: UNetConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    shape = (1, config.in_channels, config.image_size, config.image_size)
    return jnp.zeros(shape, jnp.float32), jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.int32)


@functools.lru_cache(maxsize=None)
def _template(config: UNetConfig) -> Params:
    """The Flax params tree of ``config`` as shapes only (traced, never computed)."""
    model = FlaxUNet(config)
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), *_example_inputs(config))["params"]


def init_params(config: UNetConfig, seed: int) -> Params:
    """Fresh parameters with PyTorch's default initialisation, drawn by NumPy from ``seed``.

    Torch's scheme (weights and biases ``U(+-1/sqrt(fan_in))``, norms 1 and 0, embeddings
    ``N(0, 1)``) so that both trainers start from the same distribution; NumPy instead of
    ``FlaxUNet.init`` because compiling its ~40 random initialisers takes XLA's CPU backend
    longer than a smoke training run.
    """
    rng = np.random.default_rng(seed)
    template = _template(config)
    drawn = {}
    for path, leaf, value in sorted(_leaves(template), key=lambda e: _canonical_name(*e[:2])):
        module = _lookup(template, path)
        if leaf == "embedding":
            array = rng.standard_normal(value.shape)
        elif leaf == "scale":
            array = np.ones(value.shape)
        elif "scale" in module:  # a norm's bias
            array = np.zeros(value.shape)
        else:
            bound = 1.0 / math.sqrt(math.prod(module["kernel"].shape[:-1]))
            array = rng.uniform(-bound, bound, value.shape)
        drawn[path, leaf] = array.astype(np.float32)
    return _build(template, lambda path, leaf: drawn[path, leaf])


#: Flax leaf name -> PyTorch parameter name.
_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def _to_canonical_axes(leaf: str, ndim: int) -> tuple[int, ...]:
    """The transpose taking a Flax leaf to torch layout: HWIO -> OIHW, (in, out) -> (out, in)."""
    if leaf == "kernel":
        return (3, 2, 0, 1) if ndim == 4 else (1, 0)
    return tuple(range(ndim))


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """Yield ``(module path, leaf name, value)`` for every parameter of a nested params dict."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix, key, value


def _lookup(tree: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any]:
    for key in path:
        tree = tree[key]
    return tree


def _build(template: Params, make: Callable[[tuple[str, ...], str], np.ndarray]) -> Params:
    """A params tree shaped like ``template`` whose leaves are ``make(path, leaf)`` on device."""
    params: Params = {}
    for path, leaf, _ in _leaves(template):
        node = params
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(make(path, leaf))
    return params


def _canonical_name(path: tuple[str, ...], leaf: str) -> str:
    return ".".join(path + (_LEAF_TO_TORCH[leaf],))


def canonical_shapes(config: UNetConfig) -> dict[str, tuple[int, ...]]:
    """The torch ``state_dict`` names and shapes of ``config``'s UNet, derived without torch."""
    shapes = {}
    for path, leaf, value in _leaves(_template(config)):
        axes = _to_canonical_axes(leaf, len(value.shape))
        shapes[_canonical_name(path, leaf)] = tuple(value.shape[a] for a in axes)
    return shapes


def params_from_canonical(weights: Mapping[str, np.ndarray], config: UNetConfig,
                          source: str | os.PathLike = "<in-memory weights>") -> Params:
    """Canonical float32 weights -> Flax params, after checking every name and shape.

    Raises ``CheckpointError`` (naming ``source`` and the offending tensors) on a mismatch.
    """
    check_weight_shapes(source, canonical_shapes(config), weights)

    def to_flax(path: tuple[str, ...], leaf: str) -> np.ndarray:
        array = np.asarray(weights[_canonical_name(path, leaf)], dtype=np.float32)
        return np.transpose(array, np.argsort(_to_canonical_axes(leaf, array.ndim)))

    return _build(_template(config), to_flax)


def canonical_from_params(params: Mapping[str, Any], config: UNetConfig) -> dict[str, np.ndarray]:
    """Flax params -> canonical float32 NumPy weights (torch names and layouts), checked."""
    weights = {}
    for path, leaf, value in _leaves(params):
        array = np.asarray(jax.device_get(value), dtype=np.float32)
        weights[_canonical_name(path, leaf)] = np.ascontiguousarray(
            np.transpose(array, _to_canonical_axes(leaf, array.ndim)))
    check_weight_shapes("<flax params>", canonical_shapes(config), weights)
    return weights


# --- inference ---------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames="config")
def _apply(params: Params, x: jax.Array, t: jax.Array, y: jax.Array, *,
           config: UNetConfig) -> jax.Array:
    return FlaxUNet(config).apply({"params": params}, x, t, y)


def make_velocity_fn(params: Params, config: UNetConfig
                     ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """NumPy ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int) -> v (B, C, H, W) f32``.

    Batches are padded to the next power of two, so a router that sends every possible
    subset size costs at most log2(B) compilations per ``config``, shared by every expert of
    that config. Full float32 matmul precision keeps accelerators within the PyTorch parity
    tolerance (see the module docstring).
    """
    device_params = jax.device_put(params)

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        pad = (1 << max(0, rows - 1).bit_length()) - rows
        x, t, y = (np.concatenate([a, np.repeat(a[-1:], pad, axis=0)]) if pad else a
                   for a in (np.asarray(x, np.float32), np.asarray(t, np.float32),
                             np.asarray(y, np.int32)))
        with jax.default_matmul_precision("highest"):
            v = _apply(device_params, jnp.asarray(x), jnp.asarray(t), jnp.asarray(y),
                       config=config)
        return np.asarray(v)[:rows]

    return velocity


PLATFORMS = ("cpu", "gpu", "tpu")


def select_jax_device(name: str | None) -> jax.Device:
    """``cpu``, ``gpu`` or ``tpu``, optionally ``:N`` -> a ``jax.Device``; None is JAX's default."""
    if name is None:
        return jax.devices()[0]
    platform, _, index = name.partition(":")
    if platform not in PLATFORMS or not (index == "" or index.isdigit()):
        raise ValueError(f"unknown JAX device {name!r}; use cpu, gpu or tpu, optionally with :N")
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        raise ValueError(
            f"JAX platform {platform!r} is not available here (default backend: "
            f"{jax.default_backend()}); install the jax build for it or pick another") from None
    if int(index or 0) >= len(devices):
        raise ValueError(f"JAX device {name!r} asked for, but {platform} has {len(devices)} "
                         "device(s)")
    return devices[int(index or 0)]
