"""What a client sending a bad body hears from the router, over real HTTP on loopback: the
README promises 400 for an undecodable body, with where it broke; a body not sent as JSON is
told how to send it; no answer points to an endpoint the router does not serve.

The router's experts are never called (every request here fails validation first), so its
config lists addresses nobody listens on."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running

NOBODY = "127.0.0.1:9"  # the discard port: no expert is needed to refuse a malformed body


def _config() -> RouterConfigFile:
    return RouterConfigFile.from_dict({
        "experts": [{"name": "low", "classes": list(range(5)),
                     "discovery": {"endpoints": [NOBODY]}},
                    {"name": "high", "classes": list(range(5, 10)),
                     "discovery": {"endpoints": [NOBODY]}}],
        "sampling": {"steps": 6, "strategy": "oracle"}, "router_checkpoint": None})


@pytest.fixture(scope="module", params=[False, True], ids=["docs-off", "docs-on"])
def router(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    with running(create_router_app(_config(), api_docs=request.param)) as base:
        yield base, request.param


def test_malformed_json_gets_400_with_its_line_and_column(router):
    base, _ = router
    body = b'{\n  "labels": [1, 2],\n  "steps": 40,,\n  "seed": 0\n}'
    reply = httpx.post(f"{base}/v1/generate", content=body,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    # line 3 is `  "steps": 40,,`: the second comma is its 15th character
    assert reply.json()["detail"] == ("malformed JSON at line 3, column 15: Expecting property "
                                      "name enclosed in double quotes")
    cut = httpx.post(f"{base}/v1/generate", content=b'{"labels": [1',
                     headers={"content-type": "application/json"})
    assert cut.status_code == 400
    assert cut.json()["detail"].startswith("malformed JSON at line 1, column 14: "), cut.text


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_is_told_the_content_type(router, content_type):
    """curl -d without -H sends application/x-www-form-urlencoded; a bare client, none."""
    base, _ = router
    headers = {"content-type": content_type} if content_type else {}
    reply = httpx.post(f"{base}/v1/generate", content=b'{"labels": [1]}', headers=headers)
    assert reply.status_code == 415, reply.text
    detail = reply.json()["detail"]
    assert detail == ("the body must be JSON, sent with Content-Type: application/json (got "
                      f"{content_type or 'none'}; curl: -H 'content-type: application/json')")


def test_errors_point_only_to_served_endpoints(router):
    base, docs = router
    reply = httpx.post(f"{base}/v1/generate", json={"labels": [1], "temperature": 0.7})
    assert reply.status_code == 422
    detail = reply.json()["detail"]
    pointer = "/docs" if docs else "/openapi.json"
    assert detail == f"unknown field 'temperature' (the fields: {pointer})"
    assert httpx.get(f"{base}{pointer}").status_code == 200
    assert httpx.get(f"{base}/docs").status_code == (200 if docs else 404)
    document = httpx.get(f"{base}/openapi.json").json()
    responses = document["paths"]["/v1/generate"]["post"]["responses"]
    assert {"400", "415", "422"} <= set(responses)
