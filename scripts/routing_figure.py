"""docs/routing.png: which expert ran each denoising step, for a few real samples.

Rows are samples (one per label), columns are steps (left: noise, right: the digit); each cell
is the state x_t after that step, framed in the colour of the expert that ran the step (as
``POST /v1/generate`` reports it in ``routing``), with a bar under it as long as the router
network's probability for that expert, p(k | x_t, t, y), before the label mask. Sampled in
this process with the shipped digits DDM (``ddm.sampling.pipeline``), Euler, deterministic.

    PYTHONPATH=src python scripts/routing_figure.py [--checkpoints checkpoints/digits]
        [--steps 20] [--seed 0] [--strategy top1] [--out docs/routing.png]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ddm.conditioning import Conditioning
from ddm.convention import to_uint8
from ddm.models.ddm import load_ddm
from ddm.sampling.loop import Tally
from ddm.sampling.pipeline import sampling_request, steps_of

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
CELL, FRAME, BAR, GAP, LEFT, TOP = 32, 3, 4, 3, 60, 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints/digits"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default="top1")
    parser.add_argument("--out", type=Path, default=Path("docs/routing.png"))
    args = parser.parse_args()

    ddm = load_ddm(args.checkpoints, backends=("torch",))
    probabilities: list[np.ndarray] = []  # (B, K) per router query, in order

    def recording_router(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        p = np.asarray(ddm.router(x, t, cond))
        probabilities.append(p)
        return p

    labels = list(range(ddm.num_classes))
    request = sampling_request(labels, args.steps, args.seed, args.strategy)
    names = ddm.expert_names
    tally, frames = Tally(names, labels), []
    for event in steps_of(dataclasses.replace(ddm, router=recording_router), request):
        tally.add(event)
        frames.append(to_uint8(event.x[:, 0]))
    routing = tally.result().usage.step_masks(args.steps)  # (N, steps) bitmasks
    draw_figure(frames, routing, probabilities, names, labels, args.strategy).save(args.out)
    print(f"wrote {args.out}: {len(labels)} samples x {args.steps} steps, experts {names}")


def draw_figure(frames: list[np.ndarray], routing: np.ndarray, probabilities: list[np.ndarray],
                names: tuple[str, ...], labels: list[int], strategy: str) -> Image.Image:
    """The grid: ``frames[step]`` (N, H, W) uint8, ``routing`` (N, steps) bitmasks."""
    steps, rows = len(frames), len(labels)
    pitch_x, pitch_y = CELL + 2 * FRAME + GAP, CELL + 2 * FRAME + BAR + 2 * GAP
    width = LEFT + steps * pitch_x + 10
    height = TOP + rows * pitch_y + 40
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    pen.text((LEFT, 6), f"steps 1..{steps} (noise -> digit), strategy {strategy}; frame colour: "
                        "the expert that ran the step; bar: router p(that expert | x_t, t, y)",
             fill="black")
    for row, label in enumerate(labels):
        y0 = TOP + row * pitch_y
        pen.text((8, y0 + CELL // 2), f"label {label}", fill="black")
        for step in range(steps):
            x0 = LEFT + step * pitch_x
            chosen = [k for k in range(len(names)) if routing[row, step] >> k & 1]
            colour = COLOURS[chosen[0] % len(COLOURS)] if len(chosen) == 1 else (0, 0, 0)
            pen.rectangle([x0, y0, x0 + CELL + 2 * FRAME - 1, y0 + CELL + 2 * FRAME - 1],
                          fill=colour)
            cell = Image.fromarray(frames[step][row]).resize((CELL, CELL), Image.NEAREST)
            image.paste(cell, (x0 + FRAME, y0 + FRAME))
            if probabilities and chosen:
                p = float(probabilities[step][row, chosen].sum())
                bar_y = y0 + CELL + 2 * FRAME + 1
                pen.rectangle([x0, bar_y, x0 + CELL + 2 * FRAME - 1, bar_y + BAR - 1],
                              fill=(225, 225, 225))
                pen.rectangle([x0, bar_y, x0 + round(p * (CELL + 2 * FRAME)) - 1,
                               bar_y + BAR - 1], fill=colour)
    legend_y = TOP + rows * pitch_y + 10
    for k, name in enumerate(names):
        x0 = LEFT + k * 160
        pen.rectangle([x0, legend_y, x0 + 14, legend_y + 14], fill=COLOURS[k % len(COLOURS)])
        pen.text((x0 + 20, legend_y + 2), name, fill="black")
    return image


if __name__ == "__main__":
    main()
