#!/usr/bin/env bash
# Trains every shipped checkpoint in checkpoints/digits with the project's own commands.
# The experts mirror the reference demo: digits 0-4 in PyTorch, digits 5-9 in JAX/Flax.
# The monolith, the baseline in docs/quality-digits.md, gets as many steps as each expert.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-checkpoints/digits}
DDM=${DDM:-.venv/bin/ddm}
PARTITION="labels:0-4,5-9"

$DDM train expert --framework torch --partition "$PARTITION" --index 0 --steps 4000 --out "$OUT/expert-0-4" "$@"
$DDM train expert --framework jax   --partition "$PARTITION" --index 1 --steps 4000 --out "$OUT/expert-5-9" "$@"
$DDM train monolith --framework torch --steps 4000 --out "$OUT/monolith" "$@"
$DDM train router --experts "$OUT" --steps 1500 --out "$OUT/router" "$@"
$DDM train classifier --split heldout --steps 1500 --out "$OUT/classifier" "$@"
