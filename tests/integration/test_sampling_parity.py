"""``ddm sample``'s driver and the router's give the same pixels: one loop, two drivers.

Real expert servers and a real router over HTTP on loopback, against the in-process driver in
this process, for every strategy, batch 1 and 7, Euler and Heun. Two DDMs: the shipped digits
(experts trained on labels 0-4 and 5-9, so the label mask decides every learned strategy) and
``shared``, random smoke experts that both serve every label under a random router network (as
k-means clusters may), so that the learned strategies really mix experts.
"""

from __future__ import annotations

import base64
import json
import io
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from ddm.checkpoints.format import CheckpointMeta, read_meta, save_checkpoint
from ddm.deploy.router_config import RouterConfigFile
from ddm.models.config import UNET_CONFIGS, RouterNetworkConfig
from ddm.models.ddm import DDM, load_ddm
from ddm.models.router_net import RouterNet
from ddm.models.torch_io import canonical_weights
from ddm.models.torch_unet import UNet
from ddm.sampling.pipeline import generate
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"
STRATEGIES = ("oracle", "top1", "top2", "topk:2", "threshold:0.2", "ensemble")
BATCHES = {1: [6], 7: [0, 3, 5, 7, 9, 2, 8]}
STEPS = 6




@pytest.fixture(scope="module")
def ddm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"digits": DIGITS, "shared": _shared_ddm(tmp_path_factory.mktemp("shared"))}


@pytest.fixture(scope="module")
def routers(ddm_dirs: dict[str, Path]) -> Iterator[dict[str, str]]:
    """Base URL of a router over real expert servers, per DDM."""
    with ExitStack() as stack:
        bases = {}
        for name, root in ddm_dirs.items():
            experts = sorted((p for p in root.iterdir() if (p / "config.json").exists()
                              and read_meta(p).kind == "expert"),
                             key=lambda p: read_meta(p).partition["index"])
            entries = []
            for path in experts:
                base = stack.enter_context(running(create_model_app(
                    path, ServingOptions(max_batch=8))))
                wait_ready(base)
                entries.append({"name": read_meta(path).name,
                                "classes": list(read_meta(path).classes),
                                "discovery": {"endpoints": [base.removeprefix("http://")]}})
            config = RouterConfigFile.from_dict({"experts": entries,
                                                 "router_checkpoint": str(root / "router")})
            bases[name] = stack.enter_context(running(create_router_app(config)))
            wait_ready(bases[name])
        yield bases


@pytest.fixture(scope="module")
def in_process(ddm_dirs: dict[str, Path]) -> dict[str, DDM]:
    return {name: load_ddm(root, backends=("torch",)) for name, root in ddm_dirs.items()}


CASES = [(ddm, strategy, batch, solver)
         for ddm in ("digits", "shared") for strategy in STRATEGIES
         for batch in BATCHES for solver in ("euler", "heun")
         if not (ddm == "shared" and strategy == "oracle")]  # shared experts overlap


@pytest.mark.parametrize("ddm,strategy,batch,solver", CASES)
def test_router_and_in_process_sampling_give_the_same_pixels(routers, in_process, ddm, strategy,
                                                             batch, solver):
    labels, seed = BATCHES[batch], 11 + batch
    reply = httpx.post(f"{routers[ddm]}/v1/generate", timeout=120, json={
        "labels": labels, "steps": STEPS, "seed": seed, "strategy": strategy, "solver": solver})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    local = generate(in_process[ddm], labels, STEPS, seed, strategy, solver)
    served = np.stack([_image(png) for png in body["images"]])
    np.testing.assert_array_equal(served, local.images)
    assert body["expert_calls"] == local.expert_calls.tolist()
    assert body["experts"] == local.experts_used()
    assert body["routing"] == local.usage.step_masks(STEPS).tolist()
    assert [len(r) for r in body["routing"]] == [STEPS] * len(labels)


def test_the_api_shows_each_images_experts_at_each_step(routers, in_process):
    """POST /v1/generate's routing, the stream's step events and its done event agree with
    each other and with the in-process loop, step by step, for the mixing DDM."""
    labels, seed = BATCHES[7], 5
    reply = httpx.post(f"{routers['shared']}/v1/generate", timeout=120, json={
        "labels": labels, "steps": STEPS, "seed": seed, "strategy": "top1", "solver": "heun"})
    body = reply.json()
    names = body["expert_names"]
    assert names == ["s0", "s1"]
    decoded = [[[n for k, n in enumerate(names) if mask >> k & 1] for mask in row]
               for row in body["routing"]]
    assert all(1 <= len(step) <= 2 for row in decoded for step in row)
    assert {frozenset(n for step in row for n in step) for row in decoded} == {
        frozenset(e) for e in body["experts"]}
    local = generate(in_process["shared"], labels, STEPS, seed, "top1", "heun")
    assert body["routing"] == local.usage.step_masks(STEPS).tolist()
    assert len({tuple(r) for r in body["routing"]}) > 1  # images are routed differently

    with httpx.stream("GET", f"{routers['shared']}/v1/generate/stream", timeout=120, params={
            "label": labels[3], "steps": STEPS, "seed": seed, "strategy": "top1",
            "solver": "heun"}) as stream:
        events = _sse_events(stream.iter_lines())
    steps = [data for kind, data in events if kind == "step"]
    done = next(data for kind, data in events if kind == "done")
    assert [s["experts"] for s in steps] == [
        [n for k, n in enumerate(names) if mask >> k & 1] for mask in done["routing"]]
    # The stream makes image 0 of (seed): the same as a one-label generation in-process.
    alone = generate(in_process["shared"], [labels[3]], STEPS, seed, "top1", "heun")
    assert done["routing"] == alone.usage.step_masks(STEPS)[0].tolist()


def _sse_events(lines) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: "):])))
    return events


def test_learned_strategies_really_mix_the_shared_experts(in_process):
    """Otherwise the parity above would say little about mixing: on ``shared`` top-1 and
    top-2 (of two experts, the ensemble) give different images, and top-2 uses both experts."""
    labels = BATCHES[7]
    top1, top2 = (generate(in_process["shared"], labels, STEPS, 18, s) for s in ("top1", "top2"))
    assert not np.array_equal(top1.images, top2.images)
    assert all(len(names) == 2 for names in top2.experts_used())


@pytest.mark.parametrize("strategy", ["oracle", "top1"])
def test_delegation_over_http_equals_the_in_process_delegation(routers, in_process, strategy):
    """Delegation is the loop's: the router's integrate requests to the experts give what the
    in-process driver gives; on the digits DDM each label has one expert, so no sample switches
    experts and delegating is exact (the documented bound), in one round trip per chunk."""
    labels = BATCHES[7]
    reply = httpx.post(f"{routers['digits']}/v1/generate", timeout=120, json={
        "labels": labels, "steps": STEPS, "seed": 4, "strategy": strategy,
        "delegate_steps": 4})
    assert reply.status_code == 200, reply.text
    served = np.stack([_image(png) for png in reply.json()["images"]])
    delegated = generate(in_process["digits"], labels, STEPS, 4, strategy, delegate_steps=4)
    per_step = generate(in_process["digits"], labels, STEPS, 4, strategy)
    np.testing.assert_array_equal(served, delegated.images)
    np.testing.assert_array_equal(delegated.images, per_step.images)
    assert reply.json()["round_trips"] == [2] * len(labels)  # ceil(6 / 4) chunks


def test_ddm_sample_from_a_router_equals_ddm_sample_in_process(routers, ddm_dirs, tmp_path):
    """``ddm sample --router`` splits a run into requests of 3 labels, each passing its
    ``first_index``: the samples file equals the one ``ddm sample`` makes in one batch."""
    from ddm.cli import main
    from ddm.samples import load_samples_npz

    common = ["--labels", "1,4,8", "--n-per-label", "3", "--steps", str(STEPS), "--seed", "9",
              "--strategy", "top2"]
    assert main(["sample", "--router", routers["shared"], "--batch-size", "3", *common,
                 "--out", str(tmp_path / "served.npz")]) == 0
    assert main(["sample", "--checkpoints", str(ddm_dirs["shared"]), "--backend", "torch",
                 *common, "--out", str(tmp_path / "local.npz")]) == 0
    served, local = (load_samples_npz(tmp_path / f"{n}.npz") for n in ("served", "local"))
    np.testing.assert_array_equal(served.images, local.images)
    np.testing.assert_array_equal(served.labels, local.labels)
    np.testing.assert_array_equal(served.expert_calls, local.expert_calls)
    # the same noise in different requests would have repeated images across labels
    assert len({image.tobytes() for image in served.images}) == 9


def test_ddm_sample_names_a_router_that_refuses(routers, tmp_path, capsys):
    from ddm.cli import main

    assert main(["sample", "--router", routers["shared"], "--labels", "12",
                 "--out", str(tmp_path / "x.npz")]) == 1
    error = capsys.readouterr().err
    assert "answered 422" in error and "12" in error
    assert not (tmp_path / "x.npz").exists()
    assert main(["sample", "--router", routers["shared"], "--checkpoints", str(DIGITS),
                 "--out", str(tmp_path / "x.npz")]) == 2
    assert "--checkpoints" in capsys.readouterr().err


def _shared_ddm(root: Path) -> Path:
    """Two random smoke experts serving every label (k-means-like), a random router."""
    smoke = UNET_CONFIGS["smoke"]
    scheme = {"method": "kmeans", "groups": [list(range(10))] * 2}
    for index in range(2):
        torch.manual_seed(20 + index)
        meta = CheckpointMeta(kind="expert", name=f"s{index}", architecture=smoke.to_dict(),
                              framework="torch", classes=range(10),
                              partition={"scheme": scheme, "index": index})
        save_checkpoint(root / f"s{index}", meta, canonical_weights(UNet(smoke)))
    torch.manual_seed(29)
    network = RouterNetworkConfig(image_size=smoke.image_size, num_experts=2)
    save_checkpoint(root / "router",
                    CheckpointMeta(kind="router", name="router", architecture=network.to_dict(),
                                   framework="torch", classes=range(10),
                                   partition={"scheme": scheme}),
                    canonical_weights(RouterNet(network)))
    return root


def _image(png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))
