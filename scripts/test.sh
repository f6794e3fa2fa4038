#!/usr/bin/env bash
# The one command that sets up and runs every test (CI calls exactly this):
# installs Slurm/MPI/Python packages, brings up the 4-node Slurm testbed, lints, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/testbed.sh up
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Open MPI refuses to run as root unless told; the MPI tests run as whoever runs this.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=15 "$@"
