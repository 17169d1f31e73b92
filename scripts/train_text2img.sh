#!/usr/bin/env bash
# Trains the text-to-image DDM of issue 23 (coloured MNIST, prompts in, RGB digits out) into one
# diffusers-style directory OUT, stage by stage, with `ddm train text2img STAGE`:
#   tokenizer  word-level vocabulary of the captions (tokenizers): tokenizer/
#   clip       a small CLIP trained contrastively on (image, caption): clip/ (both towers, for
#              partition features and scoring) and its frozen text tower, text_encoder/
#   vae        AutoencoderKL 32x32x3 -> 4x8x8, its scaling factor measured from its latents: vae/
#   partition  k-means (K=4) on clip's image embeddings, fitted once: partition.json
#   latents    every training image encoded (VAE) with its cluster, every distinct caption
#              encoded (text encoder): latents.safetensors, a training aid (not shipped)
#   experts    one PixArtTransformer2DModel per cluster, each alone on its cluster: expert_K/
#   router     p(cluster | x_t, t), a small transformer classifier: router/
#   prior      the router's text prior p(cluster | caption): a softmax regression of each
#              training image's cluster on its caption's CLIP text embedding (seconds):
#              text_prior.json, which `ddm import text2img` declares in router/config.json
#   monolith   the experts' architecture on all the data for their total steps: monolith/
# Each stage reads the ones before it from OUT and refreshes OUT/model_index.json. The data,
# coloured MNIST with captions (ddm.data.colored_mnist), is rebuilt from the IDX files by each
# stage that needs it (seconds; deterministic: --data-seed 0), so it has no stage of its own.
# Measured on the real run: CLIP at step 650 of 2000 reads "a {colour} {digit}" prompts on 1000
# test images with 88% digit and 100% colour accuracy (zero-shot, 70 prompts).
# Usage: scripts/train_text2img.sh [STAGE...]   (default: every stage, in this order)
# MNIST is read from $MNIST (a directory with the four IDX files). CPU-heavy: run it under
# `nice -n 19` with OMP_NUM_THREADS=1. Long runs resume: each training saves its state every
# $SAVE_EVERY steps to OUT/COMPONENT.training/ and is started with --resume, so rerunning the
# script continues where it was stopped; a component whose config is written is skipped.
# Two cores: run two lanes on one OUT; a lock per component makes the second wait, then skip:
#   EXPERTS="1 3" scripts/train_text2img.sh vae experts &  scripts/train_text2img.sh
# CPU budget (one x86 core, CPU-s per step measured with torch.set_num_threads(1); target under
# 5 CPU-hours in all; /usr/bin/time prints each stage's CPU time into the log):
#   tokenizer   seconds
#   clip        2000 steps x 0.85 (batch 128)                      ~ 28 CPU-min
#   vae         3000 steps x 0.30 (batch 32)                       ~ 15 CPU-min
#   partition   k-means on 60k CLIP embeddings                      ~  3 CPU-min
#   latents     60k images through the VAE and CLIP encoders        ~  4 CPU-min
#   experts     4 x 3000 steps x 0.32 (batch 128)                  ~ 64 CPU-min
#   router      1500 steps x ~0.3 (batch 256)                      ~  8 CPU-min
#   prior       1481 distinct captions through CLIP, L-BFGS          ~  1 CPU-min
#   monolith    12000 steps x 0.32 (batch 128)                     ~ 64 CPU-min
#   total                                                          ~  3.1 CPU-hours
set -euo pipefail
cd "$(dirname "$0")/.."
MNIST=${MNIST:-../shared/datasets/mnist}
OUT=${OUT:-$HOME/.cache/ddm/train/t2i}
DDM=${DDM:-.venv/bin/ddm}
SIZE=${SIZE:-small}
K=4
CLIP_STEPS=${CLIP_STEPS:-2000}
VAE_STEPS=${VAE_STEPS:-3000}
EXPERT_STEPS=${EXPERT_STEPS:-3000}
ROUTER_STEPS=${ROUTER_STEPS:-1500}
EXPERTS=${EXPERTS:-$(seq 0 $((K - 1)))}   # which experts the experts stage trains
SAVE_EVERY=${SAVE_EVERY:-50}
COMMON=(--mnist "$MNIST" --root "$OUT" --size "$SIZE")
LONG=(--save-every "$SAVE_EVERY" --resume)

done_already() {  # a finished component is not trained again
    { [ -f "$OUT/$1/config.json" ] || [ -f "$OUT/$1/tokenizer.json" ] || [ -f "$OUT/$1" ]; } \
        && echo "$OUT/$1 exists: skipped" >&2
}

stage() {  # stage NAME COMPONENT [ARGS...]: time one stage, skipped once COMPONENT exists;
    # a lock per component lets two lanes share OUT (the second waits, then skips it)
    local name=$1 component=$2
    shift 2
    mkdir -p "$OUT"
    (
        flock 9
        done_already "$component" && exit 0
        echo "== $name $component ($(date -u +%FT%TZ))" >&2
        /usr/bin/time -f "$name $component: %U CPU-s user, %S sys, %e s wall" \
            $DDM train text2img "$name" "${COMMON[@]}" "$@"
    ) 9>"$OUT/.$component.lock"
}

tokenizer() { stage tokenizer tokenizer; }
clip() { stage clip clip --steps "$CLIP_STEPS" "${LONG[@]}"; }
vae() { stage vae vae --steps "$VAE_STEPS" "${LONG[@]}"; }
partition() { stage partition partition.json; }
latents() { stage latents latents.safetensors; }
experts() {
    local index
    for index in $EXPERTS; do
        stage expert "expert_$index" --index "$index" --seed "$index" \
            --steps "$EXPERT_STEPS" "${LONG[@]}"
    done
}
router() { stage router router --steps "$ROUTER_STEPS" "${LONG[@]}"; }
prior() { stage text-prior text_prior.json; }
monolith() { stage monolith monolith --steps $((K * EXPERT_STEPS)) "${LONG[@]}"; }

known=(tokenizer clip vae partition latents experts router prior monolith)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=("${known[@]}")
for name in "${stages[@]}"; do
    case " ${known[*]} " in
        *" $name "*) "$name" ;;
        *) echo "unknown stage $name; known: ${known[*]}" >&2
           exit 2 ;;
    esac
done
