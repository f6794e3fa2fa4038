#!/usr/bin/env bash
# The GPU check, one command on a machine with one GPU (a few minutes): the GPU tests (tests/gpu), then
# bench/gpu_check.py, which writes its figures to bench/RESULTS.md. Run from the repository root:
#
#     bash scripts/gpu_check.sh
#
# Needs a Python with torch built for CUDA and hpcelastic's requirements (the checkout's .venv when it has
# them, else python3). Where no CUDA device exists the tests skip with their reason and the bench section
# says which figures wait for a GPU; the script still exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
fi
missing=$("$PY" - <<'EOF'
import importlib.util, os, shutil, sys
need = ["torch", "numpy", "click", "psutil", "jinja2", "yaml", "hostlist", "inotify_simple",
        "prometheus_client", "pynvml", "pytest"]
lacks = [m for m in need if importlib.util.find_spec(m) is None]
bindir = os.path.dirname(sys.executable)
if not (shutil.which("py-spy") or os.access(os.path.join(bindir, "py-spy"), os.X_OK)):
    lacks.append("py-spy")
print(" ".join(lacks))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: $PY lacks: $missing (pip install torch and '.[gpu,hangs]' first)" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF'
import torch
if torch.cuda.is_available():
    print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
else:
    print(f"gpu_check: torch {torch.__version__} sees no CUDA device: the GPU tests will skip")
EOF
start=$(date +%s)
timeout 300 "$PY" -m pytest -p no:cacheprovider -m gpu -v -rs tests/gpu
timeout 300 "$PY" bench/gpu_check.py --runs 3
echo "gpu_check: done in $(( $(date +%s) - start )) s; figures in bench/RESULTS.md (section gpu_check)"
