"""A label expert answers the one velocity message (issue 36), over real HTTP on loopback with
a real (random-init smoke) model: a generation's labels come once as a LABEL_CONTEXT
(``docs/protocol.md`` version 4), acknowledged with its id; velocity and integrate calls then
name rows of it and get what the network computes in-process for those labels. A context it
does not hold is 412, guidance 422 (no null label), a text context or labels it does not serve
422; a pool of label experts answers POOL_VELOCITY for its members' label rows."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from ddm.checkpoints.format import load_checkpoint
from ddm.models.loading import expert_velocity
from ddm.sampling.solvers import iterate
from ddm.serving.model.options import ServingOptions
from ddm.serving.model.server import create_model_app
from ddm.serving.wire.paths import POOL_VELOCITY_PATH, model_paths
from ddm.serving.wire.protocol import (CONTENT_TYPE, UNKNOWN_CONTEXT, Context, IntegrateRequest,
                                       LabelContext, PoolVelocityRequest, RemoteExpertError, Solver,
                                       VelocityRequest, context_id, decode_context_ack,
                                       decode_pool_response, decode_response, encode_pool_request,
                                       encode_request)
from servers import ready_server, running, wait_ready

SHAPE = (1, 8, 8)  # the smoke config's images
HEADERS = {"Content-Type": CONTENT_TYPE}
LABELS = np.array([4, 0, 2], np.int64)  # the smoke expert serves 0-4
RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, *SHAPE)).astype(np.float32)
T = RNG.uniform(0, 1, 4).astype(np.float32)
ROWS = np.array([2, 0, 0, 1], np.int32)  # labels 2, 4, 4, 0
UNGUIDED = np.ones(4, np.float32)


def post(base: str, body: bytes, path: str = "/v1/velocity") -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body, headers=HEADERS)


def send_context(base: str, labels: np.ndarray = LABELS,
                 path: str = "/v1/velocity") -> bytes:
    """Send a label context; the id the expert acknowledged (the SHA-256 of its body)."""
    body = encode_request(LabelContext(9, labels))
    reply = post(base, body, path)
    assert reply.status_code == 200, reply.content
    assert decode_context_ack(reply.content, 9) == context_id(body)
    return context_id(body)


def refusal(reply: httpx.Response, request_id: int) -> RemoteExpertError:
    with pytest.raises(RemoteExpertError) as caught:
        decode_response(reply.content, request_id)
    assert caught.value.code == reply.status_code
    return caught.value


@pytest.fixture(scope="module")
def server(smoke_expert_checkpoint: Path):
    with ready_server(smoke_expert_checkpoint, max_batch=8) as base:
        yield base


@pytest.fixture(scope="module")
def velocity(smoke_expert_checkpoint: Path):
    return expert_velocity(load_checkpoint(smoke_expert_checkpoint), "torch")


def test_velocity_on_rows_of_a_label_context_equals_in_process(server, velocity):
    context = send_context(server)
    reply = post(server, encode_request(
        VelocityRequest(3, X, T, context, ROWS, UNGUIDED)))
    assert reply.status_code == 200, reply.content
    np.testing.assert_allclose(decode_response(reply.content, 3, X.shape),
                               velocity(X, T, LABELS[ROWS]), atol=1e-5)
    info = httpx.get(f"{server}/v1/info").json()
    assert info["conditioning"] == "labels" and info["context_cache_bytes"] > 0


def test_integrate_on_rows_of_a_label_context_equals_the_local_solver(server, velocity):
    context = send_context(server)
    grid = np.array([0.0, 0.3, 0.6, 1.0], np.float32)
    reply = post(server, encode_request(
        IntegrateRequest(4, X, context, ROWS, UNGUIDED, grid, Solver.HEUN)))
    assert reply.status_code == 200, reply.content
    expected = X
    for _, expected in iterate(velocity, X, LABELS[ROWS], grid, "heun"):
        pass
    np.testing.assert_allclose(decode_response(reply.content, 4), expected, atol=1e-5)


@pytest.mark.parametrize("make, status, message", [
    (lambda context: VelocityRequest(5, X, T, bytes(32), ROWS, UNGUIDED), UNKNOWN_CONTEXT,
     "unknown context 0000000000000000: send it, then retry"),
    (lambda context: VelocityRequest(5, X, T, context, ROWS,
                                         np.array([1, 1, 4, 1], np.float32)), 422,
     "is conditioned on labels and has no null label to guide against: send its rows with "
     "guidance 1"),
    (lambda context: VelocityRequest(5, X, T, context, ROWS + 1, UNGUIDED), 422,
     "'rows' name row 3 of a context of 3"),
    (lambda context: Context(5, np.zeros((1, 2, 4), np.float32), np.ones((1, 2), np.uint8),
                             np.zeros((0, 2, 4), np.float32)), 422,
     "is conditioned on labels: send a label context, then velocity or integrate requests"),
])
def test_calls_it_cannot_answer_are_refused_by_name(server, make, status, message):
    reply = post(server, encode_request(make(send_context(server))))
    assert reply.status_code == status
    assert message in refusal(reply, 5).message


def test_labels_it_does_not_serve_are_refused_when_a_call_names_them(server):
    """A context may hold any class (the router shares one among experts); a call naming a
    class this expert does not serve is refused."""
    context = send_context(server, np.array([0, 7], np.int64))
    reply = post(server, encode_request(
        VelocityRequest(6, X[:2], T[:2], context, np.array([0, 1], np.int32),
                            UNGUIDED[:2])))
    assert reply.status_code == 422
    assert "labels [7] are not served by this expert (serves [0, 1, 2, 3, 4])" in refusal(
        reply, 6).message


def test_a_pool_of_label_experts_answers_one_request_for_its_members(smoke_expert_checkpoint,
                                                                     velocity):
    members = {"a": smoke_expert_checkpoint, "b": smoke_expert_checkpoint}
    with running(create_model_app(members, ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        context = send_context(base, path=model_paths("a").velocity)
        request = PoolVelocityRequest(7, (
            ("a", VelocityRequest(7, X, T, context, ROWS, UNGUIDED)),
            ("b", VelocityRequest(7, X[:1], T[:1], context, ROWS[:1], UNGUIDED[:1]))))
        reply = post(base, encode_pool_request(request), POOL_VELOCITY_PATH)
    assert reply.status_code == 200, reply.content
    a, b = decode_pool_response(reply.content, request)
    np.testing.assert_allclose(a, velocity(X, T, LABELS[ROWS]), atol=1e-5)
    # Sent to a only, held for b too: a pool's experts share one context cache.
    np.testing.assert_allclose(b, velocity(X[:1], T[:1], LABELS[ROWS[:1]]), atol=1e-5)
