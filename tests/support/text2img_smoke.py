"""A text2img DDM trained for one step per stage at the smoke size, by its CLI, on tiny IDX
files: every component real (tokenizer, CLIP, VAE, partition, experts, router, its text prior,
monolith)."""

from __future__ import annotations

from pathlib import Path

from ddm.cli import main
from tests.support.bars_mnist import write_bars_mnist


def train_smoke_text2img(base: Path) -> tuple[Path, Path]:
    """``(mnist directory, DDM root)`` under ``base``."""
    write_bars_mnist(base / "mnist", per_class=4)
    root = base / "ddm"
    stages = [["tokenizer"], ["clip"], ["vae"], ["partition"], ["latents"]] + [
        ["expert", "--index", str(i)] for i in range(4)] + [
        ["router"], ["text-prior"], ["monolith"]]
    for stage in stages:
        assert main(["train", "text2img", *stage, "--mnist", str(base / "mnist"), "--root",
                     str(root), "--size", "smoke", "--steps", "1", "--batch-size", "4",
                     "--quiet"]) == 0
    return base / "mnist", root
