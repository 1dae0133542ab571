#!/usr/bin/env bash
# The test set-up on a Debian 12 machine (root): scripts/install.sh (what running the profiler
# needs, with the correlator compiled), then what only the tests need. Idempotent; prints each step;
# scripts/test.sh (and so CI) runs it first.
#   - Debian packages the tests use: chromium, a JRE (PySpark), prometheus, tmux, curl, systemd;
#   - the pinned test packages (scripts/requirements-dev.txt), among them llama-cpp-python built
#     from its sdist (portable: no -march=native);
#   - the build matrix (scripts/matrix-*.txt): older xllamacpp wheels, older llama-cpp-python and
#     llama-server builds, each built from source the first time (docs/setup.md says how long);
#   - the CUPTI injection library (cupti_ext/, GPU path).
#   PYTHON=python3   interpreter for the venv (>= 3.11)
#   VENV=.venv       where the venv goes
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
export VENV=${VENV:-.venv}
export DEBIAN_FRONTEND=noninteractive

SETUP_TAG=setup
# shellcheck source=scripts/setup_common.sh
source scripts/setup_common.sh
require_root scripts/setup.sh

# 1. what running needs, the correlator compiled (the tests check the compiled build)
step "1/5 scripts/install.sh"
COMPILE_CORRELATOR=1 bash scripts/install.sh
PY="$VENV/bin/python"

# 2. Debian packages only the tests use.
# chromium: the tests open `report --html` pages in it headless (tests/headless_chromium.py).
# default-jre-headless: Java for PySpark, which tests/test_dataset_engines.py uses to read a dataset.
# prometheus: the real server tests/test_metrics_prometheus.py scrapes --metrics-port with; the
# test runs the binary itself (temporary config and storage), so its service is not needed.
# tmux: the live view's tests drive it in a terminal; curl: requests as the README sends them.
# systemd: systemd-analyze verify checks packaging/systemd's unit (tests/test_privileges.py); a
# container without systemd running gets the tool only, nothing is started.
# linux-perf: `perf record`, the independent sampler tests/test_cpu_stacks_engine.py checks the
# CPU sampler against.
pkgs=(curl tmux chromium default-jre-headless prometheus systemd linux-perf)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  step "2/5 installing ${pkgs[*]}"
  had_prometheus=$(dpkg -s prometheus >/dev/null 2>&1 && echo yes || true)
  timed apt_retry update -qq
  timed apt_retry install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  # the package enables a service listening on every interface (:9090): not wanted on an engine
  # host; one the machine already ran is left as it was
  if [ -z "$had_prometheus" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
else
  step "2/5 Debian test packages present"
fi

# 3. the pinned test packages. The venv records the hash of both requirement files it was
#    installed from: a line added to (or changed in) either is installed into an existing venv too
#    (pip keeps what is satisfied).
DEV_HASH=$(cat scripts/requirements.txt scripts/requirements-dev.txt | sha256sum | cut -d' ' -f1)
LLAMA_CPP_PIN=$(sed -n 's/^llama-cpp-python==//p' scripts/requirements-dev.txt)
if ! "$PY" -c 'import llama_cpp, pytest, hypothesis, duckdb, pyspark, opentelemetry.sdk' 2>/dev/null \
   || ! "$PY" -m pip freeze 2>/dev/null | grep -qx "llama_cpp_python==$LLAMA_CPP_PIN" \
   || [ "$(cat "$VENV/.requirements-dev.sha256" 2>/dev/null)" != "$DEV_HASH" ]; then
  step "3/5 installing the pinned test packages (llama-cpp-python builds from source the first time)"
  timed "$PY" -m pip install -q --upgrade pip
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" timed "$PY" -m pip install -q -r scripts/requirements-dev.txt
  echo "$DEV_HASH" > "$VENV/.requirements-dev.sha256"
else
  step "3/5 pinned test packages present"
fi

# 4. the build matrix (tests/test_build_matrix.py): older llama.cpp builds, each xllamacpp wheel
#    unpacked into a folder of its own (put first on PYTHONPATH by the tests), a few seconds each
MATRIX=${SPARSEETY_MATRIX_DIR:-.cache/engines}
for v in $(grep -v '^#' scripts/matrix-xllamacpp.txt); do
  if [ ! -e "$MATRIX/xllamacpp-$v/.complete" ]; then
    step "4/5 xllamacpp $v for the build matrix"
    rm -rf "$MATRIX/xllamacpp-$v"
    timed "$PY" -m pip install -q --no-deps --target "$MATRIX/xllamacpp-$v" "xllamacpp==$v"
    touch "$MATRIX/xllamacpp-$v/.complete"
  fi
done
step "4/5 build matrix: $(ls -d "$MATRIX"/xllamacpp-* 2>/dev/null | wc -l) xllamacpp builds in $MATRIX"
# older llama-cpp-python releases, each built from its sdist into a folder of its own (portable, as
# the pinned one)
for v in $(grep -v '^#' scripts/matrix-llama-cpp-python.txt); do
  if [ ! -e "$MATRIX/llama-cpp-python-$v/.complete" ]; then
    step "4/5 llama-cpp-python $v for the build matrix (built from source)"
    rm -rf "$MATRIX/llama-cpp-python-$v"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" timed "$PY" -m pip install -q --no-deps \
      --no-binary llama-cpp-python --target "$MATRIX/llama-cpp-python-$v" "llama-cpp-python==$v"
    touch "$MATRIX/llama-cpp-python-$v/.complete"
  fi
done
step "4/5 build matrix: $(ls -d "$MATRIX"/llama-cpp-python-* 2>/dev/null | wc -l) older llama-cpp-python builds in $MATRIX"
# llama-server executables built from llama.cpp sources (cached under /var/cache/sparseety-prof)
grep -v '^#' scripts/matrix-llama-server.txt | while read -r build kind; do
  [ -n "$build" ] || continue
  PYTHON="$PY" bash scripts/build_llama_server.sh "$build" "$kind" >/dev/null
  step "4/5 llama-server b$build ($kind) ready"
done

# 5. the CUPTI injection library (cupti_ext/, GPU path): a few seconds with gcc. Without any CUDA 13
#    headers, try the pinned header wheels once; if there are still none, go on without it.
cupti_rc=0; VENV="$VENV" bash cupti_ext/build.sh >/dev/null || cupti_rc=$?
if [ "$cupti_rc" = 3 ] && "$PY" -m pip install -q 'nvidia-cuda-cupti==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
     'nvidia-cuda-crt==13.0.*' >/dev/null 2>&1; then
  cupti_rc=0; VENV="$VENV" bash cupti_ext/build.sh >/dev/null || cupti_rc=$?
fi
case "$cupti_rc" in
  0) step "5/5 built cupti_ext/build/libsparseety_cupti.so" ;;
  3) step "5/5 no CUDA 13 headers: the GPU library (cupti_ext) is not built; its tests will fail" ;;
  *) echo "[setup] cupti_ext/build.sh failed (exit $cupti_rc): the C compiler rejected cupti_ext/src" >&2; exit 1 ;;
esac
step "ready: $VENV/bin/sparseety-prof"
