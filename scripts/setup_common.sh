# Shell helpers shared by scripts/install.sh and scripts/setup.sh (sourced, not run). The caller
# sets SETUP_TAG (the prefix of its step lines) before sourcing it.

step() { echo "[$SETUP_TAG] $*" >&2; }
timed() { local s=$SECONDS; "$@"; step "  done in $(( SECONDS - s ))s"; }

apt_retry() {  # wait out a held dpkg lock instead of failing
  local i
  for i in $(seq 1 30); do
    if apt-get -o DPkg::Lock::Timeout=60 "$@"; then return 0; fi
    step "apt-get $1 failed (lock held?), retry $i"; sleep 5
  done
  return 1
}

require_root() {  # $1: the script's path, as the user runs it
  if [ "$(id -u)" != 0 ]; then
    # 5: missing privileges, as the profiler's own exit code for it
    echo "$1 installs Debian packages and mounts tracefs: run it as root" \
         "(from a user account: sudo bash $1)" >&2
    exit 5
  fi
}
