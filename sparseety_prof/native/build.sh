#!/usr/bin/env bash
# Build librowstats.so, the C backend of sparseety_prof/logits.py's row_stats, libringwalk.so,
# the ring-buffer walk of sparseety_prof/bpf_loader.py's RingReader, and libringwatch.so, the ring
# watch's thread without the GIL (session/ring_watch.py) (about a second each).
#   bash sparseety_prof/native/build.sh [OUTDIR]      (default: sparseety_prof/native/build)
# Portable: no -march=native; rowstats.c compiles its kernel for x86-64-v4, -v3 and baseline itself
# (target pragmas) and picks one by CPU at run time. No -ffast-math: -inf logits must stay -inf.
# Without the library, logits.py falls back to numpy (logits.BACKEND says which is in use).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/build}
CC=${CC:-gcc}

mkdir -p "$OUT"
"$CC" -std=gnu11 -O2 -g -fPIC -Wall -Wextra -Werror -Wno-psabi -fvisibility=hidden -shared \
  -Wl,--no-undefined -Wl,-soname,librowstats.so \
  -o "$OUT/librowstats.so.tmp" "$HERE/rowstats.c" -lm
# -Wno-psabi: 64-byte vectors only pass between always_inline helpers, never across an ABI.
# rename into place: a process that has the old library loaded keeps its copy intact
mv -f "$OUT/librowstats.so.tmp" "$OUT/librowstats.so"
"$CC" -std=gnu11 -O2 -g -fPIC -Wall -Wextra -Werror -fvisibility=hidden -shared \
  -Wl,--no-undefined -Wl,-soname,libringwalk.so \
  -o "$OUT/libringwalk.so.tmp" "$HERE/ringwalk.c"
mv -f "$OUT/libringwalk.so.tmp" "$OUT/libringwalk.so"
"$CC" -std=gnu11 -O2 -g -fPIC -pthread -Wall -Wextra -Werror -fvisibility=hidden -shared \
  -Wl,--no-undefined -Wl,-soname,libringwatch.so \
  -o "$OUT/libringwatch.so.tmp" "$HERE/ringwatch.c"
mv -f "$OUT/libringwatch.so.tmp" "$OUT/libringwatch.so"
echo "$OUT/librowstats.so"
echo "$OUT/libringwalk.so"
echo "$OUT/libringwatch.so"
