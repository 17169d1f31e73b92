#!/usr/bin/env bash
# Trains the MNIST DDM of issue 15 into checkpoints/mnist with the project's own commands:
#   classifier  the evaluation classifier (learns MNIST's training split; the test split is
#               the reference of every Frechet distance, so it never sees it)
#   partition   k-means (K=4) on HOG features of the training images, fitted ONCE
#   experts     one class-conditional expert per cluster, alternating PyTorch and JAX,
#               each with its own seed: they share the partition file, not a refit
#   router      p(k | x_t, t, y) on noisy training images, for those experts
#   monolith    the same UNet on all the data with the experts' total compute
#   ship        copy the finished models from OUT into checkpoints/mnist (weights and config
#               only, world-readable: the images run them as an unprivileged user)
#   report      docs/quality.md from the shipped models: 3 runs of 1000 digits per row (about
#               an hour of CPU; every run is kept in $REPORT_CACHE, so a stopped report resumes
#               and a new model samples only its own rows)
# Usage: scripts/train_mnist.sh [STAGE...]   (default: every stage, in this order)
# Two cores: train two experts at once, one lane each, e.g.
#   EXPERTS="1 3" scripts/train_mnist.sh experts &  EXPERTS="0 2" scripts/train_mnist.sh experts
# MNIST is read from $MNIST (a directory with the four IDX files); images are 28x28 padded
# to 32x32. CPU-heavy: run it under `nice -n 19`, one stage at a time. Long runs resume: each
# training saves its state every $SAVE_EVERY steps to OUT/NAME.training/ and is started with
# --resume, so rerunning the script continues where it was stopped; a model whose checkpoint
# is already written is skipped. Train outside the repo (OUT=~/.cache/ddm/train/mnist), then
# `OUT=... scripts/train_mnist.sh ship`.
# Budget (mnist-small, batch 128, one x86 core): ~0.6 CPU-s per step, so ~40 CPU-min per
# expert, ~2.7 CPU-h for the monolith (4x the steps); spread over sessions by --resume.
set -euo pipefail
cd "$(dirname "$0")/.."
MNIST=${MNIST:-../shared/datasets/mnist}
OUT=${OUT:-checkpoints/mnist}
DDM=${DDM:-.venv/bin/ddm}
CONFIG=${CONFIG:-mnist-small}   # a 32x32 UNet config of ddm.models.config
EXPERT_STEPS=${EXPERT_STEPS:-4000}
ROUTER_STEPS=${ROUTER_STEPS:-3000}
K=4
EXPERTS=${EXPERTS:-$(seq 0 $((K - 1)))}   # which experts the experts stage trains
DATA="mnist:$MNIST"
PARTITION=${PARTITION:-$OUT/partition.json}
SAVE_EVERY=${SAVE_EVERY:-250}
LONG=(--save-every "$SAVE_EVERY" --resume)
REPORT_CACHE=${REPORT_CACHE:-$HOME/.cache/ddm/report/mnist}

done_already() {  # a finished checkpoint is not trained again
    [ -f "$1/config.json" ] && echo "$1 exists: skipped" >&2
}

classifier() {
    done_already "$OUT/classifier" && return
    $DDM train classifier --data "$DATA" --image-size 32 --channels 16,32 --steps 6000 \
        --seed 0 --out "$OUT/classifier"
}

partition() {
    [ -f "$PARTITION" ] && echo "$PARTITION exists: skipped" >&2 && return
    mkdir -p "$(dirname "$PARTITION")"
    $DDM partition fit --data "$DATA" --kmeans "$K" --features hog --image-size 32 --seed 0 \
        --out "$PARTITION"
}

experts() {
    local frameworks=(torch jax) index
    for index in $EXPERTS; do
        done_already "$OUT/expert-$index" && continue
        $DDM train expert --data "$DATA" --framework "${frameworks[index % 2]}" \
            --config "$CONFIG" --partition "file:$PARTITION" --index "$index" --seed "$index" \
            --steps "$EXPERT_STEPS" "${LONG[@]}" --out "$OUT/expert-$index"
    done
}

router() {
    done_already "$OUT/router" && return
    $DDM train router --data "$DATA" --experts "$OUT" --partition "file:$PARTITION" \
        --steps "$ROUTER_STEPS" "${LONG[@]}" --out "$OUT/router"
}

monolith() {
    done_already "$OUT/monolith" && return
    $DDM train monolith --data "$DATA" --framework torch --config "$CONFIG" \
        --steps $((K * EXPERT_STEPS)) "${LONG[@]}" --out "$OUT/monolith"
}

ship() {
    local shipped=checkpoints/mnist model
    for model in "$OUT"/expert-* "$OUT"/router "$OUT"/monolith; do
        [ -f "$model/config.json" ] || continue
        [ "$(realpath "$model")" = "$(realpath -m "$shipped/${model##*/}")" ] && continue
        install -D -m 644 -t "$shipped/${model##*/}" "$model/config.json" \
            "$model/weights.safetensors"
        echo "shipped $model" >&2
    done
}

report() {
    $DDM report --checkpoints checkpoints/mnist --data "$DATA" --n-per-label 100 \
        --cache "$REPORT_CACHE" --out docs/quality.md
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(classifier partition experts router monolith)
for stage in "${stages[@]}"; do
    case "$stage" in
        classifier | partition | experts | router | monolith | ship | report) "$stage" ;;
        *) echo "unknown stage $stage; known: classifier partition experts router monolith" \
                "ship report" >&2
           exit 2 ;;
    esac
done
