#!/usr/bin/env bash
# Create (or reuse) the repository's .venv with the package, its test extras and the
# CPU build of torch pinned in ci/constraints.txt. Safe to run again: it only installs
# when pyproject.toml or the constraints changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.ddphooks-installed
want="$(cat pyproject.toml ci/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e ".[test]"
    echo "$want" > "$stamp"
fi
# the HTML report is tested in a real browser: Debian's chromium, when it can be installed
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    if ! apt-get install -y -qq chromium >/dev/null 2>&1; then
        apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1 \
            || echo "ci/setup.sh: chromium could not be installed; the browser tests will be skipped"
    fi
fi
