"""``python -m benchmarks paris-pools`` (issue 37): the pooled manifest it derives from an
imported Paris release, its settings, and one quick run end to end.

The quick run writes a Paris-shaped release (eight experts, the router network, the text
encoder and the decoder; random weights), imports it with ``ddm import paris``, serves it as
one pool and samples it in-process at 2 steps and 1 and 2 prompts; it checks the JSON's shape,
that one pool process served every member (and ran the batches one image needs), and that
every process it started is gone after, not the figures themselves, which depend on the
machine.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from benchmarks.paris_pools import (IMPORTED, PLACEMENT_FIELDS, POOL, SIZES, ParisPoolSettings,
                                    bench_paris_pools, compiled_manifest, imported_release,
                                    pooled_manifest, targets)
from benchmarks.__main__ import build_parser
from benchmarks.pools import PoolBenchSettings
from ddm.deploy.plan import plan_deployment
from ddm.deploy.spec import load_manifest
from tests.support.paris_release import TinyParis, write_paris_release


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ddm.cli import main

    root = tmp_path_factory.mktemp("paris")
    release = write_paris_release(root / "release", TinyParis(experts=2))
    assert main(["import", "paris", str(release), "--out", str(root / "out"),
                 "--accelerator", "nvidia", "--precision", "bfloat16"]) == 0
    return root / "out"


def test_on_a_gpu_the_pool_and_in_process_are_compared_by_the_gpu_memory_each_used() -> None:
    """Host RSS says nothing of a GPU's memory: a full-size run on one judges the pool's
    memory in use on the GPU against in-process sampling's, each read alone on it, and the
    H200 figures; the host-memory ratio stays, as measured."""
    level = {"images_per_s": 9.0, "latency_s": {"p50": 0.2}}
    result = {
        "settings": {"size": "full", "compile": ["none"],
                     "load": {"concurrency": [1, 32]}},
        "deployments": {"pooled": {"total_mib": {"lifetime_peak": 30_000.0},
                                   "gpu_memory_used_mib": 26_000.0,
                                   "levels": {"1": level, "32": level}}},
        "in_process": {"peak_rss_mib": 25_000.0, "gpu_memory_used_mib": 20_000.0,
                       "levels": {"1": {"images_per_s": 6.0}, "32": {"images_per_s": 10.0}}}}
    judged = targets(result)
    assert judged["gpu_memory_pooled_to_in_process"] == {
        "value": 1.3, "target": 1.3, "comparison": "<=", "met": True}
    assert judged["memory_pooled_to_in_process"]["value"] == 1.2
    assert judged["h200_images_per_s_at_32"]["met"]
    assert judged["h200_p50_s_at_1"]["met"]


def test_a_kept_release_is_imported_once_and_never_taken_half_made(tmp_path: Path) -> None:
    """The GPU check's second part reuses the release its first part imported; an import cut
    short (the run killed at its deadline) is made again."""
    settings = ParisPoolSettings(size="small", keep_release=tmp_path / "kept")
    log = io.StringIO()
    first = imported_release(settings, tmp_path / "work-1", log)
    assert first.parent == tmp_path / "kept" and (first / "ddm.yaml").is_file()
    assert "writing a small release" in log.getvalue()
    stamp = (first / "ddm.yaml").stat().st_mtime_ns
    log = io.StringIO()
    assert imported_release(settings, tmp_path / "work-2", log) == first
    assert "reusing the release imported at" in log.getvalue()
    assert (first / "ddm.yaml").stat().st_mtime_ns == stamp
    # A run killed while importing: a directory with some of the files, never marked whole.
    shutil.rmtree(first)
    first.mkdir()
    (first / "ddm.yaml").write_text("cut short")
    again = imported_release(settings, tmp_path / "work-3", io.StringIO())
    assert again == first and (again / IMPORTED).is_file()
    assert "cut short" not in (again / "ddm.yaml").read_text()


def test_the_pooled_manifest_puts_every_component_in_one_pool(imported: Path,
                                                              tmp_path: Path) -> None:
    document = yaml.safe_load((imported / "ddm.yaml").read_text())
    pooled = pooled_manifest(document, "nvidia", max_batch=16)
    assert "pool" not in document["spec"]["experts"][0]  # the input is left as it was
    path = tmp_path / "pooled.yaml"
    path.write_text(yaml.safe_dump(pooled))
    plan = plan_deployment(load_manifest(path).spec)  # validation accepts every member
    assert [pool.name for pool in plan.pools] == [POOL]
    assert plan.unpooled_experts == ()
    assert sorted(name for name, _ in plan.pools[0].members) == [
        "decoder", "expert-0", "expert-1", "router-network", "text-encoder"]
    spec = pooled["spec"]
    for member in (*spec["experts"], spec["textEncoder"], spec["decoder"],
                   spec["router"]["network"]):
        assert member["pool"] == POOL
        assert not set(member) & set(PLACEMENT_FIELDS), member
        assert member["precision"] == "bfloat16"
    assert spec["pools"] == [{"name": POOL, "accelerator": {"type": "nvidia"}, "replicas": 1,
                              "maxBatch": 16}]


def test_a_compiled_manifest_compiles_each_server_once(imported: Path, tmp_path: Path) -> None:
    document = yaml.safe_load((imported / "ddm.yaml").read_text())
    alone = compiled_manifest(document, "reduce-overhead")
    assert [e["compile"] for e in alone["spec"]["experts"]] == ["reduce-overhead"] * 2
    pooled = compiled_manifest(pooled_manifest(document, "nvidia", 16), "reduce-overhead")
    assert pooled["spec"]["pools"][0]["compile"] == "reduce-overhead"
    assert not any("compile" in e for e in pooled["spec"]["experts"])  # the pool's, not theirs
    assert compiled_manifest(document, "none") == document
    for name, manifest in (("alone", alone), ("pooled", pooled)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        plan = plan_deployment(load_manifest(path).spec)
        servers = plan.pools or plan.experts
        assert all(s.args[s.args.index("--compile") + 1] == "reduce-overhead" for s in servers)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("size", "huge", "size"), ("accelerator", "neuron", "accelerator"),
    ("deployments", ("pooled", "remote"), "deployments"), ("deployments", (), "deployments"),
    ("max_batch", 0, "max_batch"), ("compile", ("fast",), "compile"), ("compile", (), "compile"),
    ("compile", ("none", "none"), "compile"), ("lockstep_groups", (0,), "lockstep_groups"),
    ("lockstep_groups", (2, 2), "lockstep_groups"), ("lockstep_groups", (9,), "lockstep_groups")])
def test_settings_out_of_range_are_refused_by_name(field: str, value: object,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParisPoolSettings(**{field: value})


def test_every_size_has_paris_shapes() -> None:
    """Eight experts on 4x32x32 latents, CLIP's 768-wide text, eight clusters and 256 px
    images (three 2x up-samplings of the latents) at every size: only the widths differ."""
    for name, sizes in SIZES.items():
        assert (sizes.experts, sizes.text_width, sizes.expert.input_size,
                sizes.expert.in_channels, sizes.router.input_size, sizes.router.num_clusters,
                len(sizes.vae_channels)) == (8, 768, 32, 4, 32, 8, 4), name
        # the command offers it (its parser names the sizes without importing torch)
        assert build_parser().parse_args(["paris-pools", "--size", name]).size == name


@pytest.mark.slow
def test_a_quick_pooled_run_gives_every_figure_and_stops_its_processes() -> None:
    settings = ParisPoolSettings(deployments=("pooled", "in_process"), load=PoolBenchSettings(
        concurrency=(1, 2), rounds=1, steps=2, host_profile=True), compare_calls_ahead=True,
        lockstep_groups=(2,))
    log, snapshots = io.StringIO(), []
    result = json.loads(json.dumps(bench_paris_pools(
        settings, log, on_figures=lambda so_far: snapshots.append(json.loads(json.dumps(so_far))))))
    assert "imported" in log.getvalue()
    # The figures so far after each deployment, the pool's first: what a run cut short keeps.
    assert [(sorted(s["deployments"]), "in_process" in s) for s in snapshots] == [
        (["pooled"], False), (["pooled"], True)]
    assert snapshots[-1]["targets"] == result["targets"]
    assert result["sampling"] == {"steps": 2, "strategy": "top2", "guidance_scale": 7.5}
    assert result["settings"]["sizes"]["experts"] == 8
    pooled = result["deployments"]["pooled"]
    # A second router over the same pool, with calls ahead (auto sends none on the CPU), its
    # figures counting the pool and itself, as the first router's the pool and the first.
    assert set(pooled["processes"]) == {f"pool-{POOL}/0", "router"}
    assert set(pooled["calls_ahead_on"]["processes"]) == {f"pool-{POOL}/0", "calls_ahead_on"}
    # and a third whose lockstep keeps two groups (DDM_LOCKSTEP_GROUPS=2)
    assert set(pooled["lockstep_groups_2"]["processes"]) == {f"pool-{POOL}/0",
                                                             "lockstep_groups_2"}
    assert pooled["gpu_memory_mib"] is None  # no NVIDIA GPU on this machine
    for process in pooled["processes"].values():
        assert 20 < process["lifetime_peak_mib"] < 4096
        with pytest.raises(ProcessLookupError):  # stopped
            os.kill(process["pid"], 0)
    for figures in (pooled, pooled["calls_ahead_on"], pooled["lockstep_groups_2"],
                    result["in_process"]):
        assert {concurrency: level["images"] for concurrency, level in
                figures["levels"].items()} == {"1": 1, "2": 2}
    # Where one image's time went: the pool ran what a top-2 guided image of 2 steps needs.
    one = pooled["levels"]["1"]
    assert one["gpu_utilisation"] == {"percent": None, "samples": 0}
    (pool,) = one["model_time"].values()
    members = pool["members"]
    experts = {name: m for name, m in members.items() if name.startswith("expert-")}
    assert {name: (m["batches"], m["rows_per_batch"]) for name, m in members.items()
            if name not in experts} == {"text-encoder": (1, 1.0), "router-network": (2, 1.0),
                                        "decoder": (1, 1.0)}
    assert len(experts) in (2, 3, 4)  # two a step, the same two or others at the next
    assert sum(m["batches"] for m in experts.values()) == 4
    assert {m["rows_per_batch"] for m in experts.values()} == {2.0}  # each guided row twice
    assert 0 < pool["model_s"] == pytest.approx(sum(m["model_s"] for m in members.values()),
                                                abs=0.01)
    # The router's round trips at 1 prompt: two expert calls and a routing per step, one
    # decoding (the empty prompt's encoding is the router's once, at its warm-up).
    trips = one["round_trips"]
    assert {key: t["calls"] for key, t in trips.items()} == {
        "expert velocity": 4, "stage router": 2, "stage text_encoder": 1, "stage decoder": 1}
    assert all(t["mean_ms"] > 0 for t in trips.values())
    # Each process sampled by py-spy while each level ran: how busy its interpreter was, and
    # in what. A level of 2 steps is a few tenths of a second, a few dozen samples at most, so
    # what they caught is chance (tests/unit/test_host_profile.py samples a known process).
    for level in pooled["levels"].values():
        profiles = level["host_profile"]
        assert set(profiles) == {f"pool-{POOL}/0", "router"}
        for process, profile in profiles.items():
            assert "error" not in profile, (process, profile)
            # the whole level sampled (both figures rounded to the millisecond)
            assert profile["seconds"] >= level["elapsed_s"] - 0.002, (process, profile)
            # at most about 1: py-spy samples a little past the level's ends
            assert 0 <= profile["gil_share"] <= 1.5, (process, profile)
            assert all(re.fullmatch(r".+ \(.+\)", frame) and 0 < share <= 1
                       for frame, share in profile["self"] + profile["inclusive"]), profile
    # Each generation's second step went ahead through the second router, none through the
    # first: its warm-up's, the one at 1 prompt and the two at 2.
    ahead = pooled["calls_ahead"]
    assert ahead["router"] == ahead["lockstep_groups_2"] == {"used": 0, "unused": 0}
    assert ahead["calls_ahead_on"]["used"] + ahead["calls_ahead_on"]["unused"] == 2 * 4
    assert set(result["targets"]) == {"memory_pooled_to_in_process",
                                      "images_per_s_pooled_to_in_process"}
    assert all(isinstance(t["met"], bool) for t in result["targets"].values())
