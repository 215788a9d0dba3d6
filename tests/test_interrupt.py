"""Ctrl-C during a multirank test: the session ends as pytest ends it, the summary says where
each rank was, and no rank outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

BOTH_RANKS_INSIDE = """
import os
import sys
import threading
import time
import pytest
import torch.distributed as dist

def say_once_inside(rank, function):
    # a file written once the main thread is inside ``function`` (its frame is on the stack)
    main = threading.main_thread().ident
    def look():
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code.co_name != function:
                frame = frame.f_back
            if frame is not None:
                open(os.path.join(os.environ["READY_DIR"], f"inside-{rank}"), "w").close()
                return
            time.sleep(0.01)
    threading.Thread(target=look, daemon=True).start()

@pytest.mark.multirank(world_size=2, timeout=120)
def test_long(rank):
    if rank == 0:
        say_once_inside(rank, "barrier")
        dist.barrier()
    say_once_inside(rank, "sleep_long")
    sleep_long()

def sleep_long():
    time.sleep(60)

@pytest.mark.multirank(world_size=2)
def test_never_reached(rank):
    pass
"""


def _interrupt_when_inside(folder: Path, ranks: int) -> tuple[int, str, list[int]]:
    """Run the session in a process group of its own, as a terminal does; press Ctrl-C (SIGINT
    to the group) once the ranks say they are inside; its exit code, output and the pids of the
    processes it started."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_ctrl_c.py"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "READY_DIR": str(folder)},
    )
    deadline = time.monotonic() + 60
    while sum((folder / f"inside-{r}").exists() for r in range(ranks)) < ranks:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never got inside"
        time.sleep(0.02)
    started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out, started


def test_ctrl_c_says_where_each_rank_was_and_leaves_no_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ctrl_c=BOTH_RANKS_INSIDE)
    code, out, started = _interrupt_when_inside(pytester.path, 2)
    assert code == pytest.ExitCode.INTERRUPTED, out
    lines = out.splitlines()
    at = lines.index(next(ln for ln in lines if ln.startswith("ddphooks: test_ctrl_c.py::test_long was interrupted")))
    assert lines[at].endswith("; where its ranks were:")
    where = "\n".join(lines[at + 1 : at + 6])
    assert "  rank 0: blocked in barrier #1 on the default group for " in where
    assert "    ranks that never entered barrier #1: 1" in where
    assert "    stuck at test_ctrl_c.py:26 in test_long: dist.barrier()" in where
    assert "  rank 1: still running\n    stuck at test_ctrl_c.py:31 in sleep_long: time.sleep(60)" in where
    assert "KeyboardInterrupt" in out and "test_never_reached" not in out
    # the line pytest names under the interrupt is where rank 0 was in the test, as a plain test's
    crash = [ln for ln in lines if ln.endswith(": KeyboardInterrupt")]
    assert len(crash) == 1 and crash[0].endswith("test_ctrl_c.py:26: KeyboardInterrupt"), out
    assert not [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_ctrl_c_in_a_plain_test_says_nothing_of_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_ctrl_c="""
        import os
        import time

        def test_plain():
            open(os.path.join(os.environ["READY_DIR"], "inside-0"), "w").close()
            time.sleep(60)
        """
    )
    code, out, _ = _interrupt_when_inside(pytester.path, 1)
    assert code == pytest.ExitCode.INTERRUPTED, out
    assert "test_ctrl_c.py:6: KeyboardInterrupt" in out
    assert "ddphooks:" not in out
