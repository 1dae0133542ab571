#!/usr/bin/env bash
# The device check of cupti_ext and of the project's Python side on a GPU machine (one H200,
# preinstalled torch/triton/nvidia-cuda-cupti; nothing to install, no network). cupti_ext/build/
# must be carried there prebuilt. Where that Python lacks polars or rich, the project's own
# `launch` / `record` / late attach cases need build/gpu_pydeps.tar.xz (scripts/gpu_pydeps.sh packs
# it from .venv here; carry it along): it is unpacked into a temporary folder put on PYTHONPATH for
# this run only. Without it, or on a Python the packed polars cannot load (< 3.11), those cases are
# reported as not run in the JSON (checks tables_launch / tables_late_attach false).
#   bash scripts/gpu_check.sh [--steps N] [--dry-run]   PYTHON=python3 selects the interpreter with torch
# Prints one JSON object and keeps it in results/gpu_check/<date>-<device>.json (date, driver and
# device inside); exit 0 = all checks passed, 1 = a check failed, 2 = cannot run here.
# Time on an H200 (estimates): CUDA C++ kernel build ~60 s, warm-up + 15 eager runs of 1000 steps
# ~100 s, graph replays ~15 s, the two Python-tables cases ~25 s each, unpacking deps ~6 s (measured on 2 CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
deps=""
cleanup() { if [ -n "$deps" ]; then rm -rf "$deps"; fi; }
trap cleanup EXIT
if ! "$PY" -c 'import polars, rich' 2>/dev/null && [ -f build/gpu_pydeps.tar.xz ]; then
  deps=$(mktemp -d /tmp/sparseety-gpucheck-deps.XXXXXX)
  tar -xJf build/gpu_pydeps.tar.xz -C "$deps"
  extra="$deps/main"
  # numpy only where there is none: torch keeps the numpy it was built with
  if ! "$PY" -c 'import numpy' 2>/dev/null; then extra="$extra:$deps/numpy"; fi
  export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
  export SPARSEETY_GPU_CHECK_PYDEPS="build/gpu_pydeps.tar.xz ($(cat build/gpu_pydeps.tar.xz.versions 2>/dev/null || echo unknown versions))"
fi
rc=0
timeout 400 "$PY" scripts/gpu_check.py "$@" || rc=$?
exit "$rc"
