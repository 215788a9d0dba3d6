"""The harness's own work is left out of a measurement without disturbing the rest of it: code
run while the tracer is paused counts nothing, code before and after counts as usual, lines
and branches alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("coverage")

MODULE = """def before(x):
    if x:
        return "before"
    return "never"


def harness():
    return "harness"


def after(x):
    if x:
        return "after"
    return "never"


def caller():
    return before(1) + after(1)
"""

SCRIPT = """
import json, sys
import coverage
from pytest_ddphooks import coverage_relay

cov = coverage.Coverage(data_file=None, branch={branch}, include=["*mod.py"])
cov.start()
import mod

def measured_around_harness():
    mod.before(1)
    with coverage_relay.HarnessWork():
        mod.harness()
        with coverage_relay.HarnessWork():  # nested: a no-op
            mod.harness()
    mod.after(1)
    return mod.caller()

measured_around_harness()
cov.stop()
data = cov.get_data()
[path] = [p for p in data.measured_files() if p.endswith("mod.py")]
print(json.dumps(sorted(data.lines(path))))
"""


@pytest.mark.parametrize("branch", [False, True])
def test_paused_code_counts_nothing_and_the_rest_counts_as_usual(tmp_path: Path, branch: bool) -> None:
    (tmp_path / "mod.py").write_text(MODULE)
    (tmp_path / "run.py").write_text(SCRIPT.format(branch=branch))
    done = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    # the def lines (1, 7, 11, 17) ran at import; harness()'s body (8) only while paused; the
    # "never" returns (4, 14) never ran
    assert lines == [1, 2, 3, 7, 11, 12, 13, 17, 18], lines


def test_without_a_measurement_it_does_nothing() -> None:
    from pytest_ddphooks import coverage_relay

    before = sys.gettrace()
    with coverage_relay.HarnessWork():
        assert sys.gettrace() is before
    assert sys.gettrace() is before
