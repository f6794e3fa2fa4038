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
# Three workers (pytest-xdist): the tests of the default testbed instance run in turn on one of them, each
# other instance's tests on one worker, other modules wherever a worker is free; the longest groups first,
# in the order tests/conftest.py gives (pytest-xdist would otherwise order them by their number of tests).
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=60 -n "${TEST_WORKERS:-3}" --dist loadgroup \
    --no-loadscope-reorder "$@"
