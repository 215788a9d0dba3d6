#!/usr/bin/env bash
# The demo: the reference trainer fits on 2 real gloo ranks, then prints the swimlanes of
# its hook lifecycle and writes a Chrome trace; then the plugin runs the example ordering
# tests against it, including one seeded bug it must catch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
.venv/bin/python -m reference_trainer --strategy ddp --world-size 2 --trace traces/demo-ddp.json
.venv/bin/python -m pytest -p no:cacheprovider -v examples/
