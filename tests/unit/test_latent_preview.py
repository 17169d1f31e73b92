"""The latent preview's prediction: from two states on a straight flow-matching path, the clean
end the path heads for, exactly."""

from __future__ import annotations

import numpy as np

from ddm.convention import interpolate
from ddm.serving.router.api.previews import StatePoint, predicted_latents


def test_two_states_on_a_straight_path_predict_its_data_end():
    rng = np.random.default_rng(0)
    x0, x1 = rng.standard_normal((2, 2, 4, 8, 8)).astype(np.float32)

    def at(t: float) -> StatePoint:
        return StatePoint(t, interpolate(x0, x1, np.full(2, t, np.float32)))

    np.testing.assert_allclose(predicted_latents(at(0.4), at(0.5)), x1, atol=1e-5)
    np.testing.assert_allclose(predicted_latents(at(0.0), at(1.0)), x1, atol=1e-5)


def test_without_an_earlier_state_the_state_itself_is_shown():
    now = StatePoint(0.1, np.ones((1, 4, 8, 8), np.float32))
    assert predicted_latents(None, now) is now.x
