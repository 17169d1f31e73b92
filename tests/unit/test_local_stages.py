"""``ddm up`` runs a text DDM's stages from the same plan as the operator: a stage placed
``separate`` becomes ``ddm serve stage`` processes the router reaches at their loopback
ports, one placed ``router`` is loaded by the router from its local directory; stage
checkpoints that declare different state shapes are refused before anything starts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ddm.checkpoints.declared import DDM_KEY
from ddm.cli import build_parser
from ddm.deploy.spec import parse_manifest
from ddm.runtime.local import LocalRunError, plan_local


def _stage_dir(root: Path, name: str, shape: list[int] | None) -> str:
    directory = root / name
    directory.mkdir()
    block = {"role": "x"} if shape is None else {"role": "x", "latent_shape": shape}
    (directory / "config.json").write_text(json.dumps({DDM_KEY: block}))
    return f"file://{directory}"


def _manifest(root: Path, decoder_shape: list[int] = [4, 8, 8]) -> dict:
    uri = {name: _stage_dir(root, name, shape) for name, shape in (
        ("expert_0", [4, 8, 8]), ("expert_1", [4, 8, 8]), ("router", [4, 8, 8]),
        ("text_encoder", None), ("decoder", decoder_shape))}
    return parse_manifest({
        "apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment",
        "metadata": {"name": "paris"},
        "spec": {
            "conditioning": "text", "sampling": {"strategy": "top2", "guidanceScale": 7.5},
            "textEncoder": {"checkpoint": {"uri": uri["text_encoder"]}, "precision": "float32"},
            "decoder": {"checkpoint": {"uri": uri["decoder"]}, "placement": "separate",
                        "replicas": 2, "precision": "bfloat16"},
            "router": {"checkpoint": {"uri": uri["router"]}},
            "experts": [{"name": f"expert-{k}", "checkpoint": {"uri": uri[f"expert_{k}"]}}
                        for k in range(2)]}}, allow_host_paths=True)


def test_separate_stages_are_processes_and_the_router_loads_the_others(tmp_path: Path) -> None:
    plan = plan_local(_manifest(tmp_path), itertools.count(20000).__next__, 8080)
    assert [p.name for p in plan.stages] == ["decoder/0", "decoder/1"]
    served = build_parser().parse_args(list(plan.stages[0].argv[3:]))
    assert (served.command, served.role, served.checkpoint, served.port, served.precision) == (
        "serve", "stage", tmp_path / "decoder", plan.stages[0].port, "bfloat16")
    assert plan.stages[0].argv[-4:] == ("--precision", "bfloat16", "--log-level", "warning")
    # weights load without progress bars in the log every process shares
    assert all(("HF_HUB_DISABLE_PROGRESS_BARS", "1") in p.env
               for p in (*plan.stages, *plan.experts, plan.router))
    config = plan.router_config
    assert config.decoder.discovery.endpoints == tuple(f"127.0.0.1:{p.port}"
                                                      for p in plan.stages)
    assert (config.text_encoder.checkpoint, config.text_encoder.precision) == (
        str(tmp_path / "text_encoder"), "float32")
    assert config.router_network.checkpoint == str(tmp_path / "router")
    assert config.sampling.guidance_scale == 7.5


def test_stages_that_disagree_on_the_state_shape_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LocalRunError, match=r"disagree on the state shape.*decoder \[3, 8, 8\]"):
        plan_local(_manifest(tmp_path, decoder_shape=[3, 8, 8]),
                   itertools.count(20000).__next__, 8080)
