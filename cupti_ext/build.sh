#!/usr/bin/env bash
# Build libsparseety_cupti.so and its test artefacts (stub libcupti, stub libcuda, test driver).
#   bash cupti_ext/build.sh [OUTDIR]        (default: cupti_ext/build)
# Needs a C compiler and the CUDA 13 headers (cuda.h, cupti*.h, generated_cuda*_meta.h): from
# $CUDA_INCLUDE, $CUDA_HOME/include (default /usr/local/cuda), or the pip wheels nvidia-cuda-cupti +
# nvidia-cuda-runtime + nvidia-cuda-crt
# (same 13.x minor) in $VENV (default .venv). Nothing is linked against libcupti or libcuda: the
# library dlopens both at run time (see README.md). Exit 3 when no headers are found.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/build}
CC=${CC:-cc}
VENV=${VENV:-$HERE/../.venv}

have_headers() { [ -f "$1/cuda.h" ] && [ -f "$1/cupti.h" ] && [ -f "$1/generated_cuda_meta.h" ]; }

INC=()
if [ -n "${CUDA_INCLUDE:-}" ] && have_headers "$CUDA_INCLUDE"; then
  INC=(-I"$CUDA_INCLUDE")
elif have_headers "${CUDA_HOME:-/usr/local/cuda}/include"; then
  INC=(-I"${CUDA_HOME:-/usr/local/cuda}/include")
elif [ -x "$VENV/bin/python" ]; then
  # Wheels put headers under site-packages/nvidia/<pkg>/include (cu13: nvidia/cu13/include).
  mapfile -t dirs < <("$VENV/bin/python" - <<'PY'
import pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["purelib"]) / "nvidia"
for h in ("cuda.h", "cupti.h", "generated_cuda_meta.h"):
    for p in sorted(root.glob(f"*/include/{h}")) + sorted(root.glob(f"*/*/include/{h}")):
        print(p.parent)
        break
PY
)
  if [ "${#dirs[@]}" -eq 3 ]; then
    for d in $(printf '%s\n' "${dirs[@]}" | sort -u); do INC+=(-I"$d"); done
  fi
fi
if [ "${#INC[@]}" -eq 0 ]; then
  echo "cupti_ext/build.sh: CUDA 13 headers not found (cuda.h, cupti.h, generated_cuda_meta.h): set" \
       "CUDA_INCLUDE, install the CUDA toolkit at /usr/local/cuda, or" \
       "pip install 'nvidia-cuda-cupti==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' into $VENV" >&2
  exit 3
fi

mkdir -p "$OUT"
CFLAGS=(-std=gnu11 -O2 -g -fPIC -Wall -Wextra -Werror -pthread "${INC[@]}")
SRC=("$HERE"/src/ring.c "$HERE"/src/watch.c "$HERE"/src/staging.c "$HERE"/src/graph.c "$HERE"/src/inject.c)
T="$HERE/tests"

# The injection library: everything hidden except InitializeInjection; no undefined symbols.
"$CC" "${CFLAGS[@]}" -fvisibility=hidden -shared -Wl,--no-undefined -Wl,-soname,libsparseety_cupti.so \
  -o "$OUT/libsparseety_cupti.so.tmp" "${SRC[@]}" -ldl -lrt
mv -f "$OUT/libsparseety_cupti.so.tmp" "$OUT/libsparseety_cupti.so"

# Test artefacts: stubs and the driver that plays the CUDA driver.
"$CC" "${CFLAGS[@]}" -fvisibility=hidden -shared -Wl,-soname,libcupti_stub.so \
  -o "$OUT/libcupti_stub.so" "$T/cupti_stub.c"
"$CC" "${CFLAGS[@]}" -fvisibility=hidden -shared -Wl,-soname,libcuda_stub.so \
  -o "$OUT/libcuda_stub.so" "$T/cuda_stub.c" -L"$OUT" -lcupti_stub -Wl,-rpath,'$ORIGIN'
"$CC" "${CFLAGS[@]}" -o "$OUT/driver" "$T/driver.c" -L"$OUT" -lcuda_stub -lcupti_stub \
  -Wl,-rpath,'$ORIGIN' -ldl
# A running "CUDA process" for late attach: dlopens a stub libcuda, launches, prints checksums.
"$CC" "${CFLAGS[@]}" -o "$OUT/late_target" "$T/late_target.c" -ldl

exported=$(nm -D --defined-only "$OUT/libsparseety_cupti.so" | awk '$2 ~ /^[TtWw]$/ {print $3}' | sort | tr '\n' ' ')
if [ "$exported" != "InitializeInjection SparseetyLateAttach " ]; then
  echo "cupti_ext/build.sh: libsparseety_cupti.so must export InitializeInjection and SparseetyLateAttach only: $exported" >&2
  exit 1
fi
# Watched copies never wait for the device. The library reaches libcuda only through names it
# dlsym's, so it cannot call a synchronising entry point (cuStreamSynchronize, cuCtxSynchronize,
# cuEventSynchronize, cudaDeviceSynchronize, ...) whose name is not in the binary.
# (The strings are in .rodata; debug info also names the CUPTI callback ids, which is not a call.)
objcopy -O binary --only-section=.rodata "$OUT/libsparseety_cupti.so" "$OUT/rodata.tmp"
if grep -a -q 'Synchronize' "$OUT/rodata.tmp" || ! grep -a -q 'cuMemcpyDtoHAsync_v2' "$OUT/rodata.tmp"; then
  rm -f "$OUT/rodata.tmp"
  echo "cupti_ext/build.sh: libsparseety_cupti.so names a Synchronize entry point: it must never wait for the device" >&2
  exit 1
fi
rm -f "$OUT/rodata.tmp"
echo "$OUT/libsparseety_cupti.so"
