#!/usr/bin/env bash
# Issue 37's GPU check as the lent device machine runs it (docs/paris.md, "Paris on one GPU").
# Here, first: `make device-wheels` (what the device image lacks, as wheels in .whl/). There,
# two calls on one warm machine (it keeps the imported release between them; the whole check,
# each pooled deployment through two routers, no longer fits one 600 s call), within a
# session's 900 s of device time, the machine's start included (docs/paris.md):
#
#   run(command="DDM_GPU_CHECK_S=450 bash benchmarks/gpu-check.sh --part compiled",
#       carry=[".whl"], timeout_s=480)
#   # at once (a machine idle for 30 s goes back, the imported release with it); L is
#   # status's budget_left_s:
#   run(command="DDM_GPU_CHECK_S=<L - 60> bash benchmarks/gpu-check.sh --part eager",
#       carry=[".whl"], timeout_s=<L - 30>)  # --part pool (the eager pool alone) under 240 s
#
# `--part forwards` measures one full-size expert's forwards instead (benchmarks/forwards.py,
# into $OUT/forwards.json), `--part kernels` its levels, kernels (eager and compiled) and the
# grouped forward (into $OUT/kernels.json): what the next session runs first (docs/paris.md).
#
# It installs the carried wheels beside the image's own packages (its PyTorch, transformers,
# JAX...), checks that every module the check loads imports, then runs
# `python -m benchmarks gpu-check` with this checkout's sources, stopped (its servers too) after
# DDM_GPU_CHECK_S seconds (default 540), before the device kills everything. $OUT receives
# gpu-check.json (rewritten after each deployment), nvidia-smi.txt and log.txt; without $OUT,
# out/gpu-check. Arguments go to gpu-check. On any machine, with this checkout's venv and no
# wheels: `PYTHON=.venv/bin/python DDM_DEVICE_WHEELS= bash benchmarks/gpu-check.sh --quick`.
# PYTHON, DDM_DEVICE_WHEELS (empty: none) and DDM_DEVICE_SITE override the interpreter, the
# wheels' folder (.whl/) and where they are installed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/out/gpu-check}
python=${PYTHON:-python3}
wheelhouse=${DDM_DEVICE_WHEELS-$root/.whl}
site=${DDM_DEVICE_SITE:-/tmp/ddm-device-site}
deadline=${DDM_GPU_CHECK_S:-540}

check() {
  shopt -s nullglob
  local wheels=()
  [[ -n $wheelhouse ]] && wheels=("$wheelhouse"/*.whl)
  if ((${#wheels[@]})); then
    echo "gpu-check.sh: installing ${#wheels[@]} carried wheels into $site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"  # py-spy (benchmarks/host_profile.py)
    echo "gpu-check.sh: pip check (for the record: the image's own packages may disagree too)"
    "$python" -m pip check || true
  fi
  # Absolute paths: ddm up's servers and the in-process child start in other directories.
  export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  # JAX is on the device image; should anything start its CUDA backend, it must not take 75%
  # of the GPU before PyTorch's servers load.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false

  # Seconds, not minutes of device time, to learn that a package is missing.
  "$python" - <<'EOF'
import importlib, sys

modules = ("torch", "diffusers", "transformers", "tokenizers", "safetensors", "fastapi",
           "uvicorn", "httptools", "aiohttp", "ml_dtypes", "prometheus_client", "PIL", "yaml",
           "ddm.cli", "ddm.serving.model.server", "ddm.serving.router.api.server",
           "ddm.models.paris_import", "ddm.sampling.pipeline", "benchmarks.gpu_check",
           "tests.support.paris_release")
missing = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:  # every failure is reported, then the run stops
        missing.append(f"{name}: {type(error).__name__}: {error}")
if missing:
    sys.exit("gpu-check.sh: cannot import what the check needs (make device-wheels, then "
             "carry .whl):\n  " + "\n  ".join(missing))
import torch
print(f"gpu-check.sh: Python {sys.version.split()[0]}, PyTorch {torch.__version__}, "
      f"CUDA {torch.cuda.is_available()}", flush=True)
EOF

  cd "$root"
  local status=0
  # SIGTERM at the deadline: gpu-check stops the servers it started, then exits 124 here.
  timeout -s TERM -k 30 "$deadline" "$python" -m benchmarks gpu-check --out "$out" "$@" \
    || status=$?
  if ((status == 124)); then
    echo -n "gpu-check.sh: stopped at its deadline of $deadline s (DDM_GPU_CHECK_S): "
    if [[ -f $out/gpu-check.json ]]; then
      echo "$out/gpu-check.json holds what was measured (\"complete\": false)"
    else
      echo "no deployment was measured yet"
    fi
  fi
  return "$status"
}

mkdir -p "$out"
check "$@" 2>&1 | tee "$out/log.txt"
