"""Process states as the fork server reads them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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


HAS_CHILDREN = """
import os, subprocess, sys
from pytest_ddphooks.launch import procs

seen = [procs.has_children()]
child = subprocess.Popen([sys.executable, "-c", "pass"])
seen.append(procs.has_children())
while procs.state_of(child.pid) not in ("Z", None):
    os.sched_yield()
seen.append(procs.has_children())  # ended, not reaped: still a child, and left unreaped
seen.append(child.wait() == 0)
seen.append(procs.has_children())
print(seen)
"""


def test_has_children_counts_an_ended_child_until_it_is_reaped_and_reaps_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", HAS_CHILDREN], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[False, True, True, True, False]"
