"""``ddm train text2img STAGE``: each stage reads the components before it from the DDM root and
writes its own, resumably, so that scripts/train_text2img.sh can chain and restart them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddm.data.colored_mnist import ColoredDigits, load_colored_mnist
from ddm.models.text2img import sizes
from ddm.training.config import TrainConfig
from ddm.training.resume import Resumable, state_directory
from ddm.training.text2img import layout

#: ``progress(step, loss)``, as ``ddm.training.torch_loop.ProgressFn`` (not imported: torch).
ProgressFn = Callable[[int, float], None]

#: Default optimisation per training stage (``--steps`` etc. override them).
DEFAULTS = {
    "clip": TrainConfig(steps=2000, batch_size=128, learning_rate=1e-3),
    "vae": TrainConfig(steps=3000, batch_size=32, learning_rate=1e-3),
}
STAGES = ("tokenizer", "clip", "vae")


@dataclass(frozen=True)
class StageRun:
    """What every stage is given: the DDM root, the MNIST IDX directory, the network size,
    the colouring seed of the data, and how to train and save."""

    root: Path
    mnist: Path
    size: str
    train: TrainConfig
    data_seed: int = 0
    index: int | None = None
    save_every: int = 250
    resume: bool = False
    progress: ProgressFn | None = None

    def data(self) -> ColoredDigits:
        return load_colored_mnist(self.mnist, "train", self.data_seed)

    def resumable(self, component: str, **identity: Any) -> Resumable:
        return Resumable(state_directory(self.root / component), every=self.save_every,
                         resume=self.resume, identity={
                             "stage": component, "size": self.size, "data_seed": self.data_seed,
                             "train": self.train.to_dict(), **identity})


def default_train(stage: str, overrides: dict[str, Any]) -> TrainConfig:
    """The stage's defaults with the given fields (those not None) replaced."""
    base = DEFAULTS.get(stage, TrainConfig())
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def run_stage(stage: str, run: StageRun) -> Path:
    """Run one stage; returns the component directory it wrote and refreshes model_index.json."""
    stages: dict[str, Callable[[StageRun], Path]] = {
        "tokenizer": tokenizer_stage, "clip": clip_stage, "vae": vae_stage}
    if stage not in stages:
        raise ValueError(f"unknown text2img stage {stage!r}; known: {', '.join(stages)}")
    sizes(run.size)  # reject an unknown size before any work
    out = stages[stage](run)
    layout.write_model_index(run.root)
    return out


def tokenizer_stage(run: StageRun) -> Path:
    from ddm.training.text2img.tokenizer import build_tokenizer

    return layout.save_component(build_tokenizer(run.data().captions), run.root,
                                 layout.TOKENIZER)


def load_tokenizer(root: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_component(root, layout.TOKENIZER))


def load_clip(root: Path) -> Any:
    from transformers import CLIPModel

    return CLIPModel.from_pretrained(_component(root, layout.CLIP)).eval().requires_grad_(False)


def load_vae(root: Path) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(_component(root, layout.VAE)).eval().requires_grad_(
        False)


def clip_stage(run: StageRun) -> Path:
    from ddm.training.text2img.clip import text_encoder_of, train_clip

    tokenizer = load_tokenizer(run.root)
    clip = train_clip(run.data(), tokenizer, sizes(run.size), run.train,
                      run.resumable(layout.CLIP), run.progress)
    layout.save_component(text_encoder_of(clip), run.root, layout.TEXT_ENCODER)
    return layout.save_component(clip, run.root, layout.CLIP)


def vae_stage(run: StageRun) -> Path:
    from ddm.training.text2img.vae import train_vae

    vae = train_vae(run.data(), sizes(run.size), run.train, run.resumable(layout.VAE),
                    run.progress)
    return layout.save_component(vae, run.root, layout.VAE)


def _component(root: Path, name: str) -> Path:
    path = root / name
    if not layout.finished(path):
        raise FileNotFoundError(f"{path} is missing: run its stage of `ddm train text2img` "
                                "first")
    return path
