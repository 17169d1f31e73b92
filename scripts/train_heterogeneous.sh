#!/usr/bin/env bash
# Trains the one new checkpoint of checkpoints/digits-heterogeneous: a DDPM-style
# epsilon-prediction expert for digits 0-4 (linear betas, T = 1000 discrete steps) with the
# partition, framework, settings and steps (4000) of its velocity counterpart
# checkpoints/digits/expert-0-4, so that it can replace it (1870 s on the shared 2-core machine,
# one torch thread). The velocity expert for 5-9 and the router are reused from
# checkpoints/digits (relative links in checkpoints/digits-heterogeneous).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-checkpoints/digits-heterogeneous}
DDM=${DDM:-.venv/bin/ddm}

$DDM train expert --framework torch --partition "labels:0-4,5-9" --index 0 --steps 4000 \
    --objective epsilon --schedule vp-linear --time discrete --timesteps 1000 \
    --out "$OUT/expert-0-4-epsilon" "$@"
