#!/usr/bin/env bash
# The main demo: a small CPU DDP training (gloo) on 2 local "nodes" x 2 workers, once without
# faults and once with a worker crash injected at step 15. hpcelastic restarts every worker on
# every node from the last checkpoint; both runs end with the same parameters.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
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

clean=$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["checksum"])' "$out/clean.json")
crash=$(.venv/bin/python -c 'import json,sys; print(json.load(open(sys.argv[1]))["checksum"])' "$out/crash.json")
echo
echo "final parameters, fault-free run: $clean"
echo "final parameters, crashed run:    $crash"
if [ "$clean" = "$crash" ]; then
  echo "identical: the crash cost a restart, not the training. Runs are in $out/"
else
  echo "DIFFERENT: please report this as a bug" >&2
  exit 1
fi
