"""``ddm import paris``: a tiny Paris release (random weights, the release's layout and key
names) becomes our stage checkpoints and a DDMDeployment that parses and plans; a broken
release is refused with its problem named, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ddm.checkpoints.format import CheckpointError
from ddm.checkpoints.importers import Component, write_import
from ddm.checkpoints.index import read_index
from ddm.cli import main
from ddm.deploy.plan import plan_deployment
from ddm.deploy.spec import load_manifest
from ddm.models.paris_import import import_paris
from tests.support.paris_release import TinyParis, tiny_vae, write_paris_release


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paris_release(tmp_path_factory.mktemp("release") / "paris", seed=3)


@pytest.fixture(scope="module")
def imported(release: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_paris(release, tmp_path_factory.mktemp("out") / "dst")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_import_lays_out_one_directory_per_stage(imported: Path) -> None:
    assert sorted(p.name for p in imported.iterdir()) == [
        "ddm.yaml", "ddm_index.json", "decoder", "expert_0", "expert_1", "router",
        "text_encoder"]
    roles = {d: _config(imported / d)["_ddm"]["role"]
             for d in ("expert_0", "expert_1", "router", "text_encoder", "decoder")}
    assert roles == {"expert_0": "expert", "expert_1": "expert", "router": "router",
                     "text_encoder": "text_encoder", "decoder": "decoder"}
    index = read_index(imported)  # the root index names each by the role it declares
    assert index is not None and index.experts == ("expert_0", "expert_1")
    assert dict(index.stages) == {"router": "router", "text_encoder": "text_encoder",
                                  "decoder": "decoder"}


def test_weights_are_copied_byte_for_byte_with_their_sha256(release: Path,
                                                            imported: Path) -> None:
    pairs = {"expert_0/diffusion_pytorch_model.safetensors":
             "expert_0/diffusion_pytorch_model.safetensors",
             "router/pytorch_model.safetensors": "router/pytorch_model.safetensors",
             "text_encoder/model.safetensors": "text_encoder/model.safetensors",
             "vae/diffusion_pytorch_model.safetensors":
             "decoder/diffusion_pytorch_model.safetensors"}
    for source, written in pairs.items():
        assert (imported / written).read_bytes() == (release / source).read_bytes()
        declared = _config((imported / written).parent)["_ddm"]["weights_sha256"]
        assert declared == _sha256(release / source)


def test_the_stages_declare_shapes_convention_and_clusters(imported: Path) -> None:
    sizes = TinyParis()
    latent = [sizes.expert.in_channels, sizes.expert.input_size, sizes.expert.input_size]
    for k in range(sizes.experts):
        declared = _config(imported / f"expert_{k}")["_ddm"]
        assert declared["family"] == "paris-dit" and declared["cluster"] == k
        assert declared["convention"] == "flow-match-1000"
        assert declared["latent_shape"] == latent
        assert declared["text_width"] == sizes.text_width
    assert _config(imported / "router")["_ddm"]["latent_shape"] == latent
    assert _config(imported / "decoder")["_ddm"]["latent_shape"] == latent
    assert _config(imported / "text_encoder")["_ddm"]["text_width"] == sizes.text_width
    # The port's constructor names, num_heads included (the weights cannot say it).
    assert _config(imported / "expert_0")["num_heads"] == sizes.expert.num_heads
    assert _config(imported / "router")["num_clusters"] == sizes.experts


def test_the_text_encoder_directory_holds_its_tokenizer(release: Path, imported: Path) -> None:
    from transformers import CLIPTextModel, CLIPTokenizer

    ours, theirs = (CLIPTokenizer.from_pretrained(imported / "text_encoder"),
                    CLIPTokenizer.from_pretrained(release / "tokenizer"))
    prompt = "a photo of a red car on the beach"
    assert ours(prompt).input_ids == theirs(prompt).input_ids
    model = CLIPTextModel.from_pretrained(imported / "text_encoder", use_safetensors=True)
    assert model.config.hidden_size == TinyParis().text_width


def test_ddm_yaml_is_a_text_ddm_that_plans(imported: Path) -> None:
    manifest = load_manifest(imported / "ddm.yaml")
    spec = manifest.spec
    assert manifest.name == "paris" and spec.conditioning == "text"
    # The release's config.json: cfg_scale 7.5, 50 steps, top2.
    assert (spec.sampling.guidance_scale, spec.sampling.steps, spec.sampling.strategy) == (
        7.5, 50, "top2")
    assert [e.checkpoint.path for e in spec.experts] == [
        str(imported / "expert_0"), str(imported / "expert_1")]
    assert spec.text_encoder.checkpoint.path == str(imported / "text_encoder")
    assert spec.decoder.checkpoint.path == str(imported / "decoder")
    assert spec.router.checkpoint.path == str(imported / "router")
    assert spec.router.auth is not None  # the API asks for a token: a random one
    # On cpu (the default) the stages run inside the router.
    assert {s.placement for s in spec.stages.values()} == {"router"}
    plan = plan_deployment(spec)
    assert [e.name for e in plan.experts] == ["expert-0", "expert-1"]


def test_accelerators_and_precision_from_the_flags(release: Path, tmp_path: Path) -> None:
    out = import_paris(release, tmp_path / "mixed", accelerators=("nvidia", "neuron"),
                       precision="bfloat16", checkpoint_base="pvc://models/paris/")
    spec = load_manifest(out / "ddm.yaml").spec
    assert [e.accelerator.type for e in spec.experts] == ["nvidia", "neuron"]
    assert {e.precision for e in spec.experts} == {"bfloat16"}
    assert spec.experts[1].checkpoint.uri == "pvc://models/paris/expert_1"
    for stage in spec.stages.values():
        assert (stage.placement, stage.accelerator.type, stage.precision) == (
            "separate", "nvidia", "bfloat16")


def _rename_tensor(release: Path) -> str:
    path = release / "expert_1" / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(path))
    weights["layers.0.attn.renamed"] = weights.pop("layers.0.attn.in_proj_weight")
    save_file(weights, str(path))
    return "unexpected layers.0.attn.renamed"


def _gap_in_experts(release: Path) -> str:
    (release / "expert_1").rename(release / "expert_2")
    return "must hold expert_0 .. expert_N-1, found experts [0, 2]"


def _pickled_text_encoder(release: Path) -> str:
    directory = release / "text_encoder"
    torch.save({}, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    return "pickled weights ['pytorch_model.bin'] are never loaded"


def _vae_of_other_latents(release: Path) -> str:
    shutil.rmtree(release / "vae")
    tiny_vae(3).save_pretrained(release / "vae")
    return "the decoder takes 3-channel latents, the experts make 4"


def _no_router(release: Path) -> str:
    shutil.rmtree(release / "router")
    return "has no router/ component"


def _config_disagrees(release: Path) -> str:
    path = release / "router" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_clusters": 3}))
    return "num_clusters: config.json says 3, the weights have 2"


def _corrupt_weights(release: Path) -> str:
    path = release / "expert_0" / "diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    return f"{path} is not a valid safetensors file"


def _bad_json(release: Path) -> str:
    path = release / "tokenizer" / "tokenizer_config.json"
    path.write_text("{")
    return f"{path} is not valid JSON"


def _sampler_settings_out_of_bounds(release: Path) -> str:
    path = release / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_inference_steps": 10**9, "routing": "best"}))
    return (f"{path}: num_inference_steps must be an integer in [1, 1000], got 1000000000; "
            "routing ")


@pytest.mark.parametrize("breakage", [_rename_tensor, _gap_in_experts, _pickled_text_encoder,
                                      _vae_of_other_latents, _no_router, _config_disagrees,
                                      _corrupt_weights, _bad_json,
                                      _sampler_settings_out_of_bounds])
def test_a_broken_release_is_refused_by_name_and_leaves_nothing(
        release: Path, tmp_path: Path, breakage) -> None:
    broken = tmp_path / "release"
    shutil.copytree(release, broken)
    problem = breakage(broken)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(CheckpointError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        import_paris(broken, out_dir / "dst")
    assert list(out_dir.iterdir()) == []


def test_a_write_that_fails_midway_leaves_nothing(release: Path, tmp_path: Path) -> None:
    good = Component("expert_0", {}, {"role": "expert"},
                     release / "expert_0" / "diffusion_pytorch_model.safetensors")
    gone = Component("router", {}, {"role": "router"}, tmp_path / "vanished.safetensors")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(FileNotFoundError):
        write_import(out_dir / "dst", (good, gone), "kind: DDMDeployment\n", ["expert_0"])
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize("umask, directory_mode", [(0o022, 0o755), (0o027, 0o750)],
                         ids=["umask-022", "umask-027"])
def test_an_import_gets_the_modes_the_umask_gives_anything_new(release: Path, tmp_path: Path,
                                                               umask: int,
                                                               directory_mode: int) -> None:
    # Servers run as another user (the images' uid 10001) and must read the DDM; a stricter
    # umask keeps it from everyone else, DST itself included.
    previous = os.umask(umask)
    try:
        out = import_paris(release, tmp_path / "dst")
    finally:
        os.umask(previous)
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in [out, *out.rglob("*")]}
    assert {path: mode for path, mode in modes.items()
            if mode != (directory_mode if path.is_dir() else directory_mode & 0o666)} == {}
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # no staging left


def test_the_command_refuses_an_existing_destination(release: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "dst").mkdir()
    assert main(["import", "paris", str(release), "--out", str(tmp_path / "dst")]) == 2
    assert "exists; an import writes a new directory" in capsys.readouterr().err
    assert list((tmp_path / "dst").iterdir()) == []


def test_the_command_names_a_broken_release(release: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "release"
    shutil.copytree(release, broken)
    shutil.rmtree(broken / "vae")
    assert main(["import", "paris", str(broken), "--out", str(tmp_path / "dst")]) == 2
    assert "has no vae/ component" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_the_imported_ddm_generates_what_the_reference_sampler_does(release: Path,
                                                                    imported: Path) -> None:
    """Loaded from DST by the stage loaders (``load_ddm``: every config.json's
    ``_ddm``, weights' sha256 checked), the import generates what Paris's published sampler
    (tests/support/paris_reference.py) generates from the release, within 2/255."""
    from ddm.models.ddm import load_ddm
    from ddm.sampling.pipeline import generate_text
    from tests.support.paris_reference import ParisReference

    reference = ParisReference(release)
    prompt, seed, steps = "a photo of a red car on the beach", 5, 4
    expected = reference.generate(prompt, routing="top2", cfg_scale=7.5, num_steps=steps,
                                  seed=seed)
    ddm = load_ddm(imported)
    result = generate_text(ddm, [prompt], steps=steps, seed=seed, strategy="top2",
                           guidance_scale=7.5, latents=reference.initial_latents(seed).numpy())
    difference = np.abs(result.images[0].astype(int) - expected.image.astype(int))
    assert difference.max() <= 2, f"max pixel difference {difference.max()}"
    assert (ddm.guidance_scale, ddm.steps, ddm.strategy) == (7.5, 50, "top2")


def test_every_stage_lists_its_files_so_a_fetch_verifies_them(imported: Path) -> None:
    from ddm.checkpoints.verify import verify_checkpoint

    for stage in ("expert_0", "expert_1", "router", "text_encoder", "decoder"):
        directory = imported / stage
        files = _config(directory)["_ddm"]["files"]
        assert files == {p.name: _sha256(p) for p in directory.iterdir()
                         if p.name != "config.json"}
        verify_checkpoint(directory)  # what the fetcher runs on a fetched stage
    assert {"tokenizer.json", "model.safetensors"} <= set(
        _config(imported / "text_encoder")["_ddm"]["files"])


@pytest.mark.parametrize("breakage", [_corrupt_weights, _bad_json])
def test_the_command_names_a_corrupt_file(release: Path, tmp_path: Path, breakage,
                                          capsys: pytest.CaptureFixture) -> None:
    broken = tmp_path / "release"
    shutil.copytree(release, broken)
    problem = breakage(broken)
    assert main(["import", "paris", str(broken), "--out", str(tmp_path / "dst")]) == 2
    assert capsys.readouterr().err.startswith(f"ddm: error: {problem}")
    assert not (tmp_path / "dst").exists()


# -- a release is someone else's: what it may hold --------------------------------------------

def _symlinked_vocabulary(release: Path, outside: Path) -> str:
    (release / "tokenizer" / "vocab.json").symlink_to(outside)
    return "tokenizer/vocab.json is a symbolic link: a release may hold only regular files"


def _symlinked_component(release: Path, outside: Path) -> str:
    shutil.move(release / "tokenizer", outside.parent / "tokenizer")
    (release / "tokenizer").symlink_to(outside.parent / "tokenizer")
    return "/tokenizer is a symbolic link"


def _hard_linked_merges(release: Path, outside: Path) -> str:
    os.link(outside, release / "tokenizer" / "merges.txt")
    return "tokenizer/merges.txt is a hard link to a file outside"


def _fifo_config(release: Path, outside: Path) -> str:
    (release / "vae" / "config.json").unlink()
    os.mkfifo(release / "vae" / "config.json")  # a reader would wait for a writer forever
    return "vae/config.json is a FIFO"


@pytest.mark.parametrize("breakage", [_symlinked_vocabulary, _symlinked_component,
                                      _hard_linked_merges, _fifo_config])
def test_a_release_holding_links_or_special_files_is_refused_by_path(
        release: Path, tmp_path: Path, breakage) -> None:
    hostile = tmp_path / "release"
    shutil.copytree(release, hostile)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "environ").write_text('{"TOKEN": "hunter2"}')
    problem = breakage(hostile, secrets / "environ")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(CheckpointError, match=problem):
        import_paris(hostile, out_dir / "dst")
    assert list(out_dir.iterdir()) == []


def test_only_the_files_the_tokenizer_is_built_from_are_carried(release: Path,
                                                                tmp_path: Path) -> None:
    # the tokenizer is built from tokenizer.json alone: a vocab.json beside it is never read
    extra = tmp_path / "release"
    shutil.copytree(release, extra)
    (extra / "tokenizer" / "vocab.json").write_text('{"not": "read"}')
    (extra / "tokenizer" / "notes.txt").write_text("private")
    out = import_paris(extra, tmp_path / "dst")
    assert sorted(_config(out / "text_encoder")["_ddm"]["files"]) == [
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_a_release_asking_to_run_its_code_is_refused_before_anything_loads(
        release: Path, tmp_path: Path) -> None:
    """``echo y | ddm import paris``: transformers would ask whether to run the release's
    tokenizer module (auto_map), and a ``y`` on stdin would answer it."""
    hostile = tmp_path / "release"
    shutil.copytree(release, hostile)
    marker = tmp_path / "ran"
    (hostile / "tokenizer" / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import CLIPTokenizer as EvilTokenizer\n")
    path = hostile / "tokenizer" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "ddm", "import", "paris", str(hostile),
                             "--out", str(tmp_path / "dst")], input="y\ny\n", text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"ddm: error: {path} declares auto_map: it asks the "
                                    "library to run the release's own Python code")
    assert not marker.exists()
    assert not (tmp_path / "dst").exists()
