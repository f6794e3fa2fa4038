#!/usr/bin/env bash
# Installs everything hpcelastic's tests and demo need on a fresh Debian machine (as root):
# Slurm + munge + Open MPI from Debian, then a virtual environment .venv with the package,
# its extras and the test tools. Torch is pinned by constraints.txt to the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

# prometheus: the metrics test scrapes a running job with a Prometheus server of its own (on loopback).
# debootstrap: the Slurm 24.11 root; podman and runc: the container tests (scripts/testbed.sh).
apt_packages=(slurm-wlm munge openmpi-bin libopenmpi-dev chromium nftables iptables prometheus debootstrap podman runc)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages (${missing[*]}): run this script as root"
    exit 2
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" prometheus "* ]]; then
    # The package starts a system-wide server where an init system lets it; the tests start their own.
    invoke-rc.d prometheus stop >/dev/null 2>&1 || true
  fi
fi

# The second Slurm (24.11, a Debian trixie root) and the container tests' image and OCI bundle: built
# once, then reused (each checks its own mark; about 1.5 minutes the first time).
if [ "$(id -u)" = 0 ]; then
  TESTBED_SLURM=24.11 bash scripts/testbed.sh install-root
  bash scripts/testbed.sh image
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
log "installing hpcelastic and its extras into .venv (torch pinned by constraints.txt)"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[all,test]'
log "ready: $(.venv/bin/python -c 'import torch, hpcelastic; print("hpcelastic", hpcelastic.__version__, "torch", torch.__version__)')"
