#!/usr/bin/env bash
# The main job on the built-in default: install what running needs (scripts/install.sh,
# idempotent), generate a model, start a real engine (xllamacpp's llama-server), attach the
# profiler, send prompts, show the recording. Run as root.
#   VENV=.venv   the venv scripts/install.sh installs into
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${VENV:-.venv}/bin/python" scripts/demo.py "$@"
