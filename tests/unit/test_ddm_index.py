"""A DDM directory's root index (``ddm_index.json``): the loaders read members by role from it
instead of guessing directory names; a bad entry is refused naming the file and the entry;
imports, ``ddm train-all``'s plan and the shipped DDMs carry one."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.checkpoints.importers import Component, write_import
from ddm.checkpoints.index import INDEX_FILE, read_index, write_index
from ddm.deploy.training_plan import plan_training
from ddm.deploy.training_spec import load_training_manifest
from ddm.conditioning import Conditioning
from ddm.models.ddm import DDM, ddm_layout, load_ddm
from ddm.models.stages import expert_directories, stage_directory
from ddm.training.text2img import layout

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "checkpoints" / "digits"


def test_the_shipped_ddms_name_their_members_by_role():
    assert read_index(DIGITS).experts == ("expert-0-4", "expert-5-9")
    assert read_index(ROOT / "checkpoints" / "mnist").experts == tuple(
        f"expert-{k}" for k in range(4))
    text = read_index(ROOT / "checkpoints" / "text2img")
    assert text.experts == tuple(f"expert_{k}" for k in range(4))
    assert dict(text.stages) == {"router": "router", "text_encoder": "text_encoder",
                                 "decoder": "decoder"}


def test_a_label_ddm_loads_the_members_its_index_names(tmp_path):
    # A spare expert beside the members: guessed by kind, it would be a third expert for a
    # router trained for two; the index says which two are the DDM's.
    root = tmp_path / "ddm"
    root.mkdir()
    for name, copied in (("a", "expert-0-4"), ("b", "expert-5-9"), ("spare", "expert-0-4"),
                         ("net", "router")):
        shutil.copytree(DIGITS / copied, root / name)
    with pytest.raises(CheckpointError, match="trained for 2 experts"):
        load_ddm(root)
    write_index(root, ["a", "b"], {"router": "net"})
    layout = ddm_layout(root)
    assert (layout.experts, layout.router) == ((root / "a", root / "b"), root / "net")
    loaded = load_ddm(root)
    assert list(loaded.expert_classes) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    x, cond = np.zeros((1, 1, 16, 16), np.float32), Conditioning.from_labels([7])
    np.testing.assert_array_equal(
        loaded.experts[1](x, np.full(1, .5, np.float32), cond),
        load_ddm(DIGITS).experts[1](x, np.full(1, .5, np.float32), cond))


def test_a_label_ddm_and_a_text_ddm_are_one_type_loaded_by_role():
    """The experts' declarations give the conditioning kind; each stage reads its own."""
    label, text = load_ddm(DIGITS), load_ddm(ROOT / "checkpoints" / "text2img")
    assert type(label) is type(text) is DDM
    assert (label.conditioning, label.num_classes, label.latent_shape) == ("labels", 10,
                                                                          (1, 16, 16))
    assert (label.encode, label.decode, label.null) == (None, None, None)
    assert label.expert_names == ("expert-0-4", "expert-5-9") and label.is_mixture
    assert label.paths == (DIGITS / "expert-0-4", DIGITS / "expert-5-9", DIGITS / "router")
    assert (text.conditioning, text.num_classes, len(text.null)) == ("text", 0, 1)
    assert text.encode is not None and text.decode is not None and text.router is not None
    alone = load_ddm(DIGITS / "monolith")
    assert (alone.expert_names, alone.router, alone.is_mixture) == (("monolith",), None, False)
    with pytest.raises(CheckpointError, match="is a router checkpoint, not an expert"):
        load_ddm(DIGITS / "router")


def test_text_experts_are_read_from_the_index_else_by_todays_names(tmp_path):
    for name in ("expert_0", "expert_1", "fine-tuned", "base"):
        (tmp_path / name).mkdir()
    assert expert_directories(tmp_path) == ["expert_0", "expert_1"]  # no index: the names
    write_index(tmp_path, ["fine-tuned", "base"], {"router": "expert_0"})
    assert expert_directories(tmp_path) == ["fine-tuned", "base"]


def test_each_stage_is_found_by_role_from_the_index_else_by_its_usual_name(tmp_path):
    for name in ("expert_0", "router", "vae", "clip-l", "latent-decoder"):
        (tmp_path / name).mkdir()
    assert [stage_directory(tmp_path, role) for role in ("router", "text_encoder", "decoder")
            ] == [tmp_path / "router", None, tmp_path / "vae"]
    write_index(tmp_path, ["expert_0"], {"text_encoder": "clip-l", "decoder": "latent-decoder"})
    assert [stage_directory(tmp_path, role) for role in ("router", "text_encoder", "decoder")
            ] == [None, tmp_path / "clip-l", tmp_path / "latent-decoder"]


@pytest.mark.parametrize("entry, problem", [
    ({"expert": ["a", "missing"]}, "entry 'expert[1]' names 'missing', which is not a "
                                   "subfolder"),
    ({"expert": ["a"], "router": "../outside"}, "entry 'router' is '../outside'; it must be "
                                                "a relative path inside"),
    ({"expert": ["/etc"]}, "entry 'expert[0]' is '/etc'; it must be a relative path"),
    ({"expert": ["a", "link"]}, "entry 'expert[1]' ('link') is a symbolic link"),
    ({"expert": ["a"], "vae": "a"}, "unknown entries ['vae']; the roles are expert, "),
    ({"expert": []}, "entry 'expert' must list 1..1024 expert subfolders"),
    ({"expert": ["a", "a"]}, "entries 'expert[0]' and 'expert[1]' both name 'a'; each "
                             "member has a subfolder of its own"),
    ({"expert": ["a"], "router": "a/"}, "entries 'expert[0]' and 'router' both name 'a/'"),
    ({"expert": ["a"], "router": "."}, "entry 'router' is '.', the DDM directory itself; it "
                                       "must name a subfolder"),
])
def test_an_index_naming_a_missing_or_escaping_subfolder_is_refused(tmp_path, entry, problem):
    root = tmp_path / "ddm"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    (root / INDEX_FILE).write_text(json.dumps({"ddm_index": 1, **entry}))
    with pytest.raises(CheckpointError, match=re.escape(f"{root / INDEX_FILE}: {problem}")):
        read_index(root)


def test_a_file_that_is_no_index_of_ours_is_refused(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"expert": ["a"]}))
    with pytest.raises(CheckpointError, match='not a DDM index .expected an object with '
                                              '"ddm_index": 1'):
        read_index(tmp_path)


def test_an_import_writes_the_index_of_its_components(tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"{}")
    components = tuple(Component(name, {}, {"role": role}, weights) for name, role in (
        ("expert_1", "expert"), ("expert_0", "expert"), ("monolith", "expert"),
        ("router", "router"), ("text_encoder", "text_encoder"), ("decoder", "decoder"),
        ("clip", "aid")))
    out = write_import(tmp_path / "dst", components, "kind: DDMDeployment\n",
                       ["expert_0", "expert_1"])
    assert json.loads((out / INDEX_FILE).read_text()) == {
        "ddm_index": 1, "expert": ["expert_0", "expert_1"], "router": "router",
        "text_encoder": "text_encoder", "decoder": "decoder"}


def test_train_all_plans_the_index_of_its_outputs():
    plan = plan_training(load_training_manifest(ROOT / "examples" / "training.yaml").spec)
    assert plan.members() == (["experts/digits-0-4", "experts/digits-5-9"],
                              {"router": "router"})


def _finish(root: Path, component: str) -> None:
    """Save ``component`` as its text2img stage does: its folder appears whole, config last."""
    staging = root / f".{component}.partial"
    staging.mkdir()
    (staging / ("tokenizer.json" if component == "tokenizer" else "config.json")).write_text("{}")
    staging.rename(root / component)


T2I_EXPERTS = [f"expert_{k}" for k in range(4)]
T2I_INDEX = {"ddm_index": 1, "expert": T2I_EXPERTS, "router": "router",
             "text_encoder": "text_encoder", "decoder": "vae"}


def test_concurrent_stages_refreshing_the_index_never_fail_and_drop_no_stage(tmp_path):
    # The plan runs the experts, the router and the text prior at once, each refreshing the
    # indexes when it ends: no writer fails, none deletes another's file, and the last index
    # names every finished stage.
    components = ["tokenizer", "vae", "text_encoder", "router", *T2I_EXPERTS]
    start, failures = threading.Barrier(len(components)), []

    def stage(component: str) -> None:
        start.wait()
        try:
            _finish(tmp_path, component)
            for _ in range(30):
                layout.write_model_index(tmp_path)
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(f"{component}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stage, args=(c,)) for c in components]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert json.loads((tmp_path / INDEX_FILE).read_text()) == T2I_INDEX
    assert sorted(json.loads((tmp_path / "model_index.json").read_text())) == sorted(
        ["_class_name", "_ddm_format", *components])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_stage_finishing_while_another_writes_the_index_is_not_dropped(tmp_path, monkeypatch):
    # Writer A scans (expert_0 alone), then expert_1 is saved and its writer refreshes the
    # index before A writes what it scanned: A's stale write must not be the last word.
    for component in ("tokenizer", "vae", "text_encoder", "router", "expert_0"):
        _finish(tmp_path, component)
    write = layout.write_index
    calls = []

    def interleaved(root, experts, stages):
        calls.append(list(experts))
        if len(calls) == 1:  # A has scanned; B finishes and writes before A does
            _finish(tmp_path, "expert_1")
            layout.write_model_index(tmp_path)
        return write(root, experts, stages)

    monkeypatch.setattr(layout, "write_index", interleaved)
    layout.write_model_index(tmp_path)
    assert calls[0] == ["expert_0"]
    assert json.loads((tmp_path / INDEX_FILE).read_text())["expert"] == ["expert_0", "expert_1"]
    assert "expert_1" in json.loads((tmp_path / "model_index.json").read_text())


def test_an_index_failing_its_check_leaves_the_one_written_before(tmp_path):
    (tmp_path / "a").mkdir()
    write_index(tmp_path, ["a"], {})
    with pytest.raises(CheckpointError, match="'missing', which is not a subfolder"):
        write_index(tmp_path, ["a", "missing"], {})
    assert json.loads((tmp_path / INDEX_FILE).read_text()) == {"ddm_index": 1, "expert": ["a"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", INDEX_FILE]
