#!/usr/bin/env bash
# Every benchmark in sequence (full sizes unless arguments such as --quick are given, which are
# passed to each script), then benchmarks/results/ALL.md: the result pages concatenated.
# Run it on a quiet machine: other load on the cores skews every figure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BENCHES=(bench_multirank bench_heavy_ranks bench_watchdog bench_leaks bench_special bench_xdist bench_recorder bench_faults bench_explore bench_tools)
started=$SECONDS
for name in "${BENCHES[@]}"; do
    echo "=== $name $* ===" >&2
    t=$SECONDS
    "$PY" "benchmarks/$name.py" "$@" >/dev/null
    echo "=== $name: $((SECONDS - t)) s ===" >&2
done
out=benchmarks/results/ALL.md
{
    echo "# pytest-ddphooks benchmarks"
    echo
    echo "Produced by \`bash benchmarks/run_all.sh${*:+ $*}\` in $((SECONDS - started)) s."
    echo
    for name in "${BENCHES[@]}"; do
        cat "benchmarks/results/$name.md"
        echo
    done
} >"$out"
echo "wrote $out ($((SECONDS - started)) s)" >&2
