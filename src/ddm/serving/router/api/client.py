"""Sample a served DDM: what ``ddm sample --router URL`` asks a running router for.

The router's ``POST /v1/generate`` takes at most its batch limit of labels per request, so a
run is split into requests that each pass ``first_index``: image ``i`` of the run gets the
noise ``(seed, i)`` whichever request carries it, and the images equal those of the
in-process driver (``ddm sample``) for the same arguments. ``ddm eval`` then scores what users
are actually served (``ddm up`` or a cluster's router Service), not a local re-run.

A text DDM's router (``/v1/info`` says ``conditioning: text``) takes ``prompts`` and guidance
instead, and answers RGB images: the pixels ``ddm sample DIR --prompt`` makes in-process.

The router is a peer like any other: each reply is read by :func:`ddm.serving.http.fetch.fetch_json`
within a deadline and a cap (``/v1/info``: :data:`MAX_INFO_BYTES`; a generation: what its
images can take, :data:`MAX_IMAGE_REPLY_BYTES` each); a failure is a
:class:`~ddm.serving.http.fetch.FetchError` naming the URL and why.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ddm.fileio import check_output
from ddm.progress import progress_bar
from ddm.deploy.limits import MAX_IMAGE_SIDE
from ddm.samples import check_text_outputs, save_samples_npz, write_png_grid, write_text_samples
from ddm.serving.http.fetch import fetch_json

#: Per request: far above a full batch's time on a CPU router (docs/benchmarks.md, ``load``).
TIMEOUT_S = 600.0
#: The router's ``/v1/info``: its limits, defaults and experts (each with its partition, cut
#: to the router's own bounds); the digits router's is 3 KB.
MAX_INFO_BYTES = 4 * 1024 * 1024
#: A generation's reply per image: a base64 PNG of at most MAX_IMAGE_SIDE squared RGB pixels
#: stored uncompressed (a filter byte per row), 4/3 of its bytes in base64, with its routing
#: and expert calls (4.2 MB at 1024 x 1024).
MAX_IMAGE_REPLY_BYTES = 4 * MAX_IMAGE_SIDE * (3 * MAX_IMAGE_SIDE + 1) // 3 + 64 * 1024
#: A generation's reply beyond its images.
MAX_REPLY_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServedSamples:
    """``images`` uint8 ``(N, H, W)`` (a text DDM's: ``(N, H, W, 3)`` RGB); ``expert_calls``
    and ``routing`` per image."""

    images: np.ndarray
    expert_calls: np.ndarray
    routing: list[list[int]]


def router_info(url: str, token: str | None = None) -> dict[str, Any]:
    """``GET /v1/info``: the router's classes, limits and experts."""
    return fetch_json(f"{url.rstrip('/')}/v1/info", deadline=TIMEOUT_S, cap=MAX_INFO_BYTES,
                      token=token)


def served_samples(url: str, labels: Sequence[int], steps: int, seed: int, strategy: str,
                   solver: str, batch_size: int | None = None,
                   token: str | None = None,
                   on_images: Callable[[int], None] | None = None) -> ServedSamples:
    """One image per label from the router at ``url``, ``batch_size`` labels per request
    (default: the router's own batch limit, read from ``/v1/info``); ``on_images`` hears
    how many images each answer brought (a progress bar)."""
    if batch_size is None:
        batch_size = int(router_info(url, token)["limits"]["max_batch"])
    return _served(url, "labels", [int(v) for v in labels],
                   {"steps": steps, "seed": seed, "strategy": strategy, "solver": solver},
                   batch_size, token, on_images)


def _served(url: str, key: str, rows: list[Any], fields: dict[str, Any], batch_size: int,
            token: str | None, on_images: Callable[[int], None] | None) -> ServedSamples:
    """``rows`` (labels or prompts, under ``key``) in requests of ``batch_size``, each with
    ``fields`` and its ``first_index``: image ``i`` gets the noise ``(seed, i)``."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    images, calls, routing = [], [], []
    for start in range(0, len(rows), batch_size):
        body = {key: rows[start:start + batch_size], **fields, "first_index": start}
        answer = fetch_json(f"{url.rstrip('/')}/v1/generate", deadline=TIMEOUT_S,
                            cap=MAX_REPLY_OVERHEAD_BYTES + len(body[key]) * MAX_IMAGE_REPLY_BYTES,
                            token=token, body=body)
        images += [_decode_png(text) for text in answer["images"]]
        calls += answer["expert_calls"]
        routing += answer["routing"]
        if on_images is not None:
            on_images(len(answer["images"]))
    return ServedSamples(np.stack(images), np.asarray(calls, np.int64), routing)


def sample_router_command(url: str, strategy: str, labels: Sequence[int], n_per_label: int,
                          steps: int, solver: str, seed: int, batch_size: int | None,
                          token_file: Path | None, out: Path,
                          png: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """``ddm sample --router URL``: the samples file of ``ddm sample``, made by a served DDM
    (a progress bar of the images received on a terminal's stderr unless ``quiet``)."""
    if n_per_label < 1:
        raise ValueError(f"--n-per-label must be >= 1, got {n_per_label}")
    check_output(out, ".npz", "--out")
    if png is not None:
        check_output(png, ".png", "--png")
    token = read_token(token_file)
    all_labels = np.repeat(np.asarray(list(labels), dtype=np.int64), n_per_label)
    with progress_bar(len(all_labels), f"sampling {len(all_labels)} images from {url}",
                      "image", quiet) as bar:
        served = served_samples(url, all_labels.tolist(), steps, seed, strategy, solver,
                                batch_size, token, on_images=bar.update)
    save_samples_npz(out, served.images, all_labels, served.expert_calls,
                     {"strategy": strategy, "steps": steps, "solver": solver, "seed": seed,
                      "source": url})
    if png is not None:
        write_png_grid(png, served.images,
                       columns=n_per_label if n_per_label > 1 else len(all_labels))
    return {"out": str(out), "n": int(len(all_labels)), "strategy": strategy, "steps": steps,
            "mean_expert_calls": float(served.expert_calls.mean())}


def sample_router_text_command(info: dict[str, Any], url: str, prompts: Sequence[str], *,
                               steps: int, strategy: str, guidance_scale: float,
                               negative_prompt: str | None, guidance_cutoff: float, seed: int,
                               solver: str,
                               batch_size: int | None, token: str | None, out: Path,
                               png: Path | None = None, quiet: bool = False
                               ) -> dict[str, Any]:
    """``ddm sample --router URL --prompt ...``: one RGB image per prompt from a text DDM's
    router (``info``: its ``/v1/info``; the parameters as ``ddm sample`` chose them, from
    the router's defaults where no flag names them), written as ``ddm sample DIR --prompt``
    writes them."""
    if not prompts:
        raise ValueError(f"the router at {url} serves a text DDM: give --prompt (one image "
                         "per --prompt)")
    check_text_outputs(out, png)
    fields = {"steps": steps, "seed": seed, "strategy": strategy, "solver": solver,
              "guidance_cutoff": guidance_cutoff, "guidance_scale": guidance_scale,
              "negative_prompt": negative_prompt}
    with progress_bar(len(prompts), f"sampling {len(prompts)} images from {url}", "image",
                      quiet) as bar:
        served = _served(url, "prompts", list(prompts), fields,
                         int(info["limits"]["max_batch"]) if batch_size is None
                         else batch_size, token, bar.update)
    return write_text_samples(out, png, served.images, prompts, served.expert_calls,
                              {**fields, "source": url})


def read_token(token_file: Path | None) -> str | None:
    """The bearer token in ``token_file`` (``--token-file``), or None without one."""
    if token_file is None:
        return None
    try:
        return token_file.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--token-file {token_file} cannot be read: {exc.strerror}") from None


def _decode_png(text: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(text))) as image:
        # a text DDM's images are RGB; a label DDM's digits grayscale
        return np.asarray(image.convert("RGB" if image.mode == "RGB" else "L"), np.uint8)
