"""Prompts say what they ignored (issue 39, item 2): the shipped text2img DDM served over real
HTTP on loopback, its text encoder on a stage server of its own (as ``make demo`` places it:
the unknown words cross the wire), its experts on expert servers, the decoder and router
network in the router. Its word-level vocabulary (docs/text2img.md) lacks "purple" and "cat"."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ddm.checkpoints.declared import CONFIG_KEYS, TEXT_ENCODER
from ddm.data.colored_mnist import EXAMPLE_PROMPT
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready
from tests.support.text_router import text_config

TEXT2IMG = Path(__file__).resolve().parents[2] / "checkpoints" / "text2img"
GENERATION_S = 120.0  # two steps of small models on two busy cores

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    with ExitStack() as stack:
        def serve(app) -> str:
            base = stack.enter_context(running(app))
            wait_ready(base)
            return base.removeprefix("http://")

        experts = {f"expert_{k}": serve(create_model_app(TEXT2IMG / f"expert_{k}",
                                                         ServingOptions(backend="torch")))
                   for k in range(4)}
        encoder = serve(create_model_app(TEXT2IMG / "text_encoder"))
        base = stack.enter_context(running(create_router_app(text_config(
            TEXT2IMG, experts, {CONFIG_KEYS[TEXT_ENCODER]: encoder}))))
        wait_ready(base)
        yield base


def test_words_the_ddm_does_not_know_are_named_and_known_ones_are_not(router):
    unknown = httpx.post(f"{router}/v1/images/generations", timeout=GENERATION_S,
                         json={"prompt": "a purple cat eight", "n": 2, "steps": 2})
    assert unknown.status_code == 200, unknown.text
    assert unknown.json()["warnings"] == [
        "'a purple cat eight': the text encoder does not know purple, cat; ignored"]
    known = httpx.post(f"{router}/v1/images/generations", timeout=GENERATION_S,
                       json={"prompt": "a red eight", "steps": 2})
    assert known.status_code == 200 and known.json()["warnings"] == [], known.text


def test_each_prompt_and_a_negative_prompt_say_what_they_lost(router):
    long = "a red eight " * 12  # 36 words and the start and end tokens: 32 are read
    answer = httpx.post(f"{router}/v1/generate", timeout=GENERATION_S, json={
        "prompts": ["a red Eight", long, "a blue zebra"], "steps": 2,
        "negative_prompt": "a purple seven"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["truncated"] == [0, 6, 0, 0]
    assert answer.json()["warnings"] == [
        f"{long!r}: longer than the text encoder takes; its last 6 token(s) ignored",
        "'a blue zebra': the text encoder does not know zebra; ignored",
        "'a purple seven': the text encoder does not know purple; ignored"]


def test_the_stream_says_it_before_the_first_step(router):
    with httpx.stream("GET", f"{router}/v1/generate/stream", timeout=GENERATION_S,
                      params={"prompt": "a cat", "steps": 2}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("event: ")
                 or line.startswith("data: ")]
    assert lines[0] == "event: encoded", lines[:2]
    assert '"warnings":["\'a cat\': the text encoder does not know cat; ignored"]' in lines[1]


def test_the_page_starts_with_the_prompt_the_ddm_declares_and_it_loses_nothing(router):
    info = httpx.get(f"{router}/v1/info").json()
    assert info["example_prompt"] == EXAMPLE_PROMPT == "a thick red eight"
    answer = httpx.post(f"{router}/v1/images/generations", timeout=GENERATION_S,
                        json={"prompt": EXAMPLE_PROMPT, "steps": 2})
    assert answer.status_code == 200 and answer.json()["warnings"] == [], answer.text
    assert "info.example_prompt" in httpx.get(f"{router}/").text
