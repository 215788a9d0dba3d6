#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs pytest on tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
.venv/bin/python -m ruff check pytest_ddphooks reference_trainer tests benchmarks examples
.venv/bin/python -m mypy  # the package ships py.typed: its types are checked ([tool.mypy] in pyproject.toml)
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
# "no tests collected" (5) is not a failure of the suite
if [ "$status" -eq 5 ]; then status=0; fi
if [ "$status" -ne 0 ]; then exit "$status"; fi
# scale-out runs: the suite under torchrun as 2 nodes x 2 ranks, and an xdist stress run
bash ci/torchrun_two_nodes.sh
bash ci/xdist_stress.sh
