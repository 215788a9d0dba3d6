#!/usr/bin/env bash
# The suite under torchrun's real elastic agent and c10d rendezvous, as 2 nodes x 2 ranks:
# both "hosts" are started on this machine. Exits non-zero unless every rank passes and
# rank 0 reports the merged result.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
common=(--nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d "--rdzv-endpoint=127.0.0.1:$port" --rdzv-id=ddphooks-ci)
args=(-m pytest -p no:cacheprovider ci/spmd_suite "--junitxml=$out/junit.xml")
start=$(date +%s.%N)
"$PY" -m torch.distributed.run "${common[@]}" --node-rank=1 "${args[@]}" > "$out/node1.log" 2>&1 &
node1=$!
status=0
"$PY" -m torch.distributed.run "${common[@]}" --node-rank=0 "${args[@]}" > "$out/node0.log" 2>&1 || status=$?
wait "$node1" || status=$?
end=$(date +%s.%N)
# c10d rendezvous numbers the nodes in the order they join: global rank 0 is on either one
cat "$out/node0.log" "$out/node1.log" > "$out/all.log"
grep -v '^\[W' "$out/all.log" | grep -v 'waitForInput' || true
if [ "$status" -ne 0 ]; then
    echo "two-node torchrun run FAILED (status $status)"; exit 1
fi
test "$(grep -c "3 passed, 1 deselected" "$out/all.log")" -eq 1  # rank 0 reports, the others stay quiet
grep -q "test_other_size_is_deselected: world_size=2, but torchrun launched 4 ranks" "$out/all.log"
grep -q 'tests="3"' "$out/junit.xml"
printf 'two-node torchrun run (2 x 2 ranks) passed in %.1f s\n' "$(echo "$end - $start" | bc)"
