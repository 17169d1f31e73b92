"""A text DDM's spec: conditioning, its text encoder and decoder stages, the router network's
placement, precision and guidance; and the clear errors for what does not fit together."""

from __future__ import annotations


import pytest

from ddm.deploy.spec import SpecError, parse_spec


def _text() -> dict:
    return {
        "conditioning": "text",
        "sampling": {"steps": 50, "strategy": "top2", "guidanceScale": 7.5,
                     "guidanceCutoff": 0.8},
        "textEncoder": {"checkpoint": {"uri": "pvc://paris/text_encoder"}},
        "decoder": {"checkpoint": {"uri": "pvc://paris/decoder"}, "placement": "separate",
                    "accelerator": {"type": "nvidia"}, "replicas": 2,
                    "precision": "bfloat16"},
        "router": {"checkpoint": {"uri": "pvc://paris/router"},
                   "network": {"placement": "separate", "accelerator": {"type": "neuron"},
                               "precision": "bfloat16"}},
        "experts": [{"name": f"expert-{k}", "checkpoint": {"uri": f"pvc://paris/expert_{k}"},
                     "accelerator": {"type": "nvidia"}, "precision": "bfloat16"}
                    for k in range(2)],
    }


def _problems(raw: dict) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    return "; ".join(caught.value.problems)


def test_a_text_ddm_with_its_stages_parses() -> None:
    spec = parse_spec(_text())
    assert spec.conditioning == "text"
    assert (spec.sampling.guidance_scale, spec.sampling.guidance_cutoff) == (7.5, 0.8)
    assert spec.text_encoder.placement == "router" and spec.text_encoder.precision is None
    assert spec.text_encoder.checkpoint.uri == "pvc://paris/text_encoder"
    decoder = spec.decoder
    assert (decoder.placement, decoder.accelerator.type, decoder.accelerator.count,
            decoder.replicas, decoder.precision) == ("separate", "nvidia", 1, 2, "bfloat16")
    network = spec.router.network
    assert network.checkpoint.uri == "pvc://paris/router" and network.separate
    assert network.accelerator.type == "neuron"
    assert [e.precision for e in spec.experts] == ["bfloat16", "bfloat16"]
    assert set(spec.stages) == {"text-encoder", "decoder", "router-network"}


def test_a_label_ddm_is_unguided_and_keeps_its_router_network_in_the_router() -> None:
    spec = parse_spec({"router": {"checkpoint": {"uri": "image:///r"}},
                       "experts": [{"name": "e", "checkpoint": {"uri": "image:///e"}}]})
    assert spec.conditioning == "labels" and spec.sampling.guidance_scale == 1.0
    assert spec.text_encoder is None and spec.decoder is None
    assert spec.stages["router-network"].placement == "router"


def _edit(change) -> dict:
    raw = _text()
    change(raw)
    return raw


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(numClasses=10),
     "spec.numClasses: only for conditioning: labels"),
    (lambda s: s["experts"][0].update(classes=[1]),
     "spec.experts[0].classes: only for conditioning: labels"),
    (lambda s: s.pop("textEncoder"),
     "spec.textEncoder: conditioning: text needs the text encoder"),
    (lambda s: s["sampling"].update(strategy="oracle"),
     "spec.sampling.strategy: oracle routes by label"),
    (lambda s: s.update(conditioning="image"),
     "spec.conditioning: must be one of labels, text, got 'image'"),
    (lambda s: s["sampling"].update(guidanceScale=51),
     "spec.sampling.guidanceScale: must be a number in [0, 50], got 51"),
    (lambda s: s["sampling"].update(guidanceCutoff=0),
     "spec.sampling.guidanceCutoff: must be a number in (0, 1], got 0"),
    (lambda s: s["experts"][1].update(precision="fp8"),
     "spec.experts[1].precision: must be one of float32, bfloat16, float16, got 'fp8'"),
    (lambda s: s["textEncoder"].update(accelerator={"type": "nvidia"}),
     "spec.textEncoder.accelerator: only for placement: separate"),
    (lambda s: s["textEncoder"].update(replicas=3),
     "spec.textEncoder.replicas: only for placement: separate"),
    (lambda s: s["decoder"].pop("checkpoint"),
     "spec.decoder.checkpoint: is required"),
    (lambda s: s["decoder"].update(placement="edge"),
     "spec.decoder.placement: must be one of router, separate, got 'edge'"),
    (lambda s: s["decoder"]["accelerator"].update(count=9),
     "spec.decoder.accelerator.count: 9 is not a size nvidia offers per pod"),
    (lambda s: s["router"]["network"].update(checkpoint={"uri": "pvc://x/y"}),
     "spec.router.network: unknown fields ['checkpoint']"),
    (lambda s: s["router"].pop("checkpoint"),
     "spec.router.network: places the router network: it needs spec.router.checkpoint"),
])
def test_what_does_not_fit_a_text_ddm_is_named(change, message: str) -> None:
    assert message in _problems(_edit(change))


def test_a_label_ddm_takes_no_text_encoder_and_no_guidance() -> None:
    raw = {"router": {"checkpoint": {"uri": "image:///r"}},
           "sampling": {"guidanceScale": 3},
           "textEncoder": {"checkpoint": {"uri": "image:///t"}},
           "experts": [{"name": "e", "checkpoint": {"uri": "image:///e"}}]}
    problems = _problems(raw)
    assert "spec.textEncoder: only for conditioning: text" in problems
    assert "spec.sampling.guidanceScale: classifier-free guidance needs conditioning: text" \
        in problems


def test_the_routers_context_store_is_set_in_the_spec_and_reaches_router_yaml() -> None:
    from ddm.deploy.plan import plan_deployment

    raw = _text()
    assert plan_deployment(parse_spec(raw)).router.limits.context_cache_bytes == 256 << 20
    raw["router"]["contextCacheBytes"] = 64 << 20
    assert plan_deployment(parse_spec(raw)).router.limits.context_cache_bytes == 64 << 20
    raw["router"]["contextCacheBytes"] = 0
    assert _problems(raw) == ("spec.router.contextCacheBytes: must be an integer in "
                              "1..68719476736, got 0")
