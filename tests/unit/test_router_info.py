"""What the router's /v1/info says of its DDM (ddm.serving.router.api.info): the strategies the DDM
can serve, and each expert's card from router.yaml and the expert's own word, which is a
peer's and so is cut to size and typed, never trusted."""

from __future__ import annotations

from ddm.deploy.router_config import (ExpertEntry, RouterConfigFile, SamplingDefaults,
                                      StaticDiscovery)
from ddm.serving.router.api.info import expert_card, strategies, trained_on
from ddm.deploy.limits import MAX_EXPERT_TEXT
from ddm.serving.router.fleet.replicas import ExpertInfo

HERE = StaticDiscovery(("127.0.0.1:1",))


def _config(classes: list[list[int]], router: str | None) -> RouterConfigFile:
    return RouterConfigFile(
        experts=tuple(ExpertEntry(f"e{k}", HERE, tuple(c)) for k, c in enumerate(classes)),
        router_checkpoint=router, sampling=SamplingDefaults(strategy="top1" if router else
                                                            "oracle"))


def test_only_a_partition_by_label_offers_the_oracle():
    assert strategies(_config([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], "router")) == [
        "oracle", "top1", "top2", "threshold:0.2", "ensemble"]
    assert strategies(_config([[], []], "router")) == [  # k-means: every expert, every label
        "top1", "top2", "threshold:0.2", "ensemble"]
    assert strategies(_config([[0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9]], "router"))[0] == "top1"
    assert strategies(_config([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], None)) == ["oracle"]


def test_a_k_means_expert_is_a_cluster_with_what_runs_it():
    info = ExpertInfo.from_json({
        "image_shape": [1, 32, 32], "classes": list(range(10)), "max_batch": 8,
        "partition": {"index": 2, "scheme": {"method": "kmeans", "centroids": [[0.0]] * 4,
                                             "features": {"name": "hog"}}},
        "data": {"name": "mnist-32x32/train/part2", "images": 11574},
        "framework": "jax", "runtime": "jax 0.10.2", "device": "gpu:0",
        "hardware": "NVIDIA H100 80GB HBM3"})
    card = expert_card(ExpertEntry("mnist-cluster-2", HERE), info, {"127.0.0.1:1": "ready"}, 1)
    assert card == {
        "name": "mnist-cluster-2", "ready_replicas": 1, "replicas": {"127.0.0.1:1": "ready"},
        "framework": "jax", "runtime": "jax 0.10.2", "device": "gpu:0",
        "hardware": "NVIDIA H100 80GB HBM3",
        "trained_on": {"partition": "kmeans", "part": 2, "parts": 4, "features": "hog",
                       "labels": None, "data": "mnist-32x32/train/part2", "images": 11574,
                       "summary": None}}


def test_a_text_expert_says_its_cluster_size_and_digits():
    # as a stage server reports an expert's _ddm.trained_on (ddm.models.trained_on)
    info = ExpertInfo.from_json({
        "image_shape": [4, 8, 8], "classes": [], "max_batch": 8, "conditioning": "text",
        "text_width": 128, "summary": "digits 0, 5, 8, 9",
        "partition": {"index": 0, "scheme": {"method": "kmeans", "clusters": 4,
                                             "features": {"name": "clip image"}}},
        "data": {"name": "coloured MNIST", "images": 23251}})
    assert trained_on(ExpertEntry("expert-0", HERE), info) == {
        "partition": "kmeans", "part": 0, "parts": 4, "features": "clip image", "labels": None,
        "data": "coloured MNIST", "images": 23251, "summary": "digits 0, 5, 8, 9"}


def test_an_expert_not_heard_from_or_saying_nonsense_gets_an_honest_card():
    entry = ExpertEntry("e0", HERE, (0, 1))
    assert expert_card(entry, None, {}, 0)["trained_on"] == {
        "partition": None, "part": None, "parts": None, "features": None, "labels": [0, 1],
        "data": None, "images": None, "summary": None}
    hostile = ExpertInfo.from_json({
        "image_shape": [1, 8, 8], "classes": [0, 1], "max_batch": 1,
        "partition": {"index": 0, "scheme": {"method": ["labels"], "groups": "many",
                                                "features": "hog"}},
        "data": {"name": 7, "images": -3}, "framework": {"x": 1}, "hardware": "x" * 100_000,
        "summary": ["digits"]})
    card = expert_card(entry, hostile, {}, 0)
    assert len(card["hardware"]) == MAX_EXPERT_TEXT and card["framework"] is None
    assert trained_on(entry, hostile) == {
        "partition": None, "part": 0, "parts": None, "features": None, "labels": [0, 1],
        "data": None, "images": None, "summary": None}
