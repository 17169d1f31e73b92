"""The pool server's memory check (ddm.serving.model.memory), before anything loads:
each member's weights read exactly from its safetensors header (cast to --precision), the
activations of max_batch rows, the limit from the flag, or the container's cgroup; and what a
pool refuses before loading: a label checkpoint, a bad --member, a --max-batch beyond a
deployment's bound, an endless --max-delay-ms."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.deploy.limits import MAX_BATCH
from ddm.serving.model.server import create_model_app, parse_members
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.model.memory import (MemberBytes, MemoryLimit, PoolMemory,
                                            container_limit, member_bytes, memory_limit)
from tests.support.text_stages import write_text_ddm


@pytest.fixture(scope="module")
def ddm(tmp_path_factory) -> Path:
    return write_text_ddm(tmp_path_factory.mktemp("text") / "ddm", experts=1)


def _data_bytes(weights: Path) -> int:
    """The tensors' bytes: the file less its 8-byte length and JSON header."""
    (header,) = struct.unpack("<Q", weights.read_bytes()[:8])
    return weights.stat().st_size - 8 - header


@pytest.mark.parametrize("stage", ["expert_0", "text_encoder", "decoder", "router"])
def test_weights_are_the_header_s_bytes_and_halve_in_bfloat16(ddm, stage):
    (weights,) = (ddm / stage).glob("*.safetensors")
    stored = member_bytes(ddm / stage, None, 8)
    assert stored.weights == _data_bytes(weights)  # float32 as stored
    assert member_bytes(ddm / stage, "bfloat16", 8).weights == stored.weights // 2


def test_activations_grow_with_the_rows(ddm):
    one, many = (member_bytes(ddm / "expert_0", None, rows) for rows in (1, 16))
    assert one.activations > 0 and many.activations == 16 * one.activations
    assert member_bytes(ddm / "expert_0", "float16", 1).activations == one.activations // 2


def test_the_refusal_names_each_member_the_sum_and_the_limit():
    memory = PoolMemory({"expert-0": MemberBytes(1000, 200, 8),
                         "decoder": MemberBytes(500, 300, 8)},
                        MemoryLimit(1500, "--memory-limit-bytes"))
    assert not memory.fits and memory.total == 2000
    assert memory.refusal() == (
        "the pool's members do not fit: sum 2,000 bytes > limit 1,500 bytes "
        "(--memory-limit-bytes); 500 of the sum are activations, which the pool's maxBatch "
        "bounds: lower it or raise the limit; expert-0 1,200 bytes (1,000 of weights + 200 of "
        "activations for 8 rows); decoder 800 bytes (500 of weights + 300 of activations for 8 "
        "rows)")
    assert PoolMemory(memory.members, None).fits


@pytest.mark.parametrize("files,limit", [
    ({"memory.max": "max\n"}, None),
    ({"memory.max": "2147483648\n"}, 2147483648),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
    ({"memory/memory.limit_in_bytes": "1073741824\n"}, 1073741824),
    ({}, None),
])
def test_the_container_limit_is_cgroup_v2_s_or_v1_s(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = container_limit(tmp_path)
    assert (None if found is None else found.bytes) == limit
    assert memory_limit(None, "cpu", tmp_path) == found
    assert memory_limit(123, "cpu", tmp_path) == MemoryLimit(
        123, "--memory-limit-bytes: the pool's resources.limits.memory")


def test_a_pool_over_the_container_limit_is_refused_before_loading(ddm, tmp_path):
    (tmp_path / "memory.max").write_text("4096\n")
    with pytest.raises(ValueError, match=r"sum [\d,]+ bytes > limit 4,096 bytes \(cgroup "):
        create_model_app({"expert-0": ddm / "expert_0", "decoder": ddm / "decoder"},
                         hooks=Hooks(cgroup_root=tmp_path))


def test_a_broken_label_checkpoint_is_refused_naming_its_member(ddm, tmp_path):
    """Pools hold label checkpoints too (issue 36): one whose config.json is incomplete is
    refused before anything loads, naming the member."""
    (tmp_path / "config.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(CheckpointError, match="member e1: "):
        create_model_app({"e0": ddm / "expert_0", "e1": tmp_path})


def test_a_member_directory_that_is_missing_or_a_file_is_refused_as_such(ddm, tmp_path):
    """A mistyped --member path is named for what it is, not as a checkpoint that lacks its
    declaration (which would send the user to `ddm import`)."""
    missing, a_file = tmp_path / "missing", tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"member e1: {re.escape(str(missing))} does not "
                                              "exist"):
        create_model_app({"e0": ddm / "expert_0", "e1": missing})
    with pytest.raises(CheckpointError, match=f"member e1: {re.escape(str(a_file))} is a file, "
                                              "not a checkpoint directory"):
        create_model_app({"e0": ddm / "expert_0", "e1": a_file})


@pytest.mark.parametrize("specs,problem", [
    (["e0"], "'e0' is not NAME=DIR"),
    (["E0=/x"], "the name 'E0' must match"),
    (["e0=/x", "e0=/y"], "--member e0 is given twice"),
    ([], "at least one --member"),
])
def test_bad_members_are_refused_naming_them(specs, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        parse_members(specs)


@pytest.mark.parametrize("options,problem", [
    ({"max_batch": 0}, f"--max-batch must be in 1..{MAX_BATCH}, got 0"),
    ({"max_batch": MAX_BATCH + 1}, f"--max-batch must be in 1..{MAX_BATCH}, got {MAX_BATCH + 1}"),
    ({"max_delay_ms": -1.0}, "--max-delay-ms must be in 0..3600000, got -1.0"),
    ({"max_delay_ms": 1e13}, "--max-delay-ms must be in 0..3600000, got 10000000000000.0"),
    ({"max_delay_ms": float("inf")}, "--max-delay-ms must be in 0..3600000, got inf"),
    ({"max_delay_ms": float("nan")}, "--max-delay-ms must be in 0..3600000, got nan"),
])
def test_batching_no_router_could_use_is_refused_before_loading(options, problem):
    """A batch over a deployment's maxBatch would be ready yet refused by every router (its
    /v1/info out of bounds), and an endless delay would hold a lone request forever (one past
    the thread timers' limit fails in the batching thread); an hour is the most."""
    with pytest.raises(ValueError, match=re.escape(problem)):
        ServingOptions(**options)
    assert ServingOptions(max_batch=MAX_BATCH, max_delay_ms=3_600_000).max_batch == MAX_BATCH
