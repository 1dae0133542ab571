#!/usr/bin/env bash
# The device check of cupti_ext on a GPU machine (one H200, preinstalled torch/triton/nvidia-cuda-cupti;
# nothing to install, no network). cupti_ext/build/ must be carried there prebuilt.
#   bash scripts/gpu_check.sh [--steps N]      PYTHON=python3 selects the interpreter that has torch
# Prints one JSON object and keeps it in results/gpu_check/<date>-<device>.json (date, driver and
# device inside); exit 0 = all checks passed, 1 = a check failed, 2 = cannot run here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec timeout 330 "$PY" scripts/gpu_check.py "$@"
