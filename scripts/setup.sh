#!/usr/bin/env bash
# Set up sparseety-prof from zero on a Debian 12 machine (root). Idempotent; prints each step.
#   - BCC from Debian (python3-bpfcc + libbpfcc), kernel headers and the /lib/modules links,
#     tracefs;
#   - the project in ./.venv with the engines it is tested against, pinned to exact versions:
#     llama-cpp-python (built from its sdist, portable: no -march=native) and xllamacpp, and the
#     older builds of the build matrix (scripts/matrix-*.txt).
# A fresh machine spends about 5 minutes building llama-cpp-python, and about 6 more on each older
# llama-cpp-python of the build matrix; later runs take seconds.
#   PYTHON=python3   interpreter for the venv (>= 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
export DEBIAN_FRONTEND=noninteractive

step() { echo "[setup] $*" >&2; }
timed() { local s=$SECONDS; "$@"; step "  done in $(( SECONDS - s ))s"; }

apt_retry() {  # wait out a held dpkg lock instead of failing
  local i
  for i in $(seq 1 30); do
    if apt-get -o DPkg::Lock::Timeout=60 "$@"; then return 0; fi
    step "apt-get $1 failed (lock held?), retry $i"; sleep 5
  done
  return 1
}

if [ "$(id -u)" != 0 ]; then
  echo "scripts/setup.sh installs Debian packages and mounts tracefs: run it as root (sudo)" >&2
  exit 5
fi

# 1. Debian packages. The PyPI package called "bcc" is an unrelated project: BCC comes from Debian.
# chromium: the tests open `report --html` pages in it headless (tests/headless_chromium.py).
# default-jre-headless: Java for PySpark, which tests/test_dataset_engines.py uses to read a dataset.
# prometheus: the real server tests/test_metrics_prometheus.py scrapes --metrics-port with; the
# test runs the binary itself (temporary config and storage), so its service is not needed.
pkgs=(python3-bpfcc libbpfcc linux-headers-amd64 binutils gcc libc6-dev curl tmux chromium default-jre-headless
      prometheus)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  step "1/6 installing ${pkgs[*]}"
  had_prometheus=$(dpkg -s prometheus >/dev/null 2>&1 && echo yes || true)
  timed apt_retry update -qq
  timed apt_retry install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  # the package enables a service listening on every interface (:9090): not wanted on an engine
  # host; one the machine already ran is left as it was
  if [ -z "$had_prometheus" ] && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
else
  step "1/6 Debian packages present"
fi

# 2. BCC compiles every program against a kernel header tree. This kernel ships none, so point
#    /lib/modules/$(uname -r)/{build,source} at Debian's headers (BCC_KERNEL_SOURCE alone does
#    not work with Debian's split -amd64/-common header packages).
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build/include/generated/autoconf.h" ]; then
  HDR=$(ls -d /usr/src/linux-headers-*-amd64 | grep -v -- '-rt-\|-cloud-' | sort -V | tail -1)
  mkdir -p "/lib/modules/$KREL"
  ln -sfn "$HDR" "/lib/modules/$KREL/build"
  ln -sfn "${HDR%-amd64}-common" "/lib/modules/$KREL/source"
  step "2/6 /lib/modules/$KREL/build -> $HDR"
else
  step "2/6 kernel headers linked"
fi

# 3. tracefs: not needed to attach (perf uprobe PMU), but BCC's detach path reads it.
if [ ! -e /sys/kernel/tracing/uprobe_events ]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null && step "3/6 mounted tracefs" \
    || step "3/6 could not mount tracefs (attaching still works)"
else
  step "3/6 tracefs mounted"
fi

# 4. the venv and pinned packages
if [ ! -x "$VENV/bin/python" ]; then
  step "4/6 creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# The venv records the hash of the requirements it was installed from: a line added to (or changed
# in) scripts/requirements.txt is installed into an existing venv too (pip keeps what is satisfied).
REQ_HASH=$(sha256sum scripts/requirements.txt | cut -d' ' -f1)
if ! "$PY" -c 'import llama_cpp, xllamacpp, gguf, polars, rich, pytest, hypothesis' 2>/dev/null \
   || ! "$PY" -m pip freeze 2>/dev/null | grep -qx 'llama_cpp_python==0.3.36' \
   || [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$REQ_HASH" ]; then
  step "4/6 installing pinned packages (llama-cpp-python builds from source: ~5 min on 2 cores the first time)"
  timed "$PY" -m pip install -q --upgrade pip
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" timed "$PY" -m pip install -q -r scripts/requirements.txt
  echo "$REQ_HASH" > "$VENV/.requirements.sha256"
else
  step "4/6 pinned packages present"
fi
"$PY" -m pip install -q --no-deps -e . >/dev/null 2>&1 || "$PY" -m pip install --no-deps -e .

# 4b. the build matrix (tests/test_build_matrix.py): older llama.cpp builds, each xllamacpp wheel
#     unpacked into a folder of its own (put first on PYTHONPATH by the tests), a few seconds each
MATRIX=${SPARSEETY_MATRIX_DIR:-.cache/engines}
for v in $(grep -v '^#' scripts/matrix-xllamacpp.txt); do
  if [ ! -e "$MATRIX/xllamacpp-$v/.complete" ]; then
    step "4b/6 xllamacpp $v for the build matrix"
    rm -rf "$MATRIX/xllamacpp-$v"
    timed "$PY" -m pip install -q --no-deps --target "$MATRIX/xllamacpp-$v" "xllamacpp==$v"
    touch "$MATRIX/xllamacpp-$v/.complete"
  fi
done
step "4b/6 build matrix: $(ls -d "$MATRIX"/xllamacpp-* 2>/dev/null | wc -l) xllamacpp builds in $MATRIX"
# 4b. older llama-cpp-python releases, each built from its sdist into a folder of its own (portable, as
#     the pinned one): about 6 minutes each on 2 idle cores the first time
for v in $(grep -v '^#' scripts/matrix-llama-cpp-python.txt); do
  if [ ! -e "$MATRIX/llama-cpp-python-$v/.complete" ]; then
    step "4b/6 llama-cpp-python $v for the build matrix (built from source: ~6 min on 2 cores)"
    rm -rf "$MATRIX/llama-cpp-python-$v"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF" timed "$PY" -m pip install -q --no-deps \
      --no-binary llama-cpp-python --target "$MATRIX/llama-cpp-python-$v" "llama-cpp-python==$v"
    touch "$MATRIX/llama-cpp-python-$v/.complete"
  fi
done
step "4b/6 build matrix: $(ls -d "$MATRIX"/llama-cpp-python-* 2>/dev/null | wc -l) older llama-cpp-python builds in $MATRIX"
# 4c. llama-server executables built from llama.cpp sources (cached under /var/cache/sparseety-prof)
grep -v '^#' scripts/matrix-llama-server.txt | while read -r build kind; do
  [ -n "$build" ] || continue
  PYTHON="$PY" bash scripts/build_llama_server.sh "$build" "$kind" >/dev/null
  step "4c/6 llama-server b$build ($kind) ready"
done

# 5. make Debian's pure-Python bcc importable from the venv: link ONLY that package (putting all of
#    /usr/lib/python3/dist-packages on the path would shadow the venv's packages).
PURELIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$PURELIB/bcc" ]; then
  ln -sfn /usr/lib/python3/dist-packages/bcc "$PURELIB/bcc"
  step "5/6 linked $PURELIB/bcc"
else
  step "5/6 bcc linked into the venv"
fi

# 5b. the CUPTI injection library (cupti_ext/, GPU path): a few seconds with gcc. Without any CUDA 13
#     headers, try the pinned header wheels once; if there are still none, go on without it.
cupti_rc=0; VENV="$VENV" bash cupti_ext/build.sh >/dev/null || cupti_rc=$?
if [ "$cupti_rc" = 3 ] && "$PY" -m pip install -q 'nvidia-cuda-cupti==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
     'nvidia-cuda-crt==13.0.*' >/dev/null 2>&1; then
  cupti_rc=0; VENV="$VENV" bash cupti_ext/build.sh >/dev/null || cupti_rc=$?
fi
case "$cupti_rc" in
  0) step "5b/6 built cupti_ext/build/libsparseety_cupti.so" ;;
  3) step "5b/6 no CUDA 13 headers: the GPU library (cupti_ext) is not built; its tests will fail" ;;
  *) echo "[setup] cupti_ext/build.sh failed (exit $cupti_rc): the C compiler rejected cupti_ext/src" >&2; exit 1 ;;
esac

# 5c. the consumer's C parts (sparseety_prof/native): the per-token logits statistics and the ring
#     buffer walk, a second with gcc. Without them the profiler still works, on numpy and Python at
#     several times the CPU per token, so a failure is fatal.
if ! bash sparseety_prof/native/build.sh >/dev/null; then
  echo "[setup] sparseety_prof/native/build.sh failed: the C compiler rejected sparseety_prof/native/*.c" >&2
  exit 1
fi
step "5c/6 built sparseety_prof/native/build/librowstats.so, libringwalk.so and libringwatch.so"

# 5d. the correlator compiled by mypyc (about a minute; nothing when its sources are unchanged):
#     the consumer's per-token Python calls run without the interpreter. A checkout edited since
#     runs the Python source until this runs again (sparseety_prof/correlate/build_stamp.py).
if ! "$PY" sparseety_prof/native/compile_correlator.py sparseety_prof/native/build/compiled --require; then
  echo "[setup] compiling the correlator with mypyc failed (above)" >&2
  exit 1
fi
step "5d/6 the correlator compiled (sparseety_prof/native/build/compiled)"

# 6. smoke test: compile, load and hit a uprobe
"$PY" - <<'PYEOF'
import ctypes, os
from bcc import BPF
b = BPF(text=r"""
BPF_ARRAY(c, u64, 1);
int hit(struct pt_regs *ctx) { int k = 0; u64 *v = c.lookup(&k); if (v) __sync_fetch_and_add(v, 1); return 0; }
""")
b.attach_uprobe(name="c", sym="getpid", fn_name="hit", pid=os.getpid())
libc = ctypes.CDLL("libc.so.6")
for _ in range(10):
    libc.getpid()
n = b["c"][ctypes.c_int(0)].value
b.cleanup()
assert n >= 10, f"uprobe smoke test saw {n} hits"
print(f"[setup] 6/6 BPF smoke test passed (uprobe hits={n})", flush=True)
PYEOF
step "ready: $VENV/bin/sparseety-prof"
