"""The Flax port of the text2img experts equals diffusers' PixArtTransformer2DModel."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ddm.models.flax_pixart import FlaxPixArt, params_from_torch, torch_from_params
from ddm.models.text2img import expert_kwargs, sizes

PARITY_TOL = 1e-4


@pytest.mark.parametrize("size, patch", [("smoke", 2), ("smoke", 1), ("small", 2)])
def test_flax_pixart_matches_diffusers(size: str, patch: int) -> None:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(**{**expert_kwargs(sizes(size), 24),
                                        "patch_size": patch}).eval()
    with torch.no_grad():  # diffusers zero-initialises some outputs: randomise every weight,
        for p in model.parameters():  # at a scale that keeps activations of order one
            p.normal_(0.0, 1.0 / p[0].numel() ** 0.5 if p.ndim > 1 else 0.1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 8, 8), dtype=np.float32)
    text = rng.standard_normal((3, 5, 24), dtype=np.float32)
    timestep = np.array([0.0, 370.0, 1000.0], np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x), encoder_hidden_states=torch.from_numpy(text),
                         timestep=torch.from_numpy(timestep)).sample.numpy()
    state = model.state_dict()
    params = params_from_torch(state)
    got = FlaxPixArt(dict(model.config)).apply({"params": params}, jnp.asarray(x),
                                               jnp.asarray(text), jnp.asarray(timestep))
    np.testing.assert_allclose(np.asarray(got), expected, atol=PARITY_TOL, rtol=PARITY_TOL)
    back = torch_from_params(params, list(state))
    assert all(np.array_equal(back[k], v.numpy()) for k, v in state.items())  # lossless


def test_flax_params_have_exactly_the_diffusers_tensors() -> None:
    import jax
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel(**expert_kwargs(sizes("smoke"), 24))
    init = FlaxPixArt(dict(model.config)).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 4, 8, 8)), jnp.zeros((1, 5, 24)), jnp.zeros(1))
    converted = params_from_torch(model.state_dict())
    shapes = jax.tree_util.tree_map(lambda a: tuple(a.shape), init["params"])
    assert shapes == jax.tree_util.tree_map(lambda a: tuple(a.shape), converted)
