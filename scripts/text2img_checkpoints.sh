#!/usr/bin/env bash
# Makes checkpoints/text2img, the shipped text-to-image DDM, from the training's directory OUT
# (scripts/train_text2img.sh): `ddm import text2img` writes each stage as
# a declared stage checkpoint (expert_0..3, router, text_encoder with its tokenizer, decoder),
# the report's aids (monolith, clip) and ddm.yaml with the image's checkpoint URIs, after
# loading every stage. While the monolith still trains (12000 steps: hours on a shared CPU),
# its latest saved state is exported first (`ddm train text2img monolith-snapshot`) and
# imported as the baseline; its config.json and the report say how many steps it had.
# Usage: OUT=... scripts/text2img_checkpoints.sh   (then `ddm report --checkpoints
# checkpoints/text2img --out docs/quality-text2img.md`)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$HOME/.cache/ddm/train/t2i}
MNIST=${MNIST:-../shared/datasets/mnist}
PYTHON=${PYTHON:-.venv/bin/python}
DEST=${DEST:-checkpoints/text2img}

if [ ! -f "$OUT/monolith/config.json" ]; then
    $PYTHON -m ddm train text2img monolith-snapshot --mnist "$MNIST" --root "$OUT" --quiet
fi
rm -rf "$DEST"
$PYTHON -m ddm import text2img "$OUT" --out "$DEST" \
    --checkpoint-base image:///opt/ddm/checkpoints/text2img/
du -sh "$DEST"
