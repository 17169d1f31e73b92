#!/usr/bin/env bash
# Issue 37's GPU check as the lent device machine runs it (docs/paris.md, "Paris on one GPU"):
#
#   make device-wheels                      # here, first: what the device image lacks, in .whl/
#   run(command="bash benchmarks/gpu-check.sh", carry=[".whl"], timeout_s=580)
#
# It installs the carried wheels beside the image's own packages (its PyTorch, transformers,
# JAX...), checks that every module the check loads imports, then runs
# `python -m benchmarks gpu-check` with this checkout's sources. $OUT receives gpu-check.json
# (rewritten after each deployment), nvidia-smi.txt and log.txt; without $OUT, out/gpu-check.
# Arguments go to gpu-check: `--quick` runs the same thing small on the CPU. PYTHON,
# DDM_DEVICE_WHEELS and DDM_DEVICE_SITE override the interpreter, the wheels' folder (.whl/)
# and where they are installed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/out/gpu-check}
python=${PYTHON:-python3}
wheelhouse=${DDM_DEVICE_WHEELS:-$root/.whl}
site=${DDM_DEVICE_SITE:-/tmp/ddm-device-site}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1

shopt -s nullglob
wheels=("$wheelhouse"/*.whl)
if ((${#wheels[@]})); then
  echo "gpu-check.sh: installing ${#wheels[@]} carried wheels into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Absolute paths: ddm up's servers and the in-process child start in other directories.
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# JAX is on the device image; should anything start its CUDA backend, it must not take 75% of
# the GPU before PyTorch's servers load.
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
"$python" -m benchmarks gpu-check --out "$out" "$@"
