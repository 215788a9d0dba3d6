"""Process states as the fork server reads them."""

from __future__ import annotations

import os
import signal
import subprocess

from pytest_ddphooks.launch import procs


def test_a_process_is_ending_once_killed_and_until_reaped() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert not procs.is_ending(child.pid)
        assert not procs.is_ending(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        # from the kill on, whether still exiting or already a zombie: it runs nothing more
        assert procs.is_ending(child.pid)
    finally:
        child.kill()
        child.wait()
    assert procs.is_ending(child.pid)  # reaped: gone
