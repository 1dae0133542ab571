#!/usr/bin/env bash
# Install what running sparseety-prof needs on a Debian 12 machine (root), and one engine for the
# demo. Idempotent; prints each step; a later run takes seconds.
#   - BCC from Debian (python3-bpfcc + libbpfcc), gcc, the kernel headers and the /lib/modules
#     links BCC compiles against, tracefs;
#   - the package in $VENV with its runtime dependencies, pinned (scripts/requirements.txt), and
#     xllamacpp, a llama-server in a prebuilt wheel: the engine scripts/demo.py profiles;
#   - the C helpers of the consumer (sparseety_prof/native) and, where mypyc is at hand or
#     COMPILE_CORRELATOR=1, the correlator compiled by mypyc (the package runs its Python source
#     otherwise).
# The test set-up (scripts/setup.sh) runs this first, then adds what only the tests need.
#   PYTHON=python3        interpreter for the venv (>= 3.11)
#   VENV=.venv            where the venv goes
#   COMPILE_CORRELATOR=   1: install mypy (the pinned one) and compile the correlator;
#                         0: never; unset: compile when the venv already has mypyc
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
COMPILE_CORRELATOR=${COMPILE_CORRELATOR:-}
export DEBIAN_FRONTEND=noninteractive

SETUP_TAG=install
# shellcheck source=scripts/setup_common.sh
source scripts/setup_common.sh
require_root scripts/install.sh

# 1. Debian packages. The PyPI package called "bcc" is an unrelated project: BCC comes from Debian.
# binutils: nm reads the engine's symbols; gcc, libc6-dev: BCC's programs and the C helpers;
# python3-venv: `python3 -m venv` on Debian's own python3.
pkgs=(python3-bpfcc libbpfcc linux-headers-amd64 binutils gcc libc6-dev python3-venv)
if ! dpkg -s "${pkgs[@]}" >/dev/null 2>&1; then
  step "1/7 installing ${pkgs[*]}"
  timed apt_retry update -qq
  timed apt_retry install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
else
  step "1/7 Debian packages present"
fi

# 2. BCC compiles every program against a kernel header tree. A kernel that ships none gets
#    /lib/modules/$(uname -r)/{build,source} pointed at Debian's headers (BCC_KERNEL_SOURCE alone
#    does not work with Debian's split -amd64/-common header packages).
KREL=$(uname -r)
if [ ! -e "/lib/modules/$KREL/build/include/generated/autoconf.h" ]; then
  HDR=$(ls -d /usr/src/linux-headers-*-amd64 | grep -v -- '-rt-\|-cloud-' | sort -V | tail -1)
  mkdir -p "/lib/modules/$KREL"
  ln -sfn "$HDR" "/lib/modules/$KREL/build"
  ln -sfn "${HDR%-amd64}-common" "/lib/modules/$KREL/source"
  step "2/7 /lib/modules/$KREL/build -> $HDR"
else
  step "2/7 kernel headers linked"
fi

# 3. tracefs: not needed to attach (perf uprobe PMU), but BCC's detach path reads it.
if [ ! -e /sys/kernel/tracing/uprobe_events ]; then
  mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null && step "3/7 mounted tracefs" \
    || step "3/7 could not mount tracefs (attaching still works)"
else
  step "3/7 tracefs mounted"
fi

# 4. the venv, the runtime packages (pinned) and the package itself (editable: the checkout is it).
#    The venv records the hash of the requirements it was installed from: a line added to (or
#    changed in) scripts/requirements.txt is installed into an existing venv too.
if [ ! -x "$VENV/bin/python" ]; then
  step "4/7 creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
REQ_HASH=$(sha256sum scripts/requirements.txt | cut -d' ' -f1)
if ! "$PY" -c 'import xllamacpp, gguf, numpy, polars, rich, prometheus_client' 2>/dev/null \
   || [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$REQ_HASH" ]; then
  step "4/7 installing the pinned runtime packages of scripts/requirements.txt (wheels)"
  # --only-binary: none of them may fall back to a source build here
  timed "$PY" -m pip install -q --only-binary :all: -r scripts/requirements.txt
  echo "$REQ_HASH" > "$VENV/.requirements.sha256"
else
  step "4/7 pinned runtime packages present"
fi
# again when pyproject.toml or setup.py changed, or the venv's package is another checkout's
# (-P: not the checkout in the current directory, which Python would find without any install)
PKG_HASH=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ "$("$PY" -P -c 'import importlib.util as u; print(u.find_spec("sparseety_prof").origin)' 2>/dev/null)" != "$PWD/sparseety_prof/__init__.py" ] \
   || [ "$(cat "$VENV/.package.sha256" 2>/dev/null)" != "$PKG_HASH" ]; then
  step "4/7 installing the package (editable: this checkout)"
  timed "$PY" -m pip install -q --no-deps -e .
  echo "$PKG_HASH" > "$VENV/.package.sha256"
else
  step "4/7 package installed (editable: this checkout)"
fi

# 5. make Debian's pure-Python bcc importable from the venv: link ONLY that package (putting all of
#    /usr/lib/python3/dist-packages on the path would shadow the venv's packages).
PURELIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$PURELIB/bcc" ]; then
  ln -sfn /usr/lib/python3/dist-packages/bcc "$PURELIB/bcc"
  step "5/7 linked $PURELIB/bcc"
else
  step "5/7 bcc linked into the venv"
fi

# 6. the consumer's C parts (sparseety_prof/native): the per-token logits statistics and the ring
#    buffer walk, a second with gcc. Without them the profiler still works, on numpy and Python at
#    several times the CPU per token, so a failure is fatal.
if ! bash sparseety_prof/native/build.sh >/dev/null; then
  echo "[install] sparseety_prof/native/build.sh failed: the C compiler rejected sparseety_prof/native/*.c" >&2
  exit 1
fi
step "6/7 built sparseety_prof/native/build/librowstats.so, libringwalk.so and libringwatch.so"

# 6b. the correlator compiled by mypyc: the consumer's per-token Python calls run without the
#     interpreter (nothing when its sources are unchanged). Optional: it needs mypy and takes a
#     while the first time (docs/setup.md), and the package runs the Python source without it.
MYPY_PIN=$(grep -m1 '^mypy==' scripts/requirements-dev.txt || true)
if [ "$COMPILE_CORRELATOR" = 1 ] && ! "$PY" -c 'import mypyc' 2>/dev/null; then
  step "6b/7 installing ${MYPY_PIN:-mypy} for mypyc"
  timed "$PY" -m pip install -q "${MYPY_PIN:-mypy}"
fi
if [ "$COMPILE_CORRELATOR" != 0 ] && "$PY" -c 'import mypyc' 2>/dev/null; then
  step "6b/7 compiling the correlator with mypyc (nothing to do when it is up to date)"
  # asked for (COMPILE_CORRELATOR=1), a failure is fatal; otherwise it says why and goes on
  require=(); [ "$COMPILE_CORRELATOR" = 1 ] && require=(--require)
  if ! timed "$PY" sparseety_prof/native/compile_correlator.py sparseety_prof/native/build/compiled "${require[@]}"; then
    echo "[install] compiling the correlator with mypyc failed (above)" >&2
    exit 1
  fi
else
  step "6b/7 the correlator runs as Python (COMPILE_CORRELATOR=1 compiles it)"
fi

# 7. smoke test: compile, load and hit a uprobe
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
print(f"[install] 7/7 BPF smoke test passed (uprobe hits={n})", flush=True)
PYEOF
step "ready: $VENV/bin/sparseety-prof"
