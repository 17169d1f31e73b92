"""The operator-wide allow-lists of images and checkpoint sources (``ddm.operator.policy``)."""

from __future__ import annotations

import pytest

from ddm.deploy.spec import parse_spec
from ddm.operator.config import OperatorConfig
from ddm.operator.policy import policy_problems

IMAGES = ("registry.acme.example/ddm/", "ddm:")
SOURCES = ("image://", "s3://acme-models/", "https://models.acme.example/ddm/")


def _spec(uri: str = "image:///m", image: str | None = None) -> dict:
    expert = {"name": "e", "checkpoint": {"uri": uri}, **({"image": image} if image else {})}
    return {"sampling": {"strategy": "top1"}, "router": {"checkpoint": {"uri": "image:///r"}},
            "experts": [expert]}


@pytest.mark.parametrize("image", [None, "registry.acme.example/ddm/cpu:1", "ddm:2.0",
                                   "registry.acme.example/ddm/sub/x@sha256:" + "0" * 64])
def test_images_inside_the_list_are_allowed(image: str | None) -> None:
    assert policy_problems(parse_spec(_spec(image=image)), IMAGES, SOURCES) == []


@pytest.mark.parametrize("image", ["registry.acme.example/ddm-evil/x:1", "ddm-evil:1",
                                   "evil.example/registry.acme.example/ddm/x:1"])
def test_an_image_outside_the_list_is_refused_naming_the_field(image: str) -> None:
    assert policy_problems(parse_spec(_spec(image=image)), IMAGES, SOURCES) == [
        f"spec.experts[0].image: {image!r} is not among the images this operator allows "
        "(DDM_ALLOWED_IMAGES: registry.acme.example/ddm/, ddm:)"]


@pytest.mark.parametrize("uri", ["s3://acme-models/a", "https://models.acme.example/ddm/a.tgz"])
def test_sources_inside_the_list_are_allowed(uri: str) -> None:
    assert policy_problems(parse_spec(_spec(uri)), IMAGES, SOURCES) == []


@pytest.mark.parametrize("uri, shown", [
    ("s3://acme-models-evil/a", "s3://acme-models-evil/a"),
    ("https://models.acme.example.evil.test/ddm/a?X-Amz-Signature=s",
     "https://models.acme.example.evil.test/ddm/a"),
    ("pvc://models/a", "pvc://models/a"),
])
def test_a_source_outside_the_list_is_refused_redacted(uri: str, shown: str) -> None:
    assert policy_problems(parse_spec(_spec(uri)), IMAGES, SOURCES) == [
        f"spec.experts[0].checkpoint.uri: {shown!r} is not among the checkpoint sources this "
        f"operator allows (DDM_ALLOWED_CHECKPOINT_SOURCES: {', '.join(SOURCES)})"]


def test_empty_lists_allow_everything() -> None:
    assert policy_problems(parse_spec(_spec("pvc://x/y", "any.example/x:1")), (), ()) == []


def test_the_lists_come_from_the_environment_and_a_stretchable_entry_is_refused() -> None:
    config = OperatorConfig.from_env({"DDM_ALLOWED_IMAGES": "ddm:, reg.example/",
                                      "DDM_ALLOWED_CHECKPOINT_SOURCES": "pvc://,s3://m/"})
    assert (config.allowed_images, config.allowed_checkpoint_sources) == (
        ("ddm:", "reg.example/"), ("pvc://", "s3://m/"))
    with pytest.raises(ValueError, match="'https://models.acme.example' must be a scheme"):
        OperatorConfig.from_env({"DDM_ALLOWED_CHECKPOINT_SOURCES": "https://models.acme.example"})
