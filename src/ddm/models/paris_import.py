"""``ddm import paris SRC --out DST``: a Paris release directory -> our stage checkpoints and the
DDMDeployment that serves them (``ddm.checkpoints.importers`` writes both, atomically).

The release's files are checked first (``ddm.checkpoints.release``: regular files and
directories only, no link followed, JSON that parses and asks for no code). Every component is
then checked before anything is written, by the loaders that serve it
(``ddm.models.paris_ddm.load_release_stages``: each expert and the router network strictly
through ``ddm.models.paris_loading``, the tokenizer, CLIP text model and VAE by their
libraries), onto the ``meta`` device, so the weights are let go once checked (one expert in
memory at a time); the libraries' own report of missing, unexpected or misshapen tensors must
be empty, and the state shape, text width and clusters must agree across the stages. The
tokenizer's files (those it is built from, :func:`tokenizer_files`) join the text encoder's
directory (as a Hugging Face repository holds both); the VAE becomes ``decoder/``. Weights are
copied byte for byte: they keep their dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError, one_safetensors
from ddm.checkpoints.importers import Component, write_import
from ddm.checkpoints.release import check_release
from ddm.deploy.imported import (
    DECODER_DIR,
    ROUTER_DIR,
    TEXT_ENCODER_DIR,
    ImportedDDM,
    imported_manifest,
    manifest_text,
)
from ddm.models.paris_ddm import PARIS_CONVENTION, load_release_stages
from ddm.models.paris_loading import (
    infer_expert_config,
    infer_router_config,
    read_component_config,
    resolve_config,
    weight_file,
    weight_shapes,
)
from ddm.models.stages import check_stage_shapes, release_sampling

#: The files transformers builds a tokenizer from: ``tokenizer.json`` where present (alone),
#: else a BPE vocabulary and its merges; with its settings beside either. The import carries
#: those present, and nothing else of ``tokenizer/``.
TOKENIZER_MODEL_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
TOKENIZER_SETTINGS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def import_paris(release: str | Path, out: str | Path, *, name: str = "paris",
                 accelerators: Sequence[str] = ("cpu",), precision: str | None = None,
                 checkpoint_base: str | None = None) -> Path:
    """Check the release at ``release`` whole, then write ``out`` (a new directory) with its
    stages and ddm.yaml; ``checkpoint_base``: the URI the manifest reaches ``out`` at (default
    ``file://`` + its absolute path). Raises ``CheckpointError`` naming the first problem,
    leaving no ``out`` behind."""
    root, target = Path(release), Path(out).absolute()
    if target.exists():
        raise FileExistsError(f"{target} exists; an import writes a new directory")
    ddm, components = read_paris_release(root)
    document = imported_manifest(ddm, name, checkpoint_base or f"file://{target}/",
                                 accelerators, precision)
    header = (f"Imported by `ddm import paris` from {root.absolute()}.\n"
              f"Run it here with: ddm up {target}/ddm.yaml")
    experts = [c.name for c in components if c.ddm.get("role") == EXPERT]
    return write_import(target, components, manifest_text(document, header), experts)


def read_paris_release(root: Path) -> tuple[ImportedDDM, tuple[Component, ...]]:
    """The release at ``root`` checked whole, as what it holds and the components to write:
    its files first (``ddm.checkpoints.release``: no links, no code), then its stages."""
    check_release(root)
    names, experts, router, encoder, decoder = load_release_stages(root, device="meta")
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    _check_library_weights(root / "text_encoder", CLIPTextModel)
    _check_library_weights(root / "vae", AutoencoderKL)
    latent_shape = list(check_stage_shapes(root, experts, router, encoder, decoder))
    text_width = encoder.declaration.text_width
    common = {"convention": PARIS_CONVENTION, "latent_shape": latent_shape}
    components = [
        Component(name, _port_config(root / name, infer_expert_config),
                  {"role": EXPERT, "family": "paris-dit", **common, "text_width": text_width,
                   "cluster": k}, weight_file(root / name))
        for k, name in enumerate(names)]
    components.append(Component(ROUTER_DIR, _port_config(root / "router", infer_router_config),
                                {"role": ROUTER, "family": "paris-router", **common},
                                weight_file(root / "router")))
    components.append(Component(
        TEXT_ENCODER_DIR, read_component_config(root / "text_encoder"),
        {"role": TEXT_ENCODER, "family": "clip-text", "text_width": text_width},
        one_safetensors(root / "text_encoder"),
        tokenizer_files(root / "tokenizer")))
    components.append(Component(
        DECODER_DIR, read_component_config(root / "vae"),
        {"role": DECODER, "family": "autoencoder-kl", "latent_shape": latent_shape},
        one_safetensors(root / "vae")))
    settings = read_component_config(root)
    ddm = ImportedDDM(experts=len(names), conditioning="text",
                      **release_sampling(root, settings))
    return ddm, tuple(components)


def tokenizer_files(directory: Path) -> tuple[Path, ...]:
    """The files of ``directory`` the tokenizer is built from (:data:`TOKENIZER_MODEL_FILES`,
    :data:`TOKENIZER_SETTINGS`), those present."""
    model = next((names for names in TOKENIZER_MODEL_FILES
                  if (directory / names[0]).is_file()), ())
    return tuple(directory / name for name in (*model, *TOKENIZER_SETTINGS)
                 if (directory / name).is_file())


def _port_config(directory: Path, infer: Any) -> dict[str, Any]:
    """An expert's or the router's architecture with the port's constructor names (what the
    weights' shapes say, ``num_heads`` from its config.json), as its new config.json."""
    return resolve_config(infer, weight_shapes(weight_file(directory)),
                          read_component_config(directory)).to_dict()


def _check_library_weights(directory: Path, model_class: Any) -> None:
    """The library's own loading report (``model_class.from_pretrained``'s) must be empty: a
    missing tensor would start from random values with only a warning."""
    _, info = model_class.from_pretrained(directory, use_safetensors=True,
                                          local_files_only=True, output_loading_info=True,
                                          trust_remote_code=False)
    problems = {kind: found for kind in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                          "error_msgs") if (found := info.get(kind))}
    if problems:
        shown = "; ".join(f"{kind.replace('_', ' ')}: {sorted(map(str, found))[:5]}"
                          for kind, found in problems.items())
        raise CheckpointError(f"{directory}: the weights do not match its config.json: {shown}")
