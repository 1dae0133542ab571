#!/usr/bin/env bash
# The device check of cupti_ext and of the project's Python side on a GPU machine (one H200,
# preinstalled torch/triton/nvidia-cuda-cupti; nothing to install, no network). cupti_ext/build/
# must be carried there prebuilt. Where that Python lacks polars or rich, the project's own
# `launch` / `record` / late attach cases need build/gpu_pydeps.tar.xz (scripts/gpu_pydeps.sh packs
# it from .venv here; carry it along): it is unpacked into a temporary folder put on PYTHONPATH for
# this run only. Without it, or on a Python the packed polars cannot load (< 3.11), those cases are
# reported as not run in the JSON (checks tables_launch / tables_late_attach false).
#   bash scripts/gpu_check.sh [--steps N] [--dry-run]   PYTHON=python3 selects the interpreter with torch
#   bash scripts/gpu_check.sh --llamacpp [--rounds N]   the llama.cpp section instead
#     (scripts/gpu_check_llamacpp.py): the CUDA llama-server of build/llamacpp-cuda-b*.tar.xz
#     (scripts/build_llamacpp_cuda.sh) recorded with the llamacpp preset against its GPU oracle,
#     and its tokens/s with and without tracing; JSON in results/gpu_check/*-llamacpp.json
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
# build/gpu_pydeps/ (the archive unpacked by an earlier call on the same machine, kept there) serves
# a call that cannot carry the archive too: the llama.cpp section carries its own package
# (docs/gpu.md: two calls under the 64 MiB a call carries)
kept=""
if [ -d build/gpu_pydeps/main ]; then kept=build/gpu_pydeps; fi
if ! "$PY" -c 'import polars, rich' 2>/dev/null && { [ -n "$kept" ] || [ -f build/gpu_pydeps.tar.xz ]; }; then
  if [ -n "$kept" ]; then
    extra="$PWD/$kept/main"; deps_root="$PWD/$kept"
  else
    deps=$(mktemp -d /tmp/sparseety-gpucheck-deps.XXXXXX)
    tar -xJf build/gpu_pydeps.tar.xz -C "$deps"
    extra="$deps/main"; deps_root="$deps"
  fi
  # numpy only where there is none: torch keeps the numpy it was built with
  if ! "$PY" -c 'import numpy' 2>/dev/null; then extra="$extra:$deps_root/numpy"; fi
  export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
  export SPARSEETY_GPU_CHECK_PYDEPS="build/gpu_pydeps.tar.xz ($(cat build/gpu_pydeps.tar.xz.versions 2>/dev/null || echo unknown versions))"
fi
rc=0
if [ "${1:-}" = --llamacpp ]; then
  shift
  timeout 540 "$PY" scripts/gpu_check_llamacpp.py "$@" || rc=$?
else
  timeout 400 "$PY" scripts/gpu_check.py "$@" || rc=$?
fi
exit "$rc"
