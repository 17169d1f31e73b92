"""diffusers' FlowMatchEulerDiscrete convention (Paris) against ours: grid, shift, time and sign.

Expectations come from hand arithmetic and from diffusers' scheduler itself, never from
ddm.convention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddm.convention import (flow_match_from_velocity, flow_match_sigma_grid, flow_match_timestep,
                            interpolate, shift_sigmas, sigma_from_time, target_velocity,
                            time_from_sigma, velocity_from_flow_match)


def diffusers_grid(steps: int, shift: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas.numpy(), scheduler.timesteps.numpy()


def test_two_step_grid_runs_from_timestep_1000_to_the_smallest_training_timestep_1():
    grid = flow_match_sigma_grid(2)
    np.testing.assert_array_equal(grid.timesteps, np.float32([1000.0, 1.0]))
    np.testing.assert_array_equal(grid.sigmas, np.float32([1.0, 0.001, 0.0]))
    np.testing.assert_array_equal(grid.times, np.float32([0.0, 0.999, 1.0]))
    assert grid.sigmas.dtype == grid.timesteps.dtype == np.float32


def test_shift_three_moves_the_midpoint_to_three_quarters_and_keeps_the_ends():
    np.testing.assert_allclose(shift_sigmas(np.array([0.0, 0.5, 1.0]), 3.0), [0.0, 0.75, 1.0])
    np.testing.assert_array_equal(shift_sigmas(np.float32([0.25, 0.5]), 1.0), [0.25, 0.5])


@pytest.mark.parametrize("steps", [1, 2, 7, 30, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
def test_grid_equals_diffusers_scheduler_value_for_value(steps, shift):
    sigmas, timesteps = diffusers_grid(steps, shift)
    grid = flow_match_sigma_grid(steps, shift=shift)
    np.testing.assert_array_equal(grid.sigmas, sigmas)
    np.testing.assert_array_equal(grid.timesteps, timesteps)


def test_time_and_sigma_round_trip_within_float32_spacing_near_one():
    sigma = np.linspace(0.0, 1.0, 10001, dtype=np.float32)
    back = sigma_from_time(time_from_sigma(sigma))
    np.testing.assert_allclose(back, sigma, rtol=0, atol=3e-8)
    np.testing.assert_array_equal(back[sigma >= 0.5], sigma[sigma >= 0.5])
    np.testing.assert_array_equal(flow_match_timestep(np.float32([0.0, 0.75, 1.0])),
                                  np.float32([1000.0, 250.0, 0.0]))


def test_our_path_at_t_is_diffusers_noised_sample_at_sigma_one_minus_t():
    generator = torch.Generator().manual_seed(0)
    data, noise = torch.randn(2, 3, 4, 4, generator=generator).unbind(0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(10)
    timestep = scheduler.timesteps[3:4]
    theirs = scheduler.scale_noise(data[None], timestep, noise[None])[0].numpy()
    t = time_from_sigma(timestep.numpy() / 1000.0)
    ours = interpolate(noise.numpy()[None], data.numpy()[None], t)[0]
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # diffusers trains flow-matching models on noise - data; ours is data - noise.
    np.testing.assert_array_equal(
        velocity_from_flow_match((noise - data).numpy()),
        target_velocity(noise.numpy(), data.numpy()))


def test_euler_in_our_time_with_our_velocity_equals_the_scheduler_steps():
    """A model whose output depends on x and sigma, integrated both ways, lands on one point."""
    steps, shift = 12, 3.0

    def flow_match_model(x: np.ndarray, timestep: float) -> np.ndarray:
        return np.float32(0.3) * x + np.float32(timestep / 1000.0) - np.float32(0.5)

    start = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(steps)
    x_theirs = torch.from_numpy(start)
    for timestep in scheduler.timesteps:
        output = torch.from_numpy(flow_match_model(x_theirs.numpy(), float(timestep)))
        x_theirs = scheduler.step(output, timestep, x_theirs).prev_sample

    times = flow_match_sigma_grid(steps, shift=shift).times
    x_ours = start
    for t, t_next in zip(times[:-1], times[1:]):
        timestep = float(flow_match_timestep(t))
        v = velocity_from_flow_match(flow_match_model(x_ours, timestep))
        x_ours = x_ours + (t_next - t) * v
    np.testing.assert_allclose(x_ours, x_theirs.numpy(), atol=1e-5)


def test_a_constant_output_integrates_to_its_closed_form():
    """Output c from sigma 1 to 0 moves x by -c; our velocity -c over t in [0, 1] agrees."""
    c = np.float32(0.7)
    times = flow_match_sigma_grid(5).times
    x = np.float32(2.0)
    for t, t_next in zip(times[:-1], times[1:]):
        x = x + (t_next - t) * velocity_from_flow_match(c)
    assert x == pytest.approx(2.0 - 0.7, abs=1e-6)
    assert flow_match_from_velocity(velocity_from_flow_match(c)) == c


@pytest.mark.parametrize("arguments, message", [
    ({"steps": 0}, "steps"), ({"steps": 2.5}, "steps"), ({"steps": 4, "shift": 0.0}, "shift"),
    ({"steps": 4, "num_train_timesteps": 0}, "num_train_timesteps")])
def test_bad_grid_arguments_are_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        flow_match_sigma_grid(**arguments)
