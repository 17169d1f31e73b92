#!/usr/bin/env bash
# Trains the text-to-image DDM of issue 23 (coloured MNIST, prompts in, RGB digits out) into one
# diffusers-style directory OUT, stage by stage, with `ddm train text2img STAGE`:
#   tokenizer  word-level vocabulary of the captions (tokenizers), saved as tokenizer/
#   clip       a small CLIP trained contrastively on (image, caption): clip/ (both towers,
#              for partition features and scoring) and its frozen text tower, text_encoder/
#   vae        AutoencoderKL 32x32x3 -> 4x8x8, its scaling factor measured from its latents: vae/
# Each stage reads the ones before it from OUT and refreshes OUT/model_index.json.
# Usage: scripts/train_text2img.sh [STAGE...]   (default: every stage, in this order)
# MNIST is read from $MNIST (a directory with the four IDX files). CPU-heavy: run it under
# `nice -n 19` with OMP_NUM_THREADS=1. Long runs resume: each training saves its state every
# $SAVE_EVERY steps to OUT/COMPONENT.training/ and is started with --resume, so rerunning the
# script continues where it was stopped; a component whose config is written is skipped.
# CPU budget (one x86 core, measured per step; target under 5 CPU-hours in all):
#   tokenizer  seconds
#   clip       2000 steps x 0.85 CPU-s (batch 128)  ~ 28 CPU-min
#   vae        3000 steps x 0.30 CPU-s (batch 32)   ~ 15 CPU-min
set -euo pipefail
cd "$(dirname "$0")/.."
MNIST=${MNIST:-../shared/datasets/mnist}
OUT=${OUT:-$HOME/.cache/ddm/train/t2i}
DDM=${DDM:-.venv/bin/ddm}
SIZE=${SIZE:-small}
SAVE_EVERY=${SAVE_EVERY:-100}
COMMON=(--mnist "$MNIST" --root "$OUT" --size "$SIZE")
LONG=(--save-every "$SAVE_EVERY" --resume)

done_already() {  # a finished component is not trained again
    { [ -f "$OUT/$1/config.json" ] || [ -f "$OUT/$1/tokenizer.json" ]; } \
        && echo "$OUT/$1 exists: skipped" >&2
}

stage() {  # stage NAME COMPONENT [ARGS...]: time one stage, skipped once COMPONENT exists
    local name=$1 component=$2
    shift 2
    done_already "$component" && return
    echo "== $name ($(date -u +%FT%TZ))" >&2
    /usr/bin/time -f "$name: %U CPU-s user, %S sys, %e s wall" \
        $DDM train text2img "$name" "${COMMON[@]}" "$@"
}

tokenizer() { stage tokenizer tokenizer; }
clip() { stage clip clip "${LONG[@]}"; }
vae() { stage vae vae "${LONG[@]}"; }

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tokenizer clip vae)
for name in "${stages[@]}"; do
    case "$name" in
        tokenizer | clip | vae) "$name" ;;
        *) echo "unknown stage $name; known: tokenizer clip vae" >&2
           exit 2 ;;
    esac
done
