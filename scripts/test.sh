#!/usr/bin/env bash
# The test command: set up (idempotent), then lint, type-check and run every test.
# Run as root: the eBPF tests attach to real engine processes (CI runs this as root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] mypy" >&2
.venv/bin/mypy
echo "[test] pytest" >&2
exec .venv/bin/python -m pytest "$@"
