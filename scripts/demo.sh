#!/usr/bin/env bash
# The main job on the built-in default: set up (idempotent), generate a model, start a real
# engine, attach the profiler, send prompts, show the recording. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
