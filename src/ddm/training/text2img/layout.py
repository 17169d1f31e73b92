"""Where each component of a text-to-image DDM lives in its root directory, and its index.

The root holds one subfolder per role (config.json + safetensors, written by the library's own
``save_pretrained``), as a diffusers pipeline does, and ``model_index.json`` mapping each role
to its (library, class), beside ``ddm_index.json`` mapping each role to its subfolder (what
our loaders read). ``clip/`` (both towers) and the latents are training aids: the index
names only what serving loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ddm.checkpoints import roles
from ddm.checkpoints.index import write_index
from ddm.fileio import atomic_path, share_as_new
from ddm.models.text2img import DDM_CONFIG_KEY
from ddm.models.trained_on import PARTITION_FILE

TOKENIZER, CLIP, TEXT_ENCODER, VAE = "tokenizer", "clip", "text_encoder", "vae"
ROUTER, MONOLITH, MONOLITH_SNAPSHOT = "router", "monolith", "monolith-snapshot"
LATENTS = "latents.safetensors"
PARTITION = PARTITION_FILE
MODEL_INDEX = "model_index.json"
#: (library, class) of each role, as diffusers' model_index.json records them.
CLASSES = {TOKENIZER: ("transformers", "PreTrainedTokenizerFast"),
           TEXT_ENCODER: ("transformers", "CLIPTextModel"),
           VAE: ("diffusers", "AutoencoderKL"),
           ROUTER: ("ddm", "LatentRouter")}
EXPERT_CLASS = ("diffusers", "PixArtTransformer2DModel")


def finished(path: Path) -> bool:
    """A component is finished once its config is written (weights are saved before it)."""
    return (path / "config.json").is_file() or (path / "tokenizer.json").is_file()


def write_model_index(root: Path) -> Path:
    """(Re)write ``root/model_index.json`` listing the finished components, experts in order,
    and our root index (``ddm.checkpoints.index``) naming their subfolders by role.

    The experts, the router and the text prior finish at once, each refreshing both files:
    every write is atomic, and a writer scans the folders again after writing and writes again
    until what it wrote is what it finds. Whichever writes last thus wrote a scan taken after
    every other component was saved, so no finished stage is dropped, with no lock (a shared
    volume's file locks are not to be trusted)."""
    written = None
    while (found := _finished_components(root)) != written:
        _write_indexes(root, *found)
        written = found
    return root / MODEL_INDEX


def _finished_components(root: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The finished roles of :data:`CLASSES` and the finished experts' folders, in order."""
    experts = sorted((p for p in root.glob("expert_*") if finished(p)),
                     key=lambda p: int(p.name.split("_")[1]))
    return (tuple(role for role in CLASSES if finished(root / role)),
            tuple(path.name for path in experts))


def _write_indexes(root: Path, components: tuple[str, ...], experts: tuple[str, ...]) -> None:
    index: dict[str, object] = {"_class_name": "DDMText2ImagePipeline",
                                "_ddm_format": "ddm-text2img/1"}
    index.update({role: list(CLASSES[role]) for role in components})
    index.update({name: list(EXPERT_CLASS) for name in experts})
    with atomic_path(root / MODEL_INDEX) as tmp:
        tmp.write_text(json.dumps(index, indent=1) + "\n")
    if experts:  # and ours, naming the subfolder of each role (the decoder is vae/)
        write_index(root, experts, {role: name for role, name in (
            (roles.ROUTER, ROUTER), (roles.TEXT_ENCODER, TEXT_ENCODER), (roles.DECODER, VAE))
            if name in components})


def save_component(component: Any, root: Path, name: str,
                   declared: dict[str, Any] | None = None) -> Path:
    """``component.save_pretrained`` into ``root/name`` atomically: written beside it, then
    renamed, so a killed run never leaves a config without its weights. ``declared`` (our
    conventions and provenance) goes into its config.json under ``DDM_CONFIG_KEY``. Its files
    get the mode the umask gives anything new, so a server running as another user reads them."""
    partial = root / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    component.save_pretrained(partial)
    share_as_new(partial)
    if declared is not None:
        config = json.loads((partial / "config.json").read_text())
        config[DDM_CONFIG_KEY] = declared
        (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(root / name, ignore_errors=True)
    partial.rename(root / name)
    return root / name
