"""What a PyTorch network is handed: tensors it may write to, never the request's own bytes.

A request's arrays are read-only views of its body (``protocol.decode_request``), and PyTorch
lets a network that works in place on its input write through such a view."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from ddm.models.torch_io import router_probs_fn, velocity_fn


class InPlace(nn.Module):
    """Doubles its input in place and answers it: a network that reuses its input's memory."""

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0).flatten(1)


@pytest.mark.parametrize("make", [velocity_fn, router_probs_fn], ids=["velocity", "router"])
def test_a_network_writing_into_its_input_leaves_the_request_body_as_it_came(make):
    values = np.arange(8, dtype=np.float32).reshape(2, 1, 2, 2)
    body = values.tobytes()
    x = np.frombuffer(body, np.float32).reshape(values.shape)  # as decode_request reads it
    t, y = np.frombuffer(np.zeros(2, np.float32).tobytes(), np.float32), np.zeros(2, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch warns when handed a read-only array
        out = make(InPlace(), torch.device("cpu"))(x, t, y)
    assert body == values.tobytes()
    if make is velocity_fn:
        np.testing.assert_array_equal(out, 2 * values.reshape(2, -1))
