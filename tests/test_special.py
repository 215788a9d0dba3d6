"""@pytest.mark.special: one test in a fresh interpreter, reported in this session."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import pytest

SOURCE = """
import os
import signal
import time
import pytest
import torch.distributed as dist

PIDS = os.environ["PID_DIR"]

@pytest.fixture(scope="session")
def session_thing():
    open(os.path.join(PIDS, f"session-{os.getpid()}"), "w").close()
    return "ready"

@pytest.fixture(scope="module")
def module_thing(session_thing):
    return session_thing + "!"

def test_plain():
    open(os.path.join(PIDS, f"plain-{os.getpid()}"), "w").close()

@pytest.mark.special
def test_global_group(tmp_path, module_thing):
    assert module_thing == "ready!"
    open(os.path.join(PIDS, f"special-{os.getpid()}"), "w").close()
    # global state that cannot be cleaned: it dies with this interpreter
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    print("special says hello")
    dist.destroy_process_group()

@pytest.mark.special
def test_special_fails():
    print("output before failing")
    assert 2 + 2 == 5
"""


def test_special_runs_in_its_own_interpreter_with_its_own_fixtures(pytester, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    pytester.makepyfile(test_iso=SOURCE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=2, failed=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    plain = {n.split("-")[1] for n in names if n.startswith("plain-")}
    special = {n.split("-")[1] for n in names if n.startswith("special-")}
    sessions = {n.split("-")[1] for n in names if n.startswith("session-")}
    assert len(plain) == 1 and len(special) == 1 and plain != special
    assert special <= sessions, "the session fixture was set up in the special test's interpreter"
    result.stdout.fnmatch_lines(
        [
            "*_ test_special_fails _*",
            ">       assert 2 + 2 == 5",
            "E       assert (2 + 2) == 5",
            "*- Captured stdout call -*",
            "output before failing",
        ]
    )
    result.stdout.fnmatch_lines(["*- Captured stdout call -*", "special says hello"])
    result.stdout.fnmatch_lines(
        ["PASSED test_iso.py::test_global_group", "FAILED test_iso.py::test_special_fails - assert (2 + 2) == 5"]
    )


def test_select_with_m_special_and_not_special(pytester, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    pytester.makepyfile(test_sel=SOURCE)
    only = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "special")
    only.assert_outcomes(passed=1, failed=1, deselected=1)
    rest = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "not special")
    rest.assert_outcomes(passed=1, deselected=2)


def test_junitxml_and_last_failed_see_special_tests(pytester, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    pytester.makepyfile(test_rep=SOURCE)
    xml = tmp_path / "junit.xml"
    first = pytester.runpytest_subprocess(f"--junitxml={xml}")
    first.assert_outcomes(passed=2, failed=1)
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert set(cases) == {"test_plain", "test_global_group", "test_special_fails"}
    failure = cases["test_special_fails"].find("failure")
    assert failure is not None and "assert (2 + 2) == 5" in failure.get("message", "")
    assert float(cases["test_global_group"].get("time")) > 0
    again = pytester.runpytest_subprocess("--lf")
    again.assert_outcomes(failed=1, passed=0)
    again.stdout.fnmatch_lines(["*rerun previous 1 failure*"])


def test_special_tests_under_xdist(pytester, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    pytester.makepyfile(
        test_par="""
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.special
        @pytest.mark.parametrize("i", range(6))
        def test_each_own_group(i, tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
            open(os.path.join(os.environ["PID_DIR"], str(os.getpid())), "w").close()
            dist.destroy_process_group()

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2)
        def test_special_multirank(rank):
            dist.barrier()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=7)
    assert len(list(tmp_path.iterdir())) == 6, "each special test had an interpreter of its own"


def test_special_multirank_starts_its_ranks_from_its_own_interpreter(pytester) -> None:
    pytester.makepyfile(
        test_sm="""
        import os
        import psutil
        import pytest
        import torch.distributed as dist

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2)
        def test_ranks(rank):
            launcher = psutil.Process(os.getppid())
            interpreter = launcher.parent()
            assert "pytest" in " ".join(interpreter.cmdline())
            assert interpreter.pid != int(os.environ["OUTER_PYTEST"])
            dist.barrier()
        """
    )
    os.environ["OUTER_PYTEST"] = str(os.getpid())
    try:
        result = pytester.runpytest("-p", "no:cacheprovider")
    finally:
        del os.environ["OUTER_PYTEST"]
    result.assert_outcomes(passed=1)


CRASHES = {
    "segv": ("os.kill(os.getpid(), signal.SIGSEGV)", "the special test's interpreter died: killed by SIGSEGV"),
    "exit": ("os._exit(9)", "the special test's interpreter died: exit code 9"),
}


@pytest.mark.parametrize("how", sorted(CRASHES))
def test_special_test_that_crashes_its_interpreter(pytester, how: str) -> None:
    action, words = CRASHES[how]
    pytester.makepyfile(
        test_crash=f"""
        import os
        import signal
        import pytest

        @pytest.mark.special
        def test_crash():
            print("last words before the crash")
            {action}

        def test_after():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([words])
    result.stdout.fnmatch_lines(
        ["*Captured stdout of the special test's interpreter*", "*last words before the crash*"]
    )


def test_special_test_that_hangs_is_killed_and_the_session_goes_on(pytester) -> None:
    pytester.makepyfile(
        test_hang="""
        import subprocess
        import time
        import pytest

        @pytest.mark.special
        def test_sleeps():
            import signal  # as Lightning's trainer around a fit: every handler saved and put back
            signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGUSR1))
            subprocess.Popen(["sleep", "600"])
            time.sleep(600)

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_ranks_hang(rank):
            import torch.distributed as dist
            if rank == 0:
                dist.barrier()
            else:
                time.sleep(600)

        def test_after():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--ddp-timeout=3")
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_sleeps _*",
            "special test did not finish within 3 s",
            "its interpreter was killed, with every process it started",
            "stuck at test_hang.py:10 in test_sleeps: time.sleep(600)",
            "",
            "the special test's stack, MainThread (most recent call last):",
            '  File "test_hang.py", line 10, in test_sleeps',
        ]
    )
    result.stdout.fnmatch_lines(["*_ test_ranks_hang _*", "hang: the test did not finish within 2 s (2 ranks)"])
    # pytest-timeout's thread method would os._exit the special interpreter: timed here instead
    result = pytester.runpytest("-p", "no:cacheprovider", "--timeout=2", "--timeout-method=thread", "-k", "sleeps")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["special test did not finish within 2 s", "stuck at test_hang.py:10 in test_sleeps: *"]
    )
    result.stdout.no_fnmatch_line("*interpreter died*")


def test_special_interpreter_ends_with_its_test_so_only_a_process_it_started_is_a_leak(pytester) -> None:
    pytester.makepyfile(
        test_state="""
        import os
        import subprocess
        import threading
        import pytest
        import torch.distributed as dist

        @pytest.mark.special
        def test_leaves_global_state(tmp_path):
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
            threading.Thread(target=threading.Event().wait, name="forever", daemon=True).start()
            os.environ["MASTER_PORT"] = "29999"

        @pytest.mark.special
        def test_leaves_a_process():
            subprocess.Popen(["sleep", "607"])
        """
    )
    leak_report = [
        "*_ ERROR at teardown of test_leaves_a_process _*",
        "test_state.py::test_leaves_a_process leaked (cleaned up before the next test):",
        "  process * is still running: sleep 607",
    ]
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(leak_report)
    result.stdout.no_fnmatch_line("*test_leaves_global_state leaked*")


def test_a_special_test_that_skips_is_reported_like_any_skip(pytester, tmp_path) -> None:
    """A skip's location comes back from the special interpreter through JSON: the short
    summary (-rs) and junitxml take it as pytest's own, and the session goes on."""
    pytester.makepyfile(
        test_skips="""
        import pytest

        @pytest.mark.special
        def test_special_skip():
            pytest.skip("skipping inside special")

        @pytest.mark.special
        @pytest.mark.skipif(True, reason="skipif on a special test")
        def test_special_skipif():
            pass

        def test_after():
            pass
        """
    )
    xml = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess("-rs", f"--junitxml={xml}")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_skips.py:*: skipping inside special"])
    assert result.ret == 0
    skipped = [c.get("name") for c in ET.parse(xml).getroot().iter("testcase") if c.find("skipped") is not None]
    assert sorted(skipped) == ["test_special_skip", "test_special_skipif"]


@pytest.mark.parametrize("given", ["command line", "PYTEST_ADDOPTS", "ini"])
def test_a_failed_special_test_is_rerun_each_time_in_an_interpreter_of_its_own(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Given in PYTEST_ADDOPTS or the ini file (addopts, or its own `reruns` key under
    --strict-config), --reruns made every special test's interpreter refuse to start: it was
    started without pytest-rerunfailures, which then read options it did not know."""
    pytester.makepyfile(
        test_rerun="""
        import os
        import pytest

        @pytest.mark.special
        def test_passes_the_second_time(tmp_path):
            log = os.path.join(os.getcwd(), "attempts")
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {tmp_path}\\n")
            import torch.distributed as dist  # global state a second attempt in the same interpreter would find
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            assert len(open(log).read().splitlines()) == 2

        @pytest.mark.special
        @pytest.mark.flaky(reruns=1, only_rerun="ConnectionError")
        def test_not_rerun_for_another_error():
            assert False
        """
    )
    base = pytester.path / "base"
    args = ["-p", "no:cacheprovider", "--strict-markers", "--strict-config", f"--basetemp={base}", "-rA"]
    if given == "command line":
        args += ["--reruns", "1"]
    elif given == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", "--reruns 1")
    else:
        pytester.makeini("[pytest]\nreruns = 1\naddopts = --reruns-delay 0\n")
    result = pytester.runpytest_subprocess(*args, timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*1 failed, 1 passed, 1 rerun*"])
    result.stdout.fnmatch_lines(["test_rerun.py R.F*"])
    attempts = [line.split() for line in (pytester.path / "attempts").read_text().splitlines()]
    assert len(attempts) == 2 and attempts[0][0] != attempts[1][0]
    # its tmp_path is under the session's --basetemp, and kept
    assert all(path.startswith(str(base)) and os.path.isdir(path) for _, path in attempts)


def test_the_sessions_own_teardown_after_a_special_test_is_captured_and_one_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_teardown="""
        import pytest

        @pytest.fixture(scope="module")
        def shared():
            yield 1
            print("module teardown says hello")
            raise RuntimeError("module teardown failed")

        def test_plain(shared):
            pass

        @pytest.mark.special
        def test_special_last():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "--junitxml=out.xml")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_special_last*", "*Captured stdout teardown*", "module teardown says hello"]
    )
    result.stdout.no_fnmatch_line("test_teardown.py ..module teardown says hello*")  # not raw on the terminal
    suite = ET.parse(pytester.path / "out.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "2"


def test_a_special_multiranks_lines_are_labelled_once(pytester: pytest.Pytester) -> None:
    # labelled in junit's text, titled on the terminal: the same as for a multirank test alone
    pytester.makepyfile(
        test_labels="""
        import sys
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_plain(rank):
            print(f"hello from {rank}")
            print(f"oops from {rank}", file=sys.stderr)
            assert False

        @pytest.mark.special
        @pytest.mark.multirank(world_size=2)
        def test_special(rank):
            print(f"hello from {rank}")
            print(f"oops from {rank}", file=sys.stderr)
            assert False
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "junit_logging=all", "--junitxml=out.xml")
    result.assert_outcomes(failed=2)
    text = (pytester.path / "out.xml").read_text()
    assert text.count("[rank 1] hello from 1") == 2 and "[rank 1] [rank 1]" not in text
    sections = [
        "*- Captured stdout rank 0 call -*",
        "hello from 0",
        "*- Captured stderr rank 0 call -*",
        "oops from 0",
        "*- Captured stdout rank 1 call -*",
        "hello from 1",
        "*- Captured stderr rank 1 call -*",
        "oops from 1",
    ]
    result.stdout.fnmatch_lines(["*_ test_plain _*", *sections, "*_ test_special _*", *sections])
    result.stdout.no_fnmatch_line("[[]rank 0[]] hello from 0")


def test_a_special_tests_interpreter_ends_with_a_killed_session(pytester: pytest.Pytester) -> None:
    """SIGKILL of the pytest process (a CI runner's kill) left the interpreter of a running
    special test, and what it started, running for ever: it now ends with its parent."""
    import signal
    import subprocess
    import sys
    import time

    pidfile = pytester.path / "special.pid"
    pytester.makepyfile(
        test_sleeps=f"""
        import os
        import time
        import pytest

        @pytest.mark.special
        def test_sleeps():
            with open({str(pidfile)!r}, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        """
    )
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
        cwd=pytester.path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        special = int(pidfile.read_text())
    finally:
        session.send_signal(signal.SIGKILL)
        session.wait()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{special}") and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = os.path.exists(f"/proc/{special}")
    if alive:
        os.kill(special, signal.SIGKILL)
    assert not alive, "the special test's interpreter outlived the session"


def test_pytest_exit_in_a_special_test_ends_the_session_with_its_code(pytester: pytest.Pytester) -> None:
    # it was a failed test ("its interpreter died: exit code 9") and the session went on
    pytester.makepyfile(
        test_stops="""
        import pytest

        @pytest.mark.special
        def test_stop():
            pytest.exit("special stop", returncode=9)

        def test_after():
            print("test_after ran")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    assert result.ret == 9
    result.stdout.fnmatch_lines(["*Exit: special stop*"])
    result.stdout.no_fnmatch_line("*test_after ran*")
    result.stdout.no_fnmatch_line("*interpreter died*")


def test_a_special_test_its_interpreter_cannot_find_again_is_named_so(pytester: pytest.Pytester) -> None:
    # a parameter id made of the process id: another interpreter collects another id
    pytester.makepyfile(
        test_ids="""
        import os
        import pytest

        @pytest.mark.special
        @pytest.mark.parametrize("v", [os.getpid()])
        def test_pid(v):
            pass

        @pytest.mark.special
        @pytest.mark.parametrize("v", [1], ids=["steady"])
        def test_steady(v):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "the special test was not found in its own interpreter: no test collected there has the id"
            " test_ids.py::test_pid[[]*[]] (an id made of a value that differs from one interpreter to the next,*",
        ]
    )
    result.stdout.no_fnmatch_line("*interpreter died*")
