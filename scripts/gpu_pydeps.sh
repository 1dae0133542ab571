#!/usr/bin/env bash
# Pack the project's pure-Python and abi3 dependencies from .venv into build/gpu_pydeps.tar.xz, for
# a GPU machine whose Python has torch but not polars/rich and no network (scripts/gpu_check.sh
# unpacks it there; the device `run` tool carries it with `carry: ["build/gpu_pydeps.tar.xz"]`).
# Layout: main/ (polars, rich and the other pure-Python or abi3 packages) and numpy/ (used only
# where the machine's Python has no numpy of its own, so torch keeps the numpy it was built with).
# polars' runtime is an abi3 wheel (cp311-abi3): it loads on CPython >= 3.11 only, numpy's build on
# 3.11 only; elsewhere gpu_check says the Python tables were not run.
# 46 MB; packing took ~4 minutes on 2 shared cores (xz). Rebuilt only when .venv's versions change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=build/gpu_pydeps.tar.xz
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PKGS=(polars _polars_runtime_32 rich pygments markdown_it mdurl gguf prometheus_client yaml)
have=()
for p in "${PKGS[@]}"; do [ -e "$SP/$p" ] && have+=("$p"); done
have+=($(cd "$SP" && ls -d polars-*.dist-info polars_runtime_32-*.dist-info rich-*.dist-info 2>/dev/null))
numpy=($(cd "$SP" && ls -d numpy numpy.libs numpy-*.dist-info 2>/dev/null))
stamp=$(cd "$SP" && ls -d "${have[@]}" "${numpy[@]}" | grep dist-info | sort | tr '\n' ' ')
if [ -f "$OUT" ] && [ "$(cat "$OUT.versions" 2>/dev/null)" = "$stamp" ]; then
  echo "$OUT is up to date ($stamp)"; exit 0
fi
mkdir -p build
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/main" "$stage/numpy"
(cd "$SP" && cp -a "${have[@]}" "$stage/main/" && cp -a "${numpy[@]}" "$stage/numpy/")
tar -C "$stage" --exclude=__pycache__ -cf - main numpy | xz -T0 -6 > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "$stamp" > "$OUT.versions"
ls -l "$OUT"
