"""A small Flax network that is not our UNet: the JAX side of bringing your own architecture
(``tests.support.tiny_flax:build``). Pixels and time through an MLP, the label added."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class PixelMLP(nn.Module):
    hidden: int
    num_classes: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, t: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
        batch = x.shape[0]
        h = nn.Dense(self.hidden)(jnp.concatenate([x.reshape(batch, -1), t[:, None]], -1))
        h = nn.silu(h) + nn.Embed(self.num_classes, self.hidden)(y)
        return nn.Dense(x[0].size)(h).reshape(x.shape)


def build(architecture: dict[str, Any]) -> PixelMLP:
    return PixelMLP(**architecture)
