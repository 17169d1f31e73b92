"""``compile`` (issue 37's GPU path): the spec's field on an expert and on a pool, refused
where the server's backend is not torch and on a pooled component, carried to the model
server as ``--compile``; the serving options' own refusals; a compiled call padded to its
bucket and cut back."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ddm.conditioning import Conditioning
from ddm.deploy.plan import plan_deployment
from ddm.deploy import spec
from ddm.deploy.spec import SpecError, parse_spec
from ddm.runtime.local import plan_local
from ddm.serving.model.compiled import bucketed
from ddm.serving.model.options import ServingOptions


def _text_ddm(**pool: Any) -> dict[str, Any]:
    """Two experts in one nvidia pool (with ``pool``'s fields), a third alone."""
    def checkpoint(name: str) -> dict[str, Any]:
        return {"uri": f"image:///opt/ddm/checkpoints/{name}"}

    return {
        "conditioning": "text",
        "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}, "maxBatch": 16, **pool}],
        "textEncoder": {"checkpoint": checkpoint("clip")},
        "router": {"checkpoint": checkpoint("router")},
        "experts": [{"name": "expert-0", "checkpoint": checkpoint("e0"), "pool": "gpu"},
                    {"name": "expert-1", "checkpoint": checkpoint("e1"), "pool": "gpu"},
                    {"name": "expert-2", "checkpoint": checkpoint("e2"),
                     "accelerator": {"type": "nvidia"}}],
    }


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    return list(caught.value.problems)


def test_a_pool_and_an_expert_pass_their_compile_mode_to_their_servers() -> None:
    raw = _text_ddm(compile="reduce-overhead")
    raw["experts"][2]["compile"] = "default"
    plan = plan_deployment(parse_spec(raw))
    (pool,) = plan.pools
    assert pool.args[pool.args.index("--compile") + 1] == "reduce-overhead"
    alone = next(e for e in plan.experts if e.name == "expert-2")
    assert alone.args[alone.args.index("--compile") + 1] == "default"
    # Unset: no flag, the server's default (eager).
    assert "--compile" not in plan_deployment(parse_spec(_text_ddm())).pools[0].args


def test_ddm_up_starts_a_compiled_pool_with_its_mode() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "text2img-pooled.yaml"
    document = yaml.safe_load(example.read_text())
    document["spec"]["pools"][0]["compile"] = "reduce-overhead"
    plan = plan_local(spec.parse_manifest(document, allow_host_paths=True),
                      itertools.count(20000).__next__, 8080,
                      locate=lambda source: Path("/fetched") / source.path.strip("/"))
    (server,) = plan.servers
    assert server.argv[server.argv.index("--compile") + 1] == "reduce-overhead"


def test_an_unknown_mode_is_refused_naming_the_field_and_the_choices() -> None:
    raw = _text_ddm(compile="fast")
    (problem,) = _problems(raw)
    assert problem.startswith("spec.pools[0].compile")
    assert "reduce-overhead" in problem and "'fast'" in problem


def test_a_pooled_expert_gives_its_compile_mode_on_its_pool() -> None:
    raw = _text_ddm()
    raw["experts"][0]["compile"] = "default"
    (problem,) = _problems(raw)
    assert problem.startswith("spec.experts[0].compile") and "spec.pools" in problem


@pytest.mark.parametrize("accelerator, framework, backend", [
    ("nvidia", "jax", "jax"), ("neuron", "torch", "neuron")])
def test_compile_is_refused_where_the_server_runs_no_torch_backend(
        accelerator: str, framework: str, backend: str) -> None:
    raw = _text_ddm()
    raw["experts"][2].update(accelerator={"type": accelerator}, framework=framework,
                             compile="reduce-overhead")
    (problem,) = _problems(raw)
    assert problem.startswith("spec.experts[2].compile")
    assert f"the {backend} backend" in problem and "give compile none" in problem


def test_the_serving_options_refuse_an_unknown_mode_and_another_backend() -> None:
    with pytest.raises(ValueError, match=r"--compile must be one of none, default, "
                                         r"reduce-overhead, max-autotune, got 'fast'"):
        ServingOptions(compile="fast")
    with pytest.raises(ValueError, match="the jax backend XLA compiles"):
        ServingOptions(backend="jax", compile="default")
    assert ServingOptions(backend="jax", compile="none").compile == "none"


def test_the_serving_options_refuse_an_unknown_grouped_forward_mode() -> None:
    with pytest.raises(ValueError, match=r"--grouped-forward must be one of auto, on, off, "
                                         r"got 'always'"):
        ServingOptions(grouped_forward="always")
    assert ServingOptions().grouped_forward == "auto"


def test_a_compiled_call_runs_at_its_bucket_and_answers_its_own_rows() -> None:
    seen = []

    def forward(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        seen.append((x.shape[0], t.shape[0], len(cond)))
        assert cond.embeddings is not None
        return x * t[:, None] + cond.embeddings.sum(axis=(1, 2))[:, None]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2)).astype(np.float32)
    t = np.array([0.1, 0.5, 0.9], np.float32)
    cond = Conditioning(embeddings=rng.standard_normal((3, 4, 5)).astype(np.float32))
    out = bucketed(forward, (1, 2, 4, 8))(x, t, cond)
    assert seen == [(4, 4, 4)]
    np.testing.assert_array_equal(out, forward(x, t, cond))
    bucketed(forward, (1, 2, 4, 8))(x[:1], t[:1], cond.take([0]))
    assert seen[-1] == (1, 1, 1)  # a bucket's own size runs unpadded
