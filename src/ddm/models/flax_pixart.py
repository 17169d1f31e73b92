"""A Flax port of the text2img experts' ``PixArtTransformer2DModel``, so an expert runs on JAX.

Same architecture and the same weights as diffusers' model at our configuration (AdaLN-single,
no additional size conditions, no learned sigma, ``norm_elementwise_affine=False``,
``gelu-approximate``): patch embedding plus fixed 2-D sin-cos positions, a timestep MLP shared
by every block through one linear to six modulations, a caption projection, blocks of
modulated self-attention, plain cross-attention to the projected text tokens and a modulated
feed-forward, then a modulated output norm and unpatchify. Conversion is exact: each diffusers
tensor maps to one Flax leaf (linear weights and the patch kernel transposed), and back.
Parameter paths follow diffusers' keys: ``transformer_blocks.N.attn1.to_q.weight`` is
``params["transformer_blocks_N"]["attn1_to_q"]["kernel"]``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ddm.checkpoints.format import CheckpointError, check_weight_shapes
from ddm.models.text2img import EXPERT_CLASS_NAME

#: diffusers' ``AdaLayerNormSingle`` time projection width and LayerNorm epsilon.
TIME_PROJECTION_DIM = 256
NORM_EPS = 1e-6
#: ``forward(latents (B, C, S, S), text (B, L, D), timestep (B,)) -> (B, C, S, S)`` float32
#: NumPy, the timestep as the diffusers model takes it.
PixArtForward = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
#: The smallest batch an expert compiles for; larger ones are rounded up to a power of two.
MIN_BUCKET = 8


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + NORM_EPS)


def time_projection(timestep: jax.Array) -> jax.Array:
    """diffusers' ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)``: (B,) ->
    (B, 256), cosines first."""
    half = TIME_PROJECTION_DIM // 2
    frequencies = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = timestep.astype(jnp.float32)[:, None] * frequencies[None, :]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def positions(width: int, grid: int, interpolation_scale: float) -> np.ndarray:
    """The fixed sin-cos position table ``(1, grid * grid, width)``, diffusers' own function."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    table = get_2d_sincos_pos_embed(width, grid, base_size=grid,
                                    interpolation_scale=interpolation_scale, output_type="pt")
    return table.float().numpy()[None]


class _Block(nn.Module):
    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array, modulation: jax.Array) -> jax.Array:
        width = self.heads * self.head_dim
        table = self.param("scale_shift_table", nn.initializers.normal(width ** -0.5),
                           (6, width))
        mods = table[None] + modulation.reshape(x.shape[0], 6, width)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            mods[:, i:i + 1] for i in range(6))
        for name, query in (("attn1", _layer_norm(x) * (1 + scale_msa) + shift_msa),
                            ("attn2", None)):
            query = x if query is None else query
            keys = query if name == "attn1" else context
            q, k, v = (nn.Dense(width, name=f"{name}_to_{p}")(a).reshape(
                a.shape[0], a.shape[1], self.heads, self.head_dim)
                for p, a in (("q", query), ("k", keys), ("v", keys)))
            weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k)
                                     / math.sqrt(self.head_dim), axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape[0], -1, width)
            out = nn.Dense(width, name=f"{name}_to_out_0")(out)
            x = x + (gate_msa * out if name == "attn1" else out)
        hidden = _layer_norm(x) * (1 + scale_mlp) + shift_mlp
        hidden = nn.gelu(nn.Dense(4 * width, name="ff_net_0_proj")(hidden), approximate=True)
        return x + gate_mlp * nn.Dense(width, name="ff_net_2")(hidden)


class FlaxPixArt(nn.Module):
    """``(latents (B, C, S, S), text (B, L, caption_channels), timestep (B,)) -> (B, C_out, S,
    S)``; the timestep is as the diffusers model takes it (ours: ``t * 1000``)."""

    config: Mapping[str, Any]  # the diffusers config.json of the expert

    @nn.compact
    def __call__(self, latents: jax.Array, text: jax.Array, timestep: jax.Array) -> jax.Array:
        c = self.config
        width, patch = c["num_attention_heads"] * c["attention_head_dim"], c["patch_size"]
        grid = c["sample_size"] // patch
        out_channels = c["out_channels"] or c["in_channels"]
        tokens = nn.Conv(width, (patch, patch), strides=(patch, patch), padding="VALID",
                         name="pos_embed_proj")(latents.transpose(0, 2, 3, 1))
        scale = c["interpolation_scale"] or max(c["sample_size"] // 64, 1)
        x = tokens.reshape(latents.shape[0], grid * grid, width) + jnp.asarray(
            positions(width, grid, scale))
        embedded = nn.Dense(width, name="adaln_single_emb_timestep_embedder_linear_2")(
            nn.silu(nn.Dense(width, name="adaln_single_emb_timestep_embedder_linear_1")(
                time_projection(timestep))))
        modulation = nn.Dense(6 * width, name="adaln_single_linear")(nn.silu(embedded))
        context = nn.Dense(width, name="caption_projection_linear_2")(nn.gelu(
            nn.Dense(width, name="caption_projection_linear_1")(text), approximate=True))
        for index in range(c["num_layers"]):
            x = _Block(c["num_attention_heads"], c["attention_head_dim"],
                       name=f"transformer_blocks_{index}")(x, context, modulation)
        table = self.param("scale_shift_table", nn.initializers.normal(width ** -0.5),
                           (2, width))
        mods = table[None] + embedded[:, None]
        x = _layer_norm(x) * (1 + mods[:, 1:2]) + mods[:, 0:1]
        x = nn.Dense(patch * patch * out_channels, name="proj_out")(x)
        x = x.reshape(-1, grid, grid, patch, patch, out_channels)
        return jnp.einsum("nhwpqc->nchpwq", x).reshape(-1, out_channels, grid * patch,
                                                        grid * patch)


def _flax_path(key: str) -> tuple[str, ...]:
    """``transformer_blocks.0.attn1.to_q.weight`` -> ``(transformer_blocks_0, attn1_to_q,
    kernel)``; top-level modules join every segment with ``_``."""
    parts = key.split(".")
    leaf = {"weight": "kernel", "bias": "bias"}.get(parts[-1], parts[-1])
    if parts[-1] == "scale_shift_table":
        return (*(["_".join(parts[:2])] if parts[0] == "transformer_blocks" else []), leaf)
    if parts[0] == "transformer_blocks":
        return "_".join(parts[:2]), "_".join(parts[2:-1]), leaf
    return "_".join(parts[:-1]), leaf


def _to_flax(value: np.ndarray, leaf: str) -> np.ndarray:
    if leaf != "kernel":
        return value
    return value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T


def params_from_torch(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers PixArt state dict (tensors or arrays) -> Flax params, exactly."""
    params: dict[str, Any] = {}
    for key, value in state.items():
        path = _flax_path(key)
        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _to_flax(np.asarray(value.detach().cpu().numpy() if hasattr(
            value, "detach") else value), path[-1])
    return params


def torch_from_params(params: Mapping[str, Any], keys: list[str]) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_torch` for the diffusers ``keys``."""
    out = {}
    for key in keys:
        path = _flax_path(key)
        node: Any = params
        for part in path:
            node = node[part]
        value = np.asarray(node)
        out[key] = (value.transpose(3, 2, 0, 1) if value.ndim == 4 else value.T) \
            if path[-1] == "kernel" else value
    return out


def load_flax_expert(directory: str | Path) -> tuple[PixArtForward, dict[str, Any]]:
    """A diffusers PixArt directory (config.json + one safetensors file) on JAX: its forward,
    in the network's own convention (:mod:`ddm.models.stages` converts at the edge), and its
    diffusers config. The weights are converted exactly (:func:`params_from_torch`) and must
    be exactly the network's tensors; the network computes in float32."""
    from safetensors.flax import load_file

    from ddm.models.paris_loading import read_component_config
    from ddm.checkpoints.format import one_safetensors

    root = Path(directory)
    config = read_component_config(root)
    if config.get("_class_name") != EXPERT_CLASS_NAME:
        raise CheckpointError(f"{root}: the jax backend runs {EXPERT_CLASS_NAME} experts, "
                              f"not {config.get('_class_name')!r}")
    network = FlaxPixArt({k: v for k, v in config.items() if not k.startswith("_")})
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32),
                                    params_from_torch(load_file(str(one_safetensors(root)))))
    c = network.config
    expected = jax.eval_shape(network.init, jax.random.PRNGKey(0),
                              jnp.zeros((1, c["in_channels"], c["sample_size"],
                                         c["sample_size"])),
                              jnp.zeros((1, 1, c["caption_channels"])), jnp.zeros(1))["params"]
    check_weight_shapes(root, _shapes(expected), _leaves(params))
    apply = jax.jit(lambda p, x, text, timestep: network.apply({"params": p}, x, text, timestep))

    def forward(latents: np.ndarray, text: np.ndarray, timestep: np.ndarray) -> np.ndarray:
        rows = len(latents)
        inputs = [_padded(np.asarray(a, np.float32), rows) for a in (latents, text, timestep)]
        return np.asarray(apply(params, *inputs), dtype=np.float32)[:rows]

    return forward, dict(config)


def _padded(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with zero rows appended up to the next power of two (at least
    :data:`MIN_BUCKET`): a routed expert sees a different number of rows at every step, and
    each new shape would compile anew."""
    bucket = max(MIN_BUCKET, 1 << max(rows - 1, 0).bit_length())
    return np.concatenate([array, np.zeros((bucket - rows, *array.shape[1:]), array.dtype)])


def _leaves(tree: Any) -> dict[str, Any]:
    """``{"['transformer_blocks_0']['attn1_to_q']['kernel']": array}``: a tree's leaves by path."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(leaf.shape) for name, leaf in _leaves(tree).items()}
