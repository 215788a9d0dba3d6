#!/usr/bin/env bash
# The demo: the plugin at work on the reference trainer.
#  1. the trainer fits on 2 gloo ranks it launches itself, then prints the swimlanes of its
#     hook lifecycle across the ranks and writes a Chrome trace (traces/demo-ddp.json);
#  2. the example ordering tests (examples/, the file a user copies) on real ranks;
#  3. the ordering suite against a seeded bug: the report that catches it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
echo "== 1. python -m reference_trainer --strategy ddp --world-size 2"
.venv/bin/python -m reference_trainer --strategy ddp --world-size 2 --trace traces/demo-ddp.json
echo
echo "== 2. pytest examples/"
.venv/bin/python -m pytest -p no:cacheprovider -v examples/
echo
echo "== 3. the ordering suite with the barrier after setup removed (this failure is the point)"
set +e
REFERENCE_TRAINER_BUGS=no_barrier_after_setup .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/ordering/test_lifecycle.py -k "test_launched_ranks and external-ws2-nodes1-once" --tb=short
status=$?
set -e
if [ "$status" -ne 1 ]; then
    echo "the seeded bug was NOT caught (pytest exit $status)"; exit 1
fi
echo
echo "demo done: the seeded bug was caught; traces/demo-ddp.json opens in https://ui.perfetto.dev"
