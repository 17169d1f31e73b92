"""The official OpenAI Python SDK as the router's client (issue 39, item 1), over real HTTP on
loopback against a tiny Paris DDM whose experts run on servers of their own: the SDK shows the
router's reason and the field at fault, takes OpenAI's other image fields, and lists the DDM."""

from __future__ import annotations

import base64
import io
from typing import Iterator

import httpx
import pytest
from PIL import Image

from tests.support.text_router import served_text_ddm

openai = pytest.importorskip("openai")  # the dev extra's; the lead adds it to pyproject

GENERATION_S = 120.0  # a few steps of tiny models on two busy cores

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    with served_text_ddm(tmp_path_factory.mktemp("openai")) as (router, _):
        with openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0,
                           timeout=GENERATION_S) as sdk:
            yield sdk


def test_a_size_the_ddm_does_not_make_is_refused_naming_the_one_it_makes(client):
    own = _size(client.images.generate(prompt="a red car", extra_body={"steps": 1}))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.images.generate(prompt="a red car", size="1024x1024")
    assert refused.value.param == "size" and refused.value.type == "invalid_request_error"
    assert f"it makes {own} images only" in refused.value.message
    assert f"it makes {own} images only" in str(refused.value)


def test_a_field_the_router_refuses_is_named_in_param(client):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.images.generate(prompt="a red car", n=65)
    assert refused.value.param == "n" and "n: Input should be less than or equal to" in (
        refused.value.message)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.images.generate(prompt="a red car", background="transparent")
    assert refused.value.param == "background"


def test_openais_other_image_fields_are_taken(client):
    answer = client.images.generate(prompt="a red car", n=2, quality="hd", style="natural",
                                    user="someone", output_format="png", background="opaque",
                                    moderation="low", model="dall-e-3",
                                    extra_body={"steps": 2, "seed": 5})
    assert len(answer.data) == 2
    for image in answer.data:
        assert Image.open(io.BytesIO(base64.b64decode(image.b64_json))).format == "PNG"


def test_the_model_list_names_the_ddm(client):
    models = client.models.list()
    assert [model.id for model in models.data] == ["ddm"]
    assert models.data[0].experts == ["expert_0", "expert_1"]


def test_an_image_edit_is_refused_saying_why(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("x.png", b"not read", "image/png"), prompt="a red eight")
    assert refused.value.param == "image" and "has no image encoder" in refused.value.message


def test_the_openapi_document_gives_openais_error_shape_for_its_paths(client):
    router = str(client.base_url).removesuffix("/v1/")
    document = httpx.get(f"{router}/openapi.json").json()
    refused = document["paths"]["/v1/images/generations"]["post"]["responses"]["422"]
    assert refused["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OpenAIError"}
    generate = document["paths"]["/v1/generate"]["post"]["responses"]["422"]
    assert generate["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorDetail"}


def test_errors_of_other_routes_keep_the_routers_shape(client):
    router = str(client.base_url).removesuffix("/v1/")
    reply = httpx.post(f"{router}/v1/generate", json={"prompts": ["a"], "steps": 0})
    assert reply.status_code == 422 and reply.json()["param"] == "steps"
    assert reply.json()["detail"].startswith("steps:")


def _size(answer: openai.types.ImagesResponse) -> str:
    width, height = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))).size
    return f"{width}x{height}"
