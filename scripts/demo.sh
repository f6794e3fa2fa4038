#!/usr/bin/env bash
# The main demo: a small CPU DDP training (gloo) on 2 local "nodes" x 2 workers, once without
# faults and once with a worker crash injected at step 15. hpcelastic restarts every worker on
# every node from the last checkpoint; both runs end with the same parameters.
#
# Light on purpose: Python 3.10+ and pip only (no root, no apt, no Slurm). It installs the package with
# its torch extra into .venv (torch pinned by constraints.txt to the CPU build); the test command
# (scripts/test.sh) sets up the whole laboratory instead.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'demo: %s\n' "$*" >&2; }

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
log "installing hpcelastic with torch into .venv (torch is large: longer the first time, while pip downloads it)"
# --no-compile: byte-compiling all of torch's files took 40 % of the install here; Python compiles what it
# imports on first use instead.
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt -e '.[torch]'

he=.venv/bin/hpcelastic
out=hpcelastic-runs/demo-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"

echo "== 1/3 fault-free run"
"$he" run --nodes 2 --nproc-per-node 2 --run-dir "$out/clean" \
  examples/ddp_train.py --steps 40 --step-time 0.05 --out "$out/clean.json"

echo "== 2/3 the same training, rank 3 crashes at step 15"
"$he" run --nodes 2 --nproc-per-node 2 --run-dir "$out/crash" \
  examples/ddp_train.py --steps 40 --step-time 0.05 --crash-at-step 15 --crash-rank 3 --out "$out/crash.json"

echo "== 3/3 what happened (hpcelastic status)"
"$he" status "$out/crash"

checksum() { .venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["checksum"])' "$1"; }
clean=$(checksum "$out/clean.json")
crash=$(checksum "$out/crash.json")
echo
echo "final parameters, fault-free run: $clean"
echo "final parameters, crashed run:    $crash"
if [ "$clean" != "$crash" ]; then
  echo "DIFFERENT: please report this as a bug" >&2
  exit 1
fi
echo "identical: the crash cost a restart, not the training. Runs are in $out/"
echo
echo "Next: run the tool as $he (or 'source .venv/bin/activate', then 'hpcelastic --help');"
echo "try '$he run --nodes 2 --nproc-per-node 2 YOUR_SCRIPT.py' for any torchrun script."
