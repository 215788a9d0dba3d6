#!/usr/bin/env bash
# 500 multirank tests (2 ranks each) under pytest-xdist -n 2: not one rendezvous may fail.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python benchmarks/bench_xdist.py --stress-only
