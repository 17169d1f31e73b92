"""What the router accepts of an expert's ``/v1/info``: every field it uses, strictly typed and
within the deployment's limits (``ddm.deploy.limits``); anything else is refused, naming the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddm.deploy.limits import (MAX_BATCH, MAX_CLASS, MAX_EXPERT_TEXT, MAX_IMAGE_CHANNELS,
                               MAX_IMAGE_SIDE)
from ddm.serving.router.fleet.replicas import ExpertInfo, InvalidReport

VALID = {"image_shape": [1, 16, 16], "classes": [0, 1, 2], "max_batch": 8,
         "convention": "linear-fm/x0-to-x1/v=x1-x0", "serves": "velocity",
         "partition": {"scheme": {"method": "labels", "groups": [[0, 1, 2]]}, "index": 0},
         "name": "anything else is ignored"}


def test_a_valid_report_is_read_as_sent():
    assert ExpertInfo.from_json(VALID) == ExpertInfo(
        (1, 16, 16), (0, 1, 2), 8, convention=VALID["convention"], serves="velocity",
        partition=VALID["partition"])


def test_the_largest_valid_report_is_accepted():
    largest = {**VALID, "image_shape": [MAX_IMAGE_CHANNELS, MAX_IMAGE_SIDE, MAX_IMAGE_SIDE],
               "max_batch": MAX_BATCH, "classes": list(range(MAX_CLASS + 1)),
               "convention": "c" * MAX_EXPERT_TEXT, "partition": None, "serves": None}
    assert ExpertInfo.from_json(largest).max_batch == MAX_BATCH


@pytest.mark.parametrize(("changes", "named"), [
    ({"max_batch": 0}, f"max_batch must be an integer in 1..{MAX_BATCH}, got 0"),
    ({"max_batch": -1}, "max_batch must be an integer in 1..4096, got -1"),
    ({"max_batch": MAX_BATCH + 1}, "max_batch must be an integer in 1..4096, got 4097"),
    ({"max_batch": 8.0}, "max_batch must be an integer in 1..4096, got 8.0"),
    ({"max_batch": True}, "max_batch must be an integer in 1..4096, got True"),
    ({"max_batch": "8"}, "max_batch must be an integer in 1..4096, got '8'"),
    ({"max_batch": None}, "got None"),
    ({"image_shape": [1, 100_000, 100_000]}, "image_shape must be (C, H, W) with C in 1..16"),
    ({"image_shape": [0, 16, 16]}, "image_shape must be (C, H, W)"),
    ({"image_shape": [17, 16, 16]}, "image_shape must be (C, H, W)"),
    ({"image_shape": [16, 16]}, "image_shape must be a list of 3..3 integers"),
    ({"image_shape": [1, 16, 16.5]}, "image_shape must be a list of 3..3 integers"),
    ({"image_shape": "1x16x16"}, "image_shape must be a list"),
    ({"classes": [0, 0]}, f"classes must be distinct integers in 0..{MAX_CLASS}"),
    ({"classes": [-1]}, "classes must be distinct integers"),
    ({"classes": [MAX_CLASS + 1]}, "classes must be distinct integers"),
    ({"classes": list(range(MAX_CLASS + 2))}, "classes must be a list of 0..1000 integers"),
    ({"classes": {"0": 1}}, "classes must be a list"),
    ({"convention": "c" * (MAX_EXPERT_TEXT + 1)},
     f"convention must be a string of at most {MAX_EXPERT_TEXT} characters or null"),
    ({"serves": ["velocity"]}, "serves must be a string"),
    ({"partition": "labels"}, "partition must be an object or null, got 'labels'"),
    ({"partition": {"index": "0"}}, "partition.index must be an integer in 0..15, got '0'"),
    ({"partition": {"index": 16}}, "partition.index must be an integer in 0..15, got 16"),
    ({"conditioning": "images"}, "conditioning must be 'labels' or 'text', got 'images'"),
    ({"conditioning": "text"}, "text_width must be an integer in 1..8192 for a text expert"),
    ({"conditioning": "text", "text_width": 8193}, "text_width must be an integer in 1..8192"),
    ({"conditioning": "text", "text_width": 768.0}, "text_width must be an integer"),
    ({"text_width": 768}, "text_width must be an integer in 1..8192 for a text expert (null "
                          "for labels)"),
    ({"wire_dtype": "int8"}, "wire_dtype must be one of float32, bfloat16, float16"),
    ({"cluster": 16}, "cluster must be an integer in 0..15 or null, got 16"),
    # A guided row of a text expert runs as 2 forward rows: a batch of 1 holds none.
    ({"conditioning": "text", "text_width": 768, "classes": [], "max_batch": 1},
     "max_batch must be at least 2 for a text expert (a guided row runs as 2 forward rows), "
     "got 1"),
])
def test_a_report_out_of_bounds_or_of_the_wrong_type_is_refused_naming_the_field(changes, named):
    with pytest.raises(InvalidReport) as refused:
        ExpertInfo.from_json({**VALID, **changes})
    assert named in str(refused.value)


def test_a_text_experts_report_is_read_with_its_width_dtype_and_cluster():
    info = ExpertInfo.from_json({**VALID, "classes": [], "conditioning": "text",
                                 "text_width": 768, "wire_dtype": "bfloat16", "cluster": 3})
    assert (info.conditioning, info.text_width, info.wire_dtype, info.cluster) == (
        "text", 768, "bfloat16", 3)
    assert info.rows_per_call == 4  # half its max_batch: each row may be guided


@pytest.mark.parametrize("field", ["image_shape", "classes", "max_batch"])
def test_a_report_without_a_required_field_is_refused(field):
    with pytest.raises(InvalidReport, match=f"^{field} must be"):
        ExpertInfo.from_json({k: v for k, v in VALID.items() if k != field})


def test_the_shipped_k_means_partition_is_accepted_and_one_nested_too_deeply_is_refused():
    """The router hashes an expert's partition with ``json.dumps``: one nested 900 deep passed
    ``json.loads`` in the probe, then overflowed the stack in every ``/readyz`` and generation
    (500s for all experts; tests/integration/test_hostile_experts.py)."""
    mnist = Path(__file__).resolve().parents[2] / "checkpoints" / "mnist" / "expert-0"
    shipped = json.loads((mnist / "config.json").read_text())["partition"]
    assert ExpertInfo.from_json({**VALID, "partition": shipped}).partition == shipped
    deep: object = 0
    for _ in range(900):
        deep = [deep]
    with pytest.raises(InvalidReport, match="^partition nests objects and lists more than 8 "):
        ExpertInfo.from_json({**VALID, "partition": {"scheme": {"centroids": deep}}})


def test_a_report_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidReport, match="not a JSON object"):
        ExpertInfo.from_json([VALID])


def test_what_an_expert_sent_is_quoted_cut_short():
    """A refusal goes to the log: a megabyte string must not become a megabyte log line."""
    with pytest.raises(InvalidReport) as refused:
        ExpertInfo.from_json({**VALID, "convention": "x" * 1_000_000})
    assert len(str(refused.value)) < 200


@pytest.mark.parametrize("field, shape", [
    ("image_shape", [3, 0, 64]), ("image_shape", [MAX_IMAGE_CHANNELS + 1, 64, 64]),
    ("latent_shape", [4, 8]), ("latent_shape", [4, 8.0, 8]),
])
def test_a_stage_servers_shapes_are_held_to_the_experts_limits(field, shape):
    from ddm.serving.router.fleet.stage_clients import StageInfo

    report = {"role": "decoder", "max_batch": 4, "wire_dtype": "float32",
              "latent_shape": [4, 8, 8], "image_shape": [3, 64, 64]} | {field: shape}
    with pytest.raises(InvalidReport, match=field):
        StageInfo.from_json(report)
    assert StageInfo.from_json(report | {field: [3 if field == "image_shape" else 4, 8, 8]})


@pytest.mark.parametrize("image_shape", [[1, 64, 64], [3, 60, 64]])
def test_a_decoder_that_makes_no_rgb_image_at_a_multiple_of_its_latents_is_refused(
        image_shape):
    # The router sends RGB PNGs of what the decoder makes: another decoder made every
    # stream fail with a 500.
    from ddm.serving.router.fleet.stage_clients import StageInfo

    report = {"role": "decoder", "max_batch": 4, "wire_dtype": "float32",
              "latent_shape": [4, 8, 8], "image_shape": image_shape}
    with pytest.raises(InvalidReport, match="RGB"):
        StageInfo.from_json(report)
