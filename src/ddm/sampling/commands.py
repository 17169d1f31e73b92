"""``ddm sample``: generate labelled digits in-process and write them as a samples file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ddm.checkpoints.discovery import default_checkpoints
from ddm.fileio import atomic_path, check_output
from ddm.models.loading import load_ddm
from ddm.progress import progress_bar
from ddm.sampling.loop import StepEvent, check_request
from ddm.sampling.pipeline import generate, mixture_of, sampling_request
from ddm.samples import save_samples_npz


def sample_command(checkpoints: Path | None, strategy: str, labels: Sequence[int],
                   n_per_label: int, steps: int, solver: str, seed: int, backend: str,
                   device: str | None, batch_size: int, out: Path,
                   png: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Generate ``n_per_label`` images per label; write ``out`` (and ``png``) atomically,
    with a progress bar of the sampling steps on a terminal's stderr unless ``quiet``.

    The samples file holds ``images`` (N, H, W) uint8 (0 background, 255 ink), ``labels``
    (N,) int64 and ``expert_calls`` (N,) int64, plus the settings that produced them.
    """
    if n_per_label < 1:
        raise ValueError(f"--n-per-label must be >= 1, got {n_per_label}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    check_output(out, ".npz", "--out")
    if png is not None:
        check_output(png, ".png", "--png")
    all_labels = np.repeat(np.asarray(list(labels), dtype=np.int64), n_per_label)
    request = sampling_request(all_labels, steps, seed, strategy, solver)
    source = checkpoints or default_checkpoints()
    ddm = load_ddm(source, backend=backend, device=device)
    check_request(mixture_of(ddm), request)  # the whole request, before any chunk runs
    parsed = request.strategy

    images, calls = [], []
    starts = range(0, len(all_labels), batch_size)
    with progress_bar(len(starts) * steps, f"sampling {len(all_labels)} images", "step",
                      quiet) as bar:
        for chunk_index, start in enumerate(starts):
            def advance(event: StepEvent, done: int = chunk_index * steps) -> None:
                bar.update(done + event.step - bar.n)

            chunk = generate(ddm, all_labels[start:start + batch_size], steps, seed, parsed,
                             solver, first_index=start, on_step=advance)
            images.append(chunk.images)
            calls.append(chunk.expert_calls)
    images, calls = np.concatenate(images), np.concatenate(calls)
    routing = parsed.name if ddm.is_mixture else "single"
    save_samples_npz(out, images, all_labels, calls,
                     {"strategy": routing, "steps": steps, "solver": solver, "seed": seed,
                      "source": str(source)})
    if png is not None:
        write_png_grid(png, images, columns=n_per_label if n_per_label > 1 else len(all_labels))
    return {"out": str(out), "n": int(len(all_labels)), "strategy": routing, "steps": steps,
            "mean_expert_calls": float(calls.mean())}


def sample_text_command(checkpoints: Path, prompts: Sequence[str], steps: int | None,
                        seed: int, strategy: str | None, guidance: float | None,
                        backend: str, out: Path, png: Path | None = None) -> dict[str, Any]:
    """One image per prompt from the text DDM of stage checkpoints at ``checkpoints``
    (``ddm import``), its experts on ``backend`` (``native``: PyTorch, as trained); steps,
    strategy and guidance default to the DDM's. Writes ``out`` (``images`` (N, H, W, 3)
    uint8, ``prompts``, ``expert_calls``) and ``png``, atomically."""
    from ddm.models.stages import load_text_ddm
    from ddm.sampling.pipeline import generate_text

    check_output(out, ".npz", "--out")
    if png is not None:
        check_output(png, ".png", "--png")
    ddm = load_text_ddm(checkpoints, backends=("torch",) if backend == "native" else (backend,))
    result = generate_text(ddm, prompts, steps=steps, seed=seed, strategy=strategy,
                           guidance_scale=guidance)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, images=result.images, prompts=np.asarray(list(prompts)),
                     expert_calls=result.expert_calls)
    if png is not None:
        write_png_grid(png, result.images, columns=len(prompts))
    return {"out": str(out), "n": len(prompts), "steps": steps or ddm.steps,
            "strategy": strategy or ddm.strategy,
            "guidance_scale": ddm.guidance_scale if guidance is None else guidance,
            "mean_expert_calls": float(result.expert_calls.mean())}


def write_png_grid(path: Path, images: np.ndarray, columns: int) -> None:
    from ddm.imaging import grid, png_bytes

    with atomic_path(path) as tmp:
        tmp.write_bytes(png_bytes(grid(images, columns), scale=2))
