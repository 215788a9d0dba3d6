"""A special test's interpreter and what it starts: a relaunched pytest is an ordinary child,
warnings reach the session once, and a death or a hang after the test is reported."""

from __future__ import annotations

import xml.etree.ElementTree as ET

RELAUNCH = """
import os
import signal
import subprocess
import sys
import time
import warnings

import __main__
import pytest


def relaunch():
    # as Lightning's DDP launcher starts rank 1: this very command line again, another rank
    command = [sys.executable, "-m", __main__.__spec__.name, *sys.argv[1:]]
    return subprocess.Popen(command, env={**os.environ, "FAKE_RANK": "1"})


def rank():
    return int(os.environ.get("FAKE_RANK", "0"))


@pytest.mark.special
def test_relaunch_passes(tmp_path):
    (tmp_path / f"rank{rank()}").write_text("here")
    if rank() == 1:
        print("rank 1 ran the test")
        return
    assert relaunch().wait() == 0
    print("rank 0 saw rank 1 pass")
    assert (tmp_path / "rank0").exists(), "rank 1's pytest deleted rank 0's temporary folder"


@pytest.mark.special
def test_relaunch_fails():
    if rank() == 1:
        assert 1 + 1 == 3, "rank 1 fails"
    assert relaunch().wait() == 0, "rank 1 failed"


@pytest.mark.special
def test_framework_kills_rank0_when_rank1_fails():
    if rank() == 1:
        raise RuntimeError("rank 1 blew up")
    child = relaunch()
    # as Lightning's _ChildProcessObserver: a failed child takes the whole job down
    while child.poll() is None:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def test_plain():
    pass
"""


def test_a_relaunched_pytest_is_an_ordinary_child_of_the_special_test(pytester, tmp_path) -> None:
    pytester.makepyfile(test_relaunch=RELAUNCH)
    xml = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", f"--junitxml={xml}")
    result.assert_outcomes(passed=2, failed=2)
    cases = [c.get("name") for c in ET.parse(xml).getroot().iter("testcase")]
    assert sorted(cases) == sorted(
        ["test_relaunch_passes", "test_relaunch_fails", "test_framework_kills_rank0_when_rank1_fails", "test_plain"]
    )
    assert ET.parse(xml).getroot().find("testsuite").get("tests") == "4"
    # this session's own summary is the last one (rank 1's are inside captured output)
    summary = result.stdout.str().rsplit("short test summary info", 1)[1].splitlines()
    outcomes = sorted(line.split(" - ")[0] for line in summary if line.startswith(("PASSED", "FAILED")))
    assert outcomes == [
        "FAILED test_relaunch.py::test_framework_kills_rank0_when_rank1_fails",
        "FAILED test_relaunch.py::test_relaunch_fails",
        "PASSED test_relaunch.py::test_plain",
        "PASSED test_relaunch.py::test_relaunch_passes",
    ]
    # rank 1's whole session is rank 0's captured output
    result.stdout.fnmatch_lines(
        ["*_ test_relaunch_passes _*", "*- Captured stdout call -*", "rank 1 ran the test", "*rank 0 saw rank 1 pass"]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_relaunch_fails _*",
            "E       AssertionError: rank 1 failed",
            "*- Captured stdout call -*",
            "E*AssertionError: rank 1 fails",
        ]
    )


def test_a_special_test_killed_by_its_own_framework_says_so(pytester) -> None:
    pytester.makepyfile(test_relaunch=RELAUNCH)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "framework_kills")
    result.assert_outcomes(failed=1, deselected=3)
    result.stdout.fnmatch_lines(
        [
            "*_ test_framework_kills_rank0_when_rank1_fails _*",
            "the special test's interpreter died: killed by SIGKILL",
            "*- Captured stdout call -*",
            "E*RuntimeError: rank 1 blew up",
        ]
    )


def test_warnings_of_a_special_test_reach_the_summary_once(pytester) -> None:
    pytester.makepyfile(
        test_warn="""
        import warnings
        import pytest

        class TrainerWarning(UserWarning):
            pass

        @pytest.mark.special
        def test_warns():
            warnings.warn("the special test says careful", TrainerWarning)

        @pytest.mark.special
        def test_quiet():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        ["*= warnings summary =*", "test_warn.py::test_warns", "*TrainerWarning: the special test says careful"]
    )
    assert result.stdout.str().count("TrainerWarning: the special test says careful") == 1


def test_a_special_interpreter_that_dies_after_its_test_is_an_error(pytester) -> None:
    pytester.makepyfile(
        test_exit="""
        import atexit
        import os
        import signal
        import pytest

        @pytest.mark.special
        def test_passes_then_its_interpreter_aborts():
            # as a native destructor that aborts while the interpreter exits
            atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))

        @pytest.mark.special
        def test_ends_cleanly():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_passes_then_its_interpreter_aborts _*",
            "the special test's interpreter died after the test: killed by SIGABRT",
        ]
    )


def test_a_failed_special_test_whose_interpreter_then_dies_is_one_failure(pytester) -> None:
    """As Lightning's launcher does when a rank failed: it kills its own processes, the test's
    interpreter among them, right after the test. One failure, which says it."""
    pytester.makepyfile(
        test_killed="""
        import atexit
        import os
        import signal
        import pytest

        @pytest.mark.special
        def test_fails_then_is_killed():
            atexit.register(lambda: os.kill(os.getpid(), signal.SIGKILL))
            raise RuntimeError("rank 1 blew up")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*RuntimeError: rank 1 blew up",
            "*- the special test's interpreter after the test -*",
            "the special test's interpreter died after the test: killed by SIGKILL",
        ]
    )


def test_a_special_interpreter_that_lingers_after_its_test_is_stopped(pytester) -> None:
    pytester.makepyfile(
        test_linger="""
        import threading
        import pytest

        @pytest.mark.special
        def test_leaves_a_thread_that_never_ends():
            threading.Thread(target=threading.Event().wait, name="forever").start()

        def test_after():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-timeout=2")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_leaves_a_thread_that_never_ends _*",
            "the special test finished, but its interpreter did not end 2 s after it",
            "it waited for threads the test started and left running (not daemon threads): 'forever'",
            "its interpreter was killed, with every process it started",
            "",
            "thread 0x* 'forever' (most recent call last):",
        ]
    )
