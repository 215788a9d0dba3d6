"""The example tests a user copies (examples/) pass as the README tells them to run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_examples_pass_as_a_user_runs_them() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "examples/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "attempt 1: rank 0 passed; rank 1 passed" in out, out
    assert "passed under all 10 schedules explored" in out, out
