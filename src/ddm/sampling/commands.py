"""``ddm sample``: generate in-process and write a samples file: labelled digits from a label
DDM, RGB images of prompts from a text DDM (its stages, ``ddm.models.stages``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ddm.checkpoints.declared import DECODER, PLAN_NAMES, ROUTER, TEXT_ENCODER
from ddm.checkpoints.discovery import default_checkpoints
from ddm.checkpoints.importers import MANIFEST_FILE
from ddm.checkpoints.local import resolve_checkpoint
from ddm.conditioning import TEXT
from ddm.deploy.imported import TEXT_ENCODER_DIR
from ddm.deploy.spec import DDMManifest, load_manifest
from ddm.fileio import check_output
from ddm.models.ddm import DDM, DDMLayout, load_ddm, load_ddm_stages
from ddm.progress import progress_bar
from ddm.sampling.loop import StepEvent, check_request
from ddm.sampling.pipeline import (generate, generation, mixture_of, sampling_request,
                                   text_request)
from ddm.samples import (check_text_outputs, save_samples_npz, write_png_grid,
                         write_text_samples)
from ddm.sampling_params import SamplingParams


def sample_command(source: SampleSource, strategy: str, labels: Sequence[int],
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
    ddm = load_source(source, backend, device)
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
                      "source": source.name})
    if png is not None:
        write_png_grid(png, images, columns=n_per_label if n_per_label > 1 else len(all_labels))
    return {"out": str(out), "n": int(len(all_labels)), "strategy": routing, "steps": steps,
            "mean_expert_calls": float(calls.mean())}


@dataclass(frozen=True)
class SampleSource:
    """The DDM ``ddm sample`` was pointed at: ``name`` (as the samples file records it),
    whether it is conditioned on text, and its sampling defaults (None: the checkpoints'
    own); ``manifest``: a DDMDeployment naming its checkpoints, else ``root``: a DDM directory
    (None: the shipped default)."""

    name: str
    text: bool
    defaults: SamplingParams | None
    manifest: DDMManifest | None = None
    root: Path | None = None


def sample_source(source: Path | None) -> SampleSource:
    """What ``source`` names: a DDMDeployment YAML (any ``ddm up`` takes; its
    ``spec.sampling`` are the defaults), a DDM directory (with an import's ``ddm.yaml``: that
    manifest), or None (the shipped default DDM, with the declared defaults)."""
    if source is None:
        return SampleSource(str(default_checkpoints()), False, SamplingParams())
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if source.is_file() and source.suffix in (".yaml", ".yml"):
        manifest = load_manifest(source)
        return SampleSource(str(source), manifest.spec.conditioning == TEXT,
                            manifest.spec.sampling, manifest=manifest)
    if not source.is_dir():
        raise ValueError(f"{source} is neither a DDM directory nor a DDMDeployment YAML "
                         f"(e.g. an import's {MANIFEST_FILE})")
    if (source / MANIFEST_FILE).is_file():
        manifest = load_manifest(source / MANIFEST_FILE)
        return SampleSource(str(source), manifest.spec.conditioning == TEXT,
                            manifest.spec.sampling, manifest=manifest)
    text = (source / TEXT_ENCODER_DIR).is_dir()
    return SampleSource(str(source), text, None if text else SamplingParams(), root=source)


def load_source(source: SampleSource, backend: str, device: str | None) -> DDM:
    """The DDM ``source`` names, in this process: a manifest's stages (``native``: each expert
    on its ``framework``, as served), or a directory's (``native``: each checkpoint's own
    framework)."""
    if source.manifest is None:
        return load_ddm(source.root or default_checkpoints(), device=device,
                        backends=(None if backend == "native" else backend,))
    spec = source.manifest.spec
    experts = [resolve_checkpoint(e.checkpoint) for e in spec.experts]
    stages = {role: resolve_checkpoint(stage.checkpoint) for role, stage in spec.stages.items()}
    if source.text and PLAN_NAMES[TEXT_ENCODER] not in stages:
        raise ValueError(f"{source.name}: a text DDM without a text encoder takes embeddings, "
                         "not prompts")
    layout = DDMLayout(tuple(experts), *(stages.get(PLAN_NAMES[role])
                                         for role in (ROUTER, TEXT_ENCODER, DECODER)))
    return load_ddm_stages(
        experts[0].parent, layout, device=device,
        backends=([e.framework for e in spec.experts] if backend == "native" else [backend]))


def sample_text_command(source: SampleSource, prompts: Sequence[str], *, steps: int | None,
                        strategy: str | None, guidance_scale: float | None,
                        negative_prompt: str | None, guidance_cutoff: float | None, seed: int,
                        solver: str | None, backend: str, device: str | None,
                        batch_size: int | None, out: Path, png: Path | None = None,
                        quiet: bool = False) -> dict[str, Any]:
    """One image per prompt from the text DDM ``source`` (a sampling parameter None: the
    DDM's own); write ``out`` (.npz: the samples, with the prompts; .png: the
    image, or a grid of them) and ``png`` atomically. Image ``i``'s noise comes from
    ``(seed, i)``, as the router's: the same request gives the router's pixels."""
    root = source.name
    if not prompts:
        raise ValueError(f"{root} is a text DDM: give --prompt (one image per --prompt)")
    batch_size = 256 if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    check_text_outputs(out, png)
    ddm = load_source(source, backend, device)
    if ddm.decode is None:
        raise ValueError(f"{root} has no decoder (decoder/ or vae/): its latents are no "
                         "images to write")
    request = text_request(ddm, prompts, steps=steps, seed=seed, strategy=strategy,
                           guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           guidance_cutoff=guidance_cutoff, solver=solver)
    check_request(mixture_of(ddm), request)  # the whole request, before any chunk runs
    images, calls = [], []
    starts = range(0, len(prompts), batch_size)
    with progress_bar(len(starts) * request.steps, f"sampling {len(prompts)} images", "step",
                      quiet) as bar:
        for chunk_index, start in enumerate(starts):
            def advance(event: StepEvent, done: int = chunk_index * request.steps) -> None:
                bar.update(done + event.step - bar.n)

            chunk = generation(ddm, replace(request, first_index=start, prompts=tuple(
                prompts[start:start + batch_size])), advance)
            images.append(chunk.images)
            calls.append(chunk.expert_calls)
    return write_text_samples(
        out, png, np.concatenate(images), prompts, np.concatenate(calls),
        {"strategy": request.strategy.name, "steps": request.steps, "solver": request.solver,
         "seed": seed, "source": str(root), "guidance_scale": request.guidance_scale,
         "guidance_cutoff": request.guidance_cutoff, "negative_prompt": negative_prompt})
