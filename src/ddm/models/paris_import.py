"""``ddm import paris SRC --out DST``: a Paris release directory -> our stage checkpoints and
the DDMDeployment that serves them (``ddm.checkpoints.importers`` writes both, atomically).

Every component is checked before anything is written: each expert and the router network
strictly (``ddm.models.paris_loading``: the architecture from the weights' shapes, then every
tensor's name and shape against it, read from the safetensors header without loading the
weights, so a 605M-parameter expert costs no memory), the text encoder and VAE by loading them
with their libraries (safetensors only; a missing, unexpected or misshapen tensor is refused),
the tokenizer by loading it; then the state shape and text width across all of them. The
tokenizer's files join the text encoder's directory (as a Hugging Face repository holds
both); the VAE becomes ``decoder/``. Weights are copied byte for byte: they keep their dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ddm.checkpoints.format import CheckpointError, check_weight_shapes
from ddm.checkpoints.importers import Component, write_import
from ddm.deploy.imported import (
    DECODER_DIR,
    ROUTER_DIR,
    TEXT_ENCODER_DIR,
    ImportedDDM,
    expert_dir,
    imported_manifest,
    manifest_text,
)
from ddm.models.paris import ParisExpert, ParisExpertConfig, ParisRouter, ParisRouterConfig
from ddm.models.paris_ddm import (
    DEFAULT_GUIDANCE,
    DEFAULT_ROUTING,
    DEFAULT_STEPS,
    check_paris_shapes,
    release_experts,
)
from ddm.models.paris_loading import (
    infer_expert_config,
    infer_router_config,
    read_component_config,
    resolve_config,
    weight_file,
    weight_shapes,
)

#: The time and objective convention Paris's networks declare (diffusers'
#: FlowMatchEulerDiscreteScheduler with 1000 training timesteps).
PARIS_CONVENTION_NAME = "flow-match-1000"
#: The files of a Hugging Face CLIP tokenizer that the import carries, where present.
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json")


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
    return write_import(target, components, manifest_text(document, header))


def read_paris_release(root: Path) -> tuple[ImportedDDM, tuple[Component, ...]]:
    """The release at ``root`` checked whole, as what it holds and the components to write."""
    indices = release_experts(root)
    experts = [_network(root / f"expert_{k}", infer_expert_config, ParisExpert)
               for k in indices]
    router = _network(root / "router", infer_router_config, ParisRouter)
    text_width, tokenizer_files = _text_encoder(root / "tokenizer", root / "text_encoder")
    latent_channels = _vae(root / "vae")
    channels, size, _ = check_paris_shapes(
        root, [config for config, _ in experts], router[0], latent_channels, text_width)
    latent_shape = [channels, size, size]
    common = {"convention": PARIS_CONVENTION_NAME, "latent_shape": latent_shape}
    components = [
        Component(expert_dir(k), config.to_dict(),
                  {"role": "expert", "family": "paris-dit", **common, "text_width": text_width,
                   "cluster": k}, weights)
        for k, (config, weights) in zip(indices, experts)]
    components.append(Component(ROUTER_DIR, router[0].to_dict(),
                                {"role": "router", "family": "paris-router", **common},
                                router[1]))
    components.append(Component(
        TEXT_ENCODER_DIR, read_component_config(root / "text_encoder"),
        {"role": "text_encoder", "family": "clip-text", "text_width": text_width},
        _one_safetensors(root / "text_encoder"), tokenizer_files))
    components.append(Component(
        DECODER_DIR, read_component_config(root / "vae"),
        {"role": "decoder", "family": "autoencoder-kl", "latent_shape": latent_shape},
        _one_safetensors(root / "vae")))
    settings = read_component_config(root)
    ddm = ImportedDDM(
        experts=len(indices), conditioning="text",
        steps=int(settings.get("num_inference_steps", DEFAULT_STEPS)),
        strategy=str(settings.get("routing", DEFAULT_ROUTING)),
        guidance_scale=float(settings.get("cfg_scale", DEFAULT_GUIDANCE)))
    return ddm, tuple(components)


def _network(directory: Path, infer: Callable[..., Any], network: type[torch.nn.Module]
             ) -> tuple[ParisExpertConfig | ParisRouterConfig, Path]:
    """An expert's or the router's architecture and weight file, every tensor's name and shape
    checked against the architecture (from the header: nothing is loaded)."""
    path = weight_file(directory)
    shapes = weight_shapes(path)
    config = resolve_config(infer, shapes, read_component_config(directory))
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in
                    network(**config.to_dict()).state_dict().items()}
    # Zero-strided views: arrays of the header's shapes that allocate nothing.
    check_weight_shapes(directory, expected,
                        {name: np.broadcast_to(np.uint8(0), shape)
                         for name, shape in shapes.items()})
    return config, path


def _text_encoder(tokenizer: Path, text_encoder: Path) -> tuple[int, tuple[Path, ...]]:
    """The CLIP text model's width (its weights loaded and checked) and the tokenizer's files
    (the tokenizer loaded)."""
    from transformers import CLIPTextModel, CLIPTokenizer

    try:
        CLIPTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{tokenizer}: not a CLIP tokenizer: {exc}") from None
    files = tuple(tokenizer / name for name in TOKENIZER_FILES if (tokenizer / name).is_file())
    _one_safetensors(text_encoder)
    try:
        model, info = CLIPTextModel.from_pretrained(text_encoder, use_safetensors=True,
                                                    output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{text_encoder}: not a CLIP text model: {exc}") from None
    _refuse_loading_problems(text_encoder, info)
    return int(model.config.hidden_size), files


def _vae(directory: Path) -> int:
    """The VAE's latent channels (its weights loaded and checked)."""
    from diffusers import AutoencoderKL

    _one_safetensors(directory)
    try:
        model, info = AutoencoderKL.from_pretrained(directory, use_safetensors=True,
                                                    output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{directory}: not an AutoencoderKL: {exc}") from None
    _refuse_loading_problems(directory, info)
    return int(model.config.latent_channels)


def _refuse_loading_problems(directory: Path, info: dict[str, Any]) -> None:
    problems = {kind: info.get(kind) for kind in ("missing_keys", "unexpected_keys",
                                                  "mismatched_keys", "error_msgs")
                if info.get(kind)}
    if problems:
        shown = "; ".join(f"{kind.replace('_', ' ')}: {list(found)[:5]}"
                          for kind, found in problems.items())
        raise CheckpointError(f"{directory}: the weights do not match its config.json: {shown}")


def _one_safetensors(directory: Path) -> Path:
    """The one safetensors file of a library's component directory (no pickled weights)."""
    found = sorted(directory.glob("*.safetensors"))
    if len(found) != 1:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (pickled weights {pickled} are never loaded)" if pickled else ""
        raise CheckpointError(f"{directory} must hold exactly one .safetensors file, found "
                              f"{[p.name for p in found]}{hint}")
    return found[0]
