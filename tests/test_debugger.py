"""--pdb opens the debugger on a failing rank's own traceback, on the terminal; breakpoint()
in a rank stops that rank and lends it the terminal. Run under a pseudo-terminal."""

from __future__ import annotations

import os
import sys

import pytest
from ptyproc import PtyProcess

FAILS = """
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2, timeout=60)
def test_fails(rank):
    value = rank * 10 + 1
    dist.barrier()
    assert value == 1

def test_after():
    pass
"""


def test_pdb_opens_on_the_failing_ranks_traceback_and_q_ends_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS)
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_fails.py"], str(pytester.path)
    )
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p value")
    proc.expect("11")
    proc.send("p rank")
    proc.expect("(Pdb) ")
    proc.send("q")
    assert proc.wait() == 1
    text = proc.text
    assert "rank 1 gave the terminal back" in text
    assert "1 failed, 1 passed" in text
    assert text.count("(Pdb)") >= 2 and "PDB post_mortem" not in text, "pytest's own debugger stayed away"


def test_ddp_pdb_rank_chooses_which_failing_rank_gets_the_debugger(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_both="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_both_fail(rank):
            mine = f"rank {rank} here"
            assert False
        """
    )
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=0", "test_both.py"]
    proc = PtyProcess(argv, str(pytester.path))
    proc.expect("rank 0: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p mine")
    proc.expect("'rank 0 here'")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 1: post-mortem" not in proc.text


LATE = """
import threading
import pytest

@pytest.mark.multirank(world_size=2, timeout=60)
def test_rank_1_fails_later(rank):
    late = f"rank {rank} failed late"
    if rank == 1:
        threading.Event().wait(1.5)  # rank 0 fails first: rank 1 must still get there
    assert rank == 7
"""


def test_the_chosen_rank_is_let_fail_after_another_rank_failed_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_late=LATE)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=1", "test_late.py"]
    proc = PtyProcess(argv, str(pytester.path))
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p late")
    proc.expect("'rank 1 failed late'")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 0: post-mortem" not in proc.text


def test_a_pdb_rank_the_test_does_not_have_is_said(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_late=LATE)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=5", "test_late.py"]
    proc = PtyProcess(argv, str(pytester.path))
    assert proc.wait() == 1
    assert "--ddp-pdb-rank=5: this test has ranks 0..1; no rank opened pdb" in proc.text
    assert "post-mortem of its failure" not in proc.text


def test_a_pdb_rank_that_did_not_fail_is_said(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS)  # rank 1 fails, rank 0 passes
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "--ddp-pdb-rank=0", "test_fails.py"]
    proc = PtyProcess(argv, str(pytester.path))
    assert proc.wait() == 1
    assert "--ddp-pdb-rank=0: rank 0 did not fail here, so no rank opened pdb (rank 1 failed)" in proc.text
    assert "post-mortem of its failure" not in proc.text


def test_breakpoint_in_a_rank_lends_it_the_terminal_and_continuing_goes_on(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_break="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops_on_rank1(rank):
            x = 40 + rank
            if rank == 1:
                breakpoint()
                x += 1
            dist.barrier()
            assert x == 40 + 2 * rank
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "test_break.py"], str(pytester.path)
    )
    _look_and_continue(proc, "rank 1: breakpoint", "p x", "41")
    assert proc.wait() == 0, proc.text
    assert "1 passed" in proc.text


FIXTURE_BREAKS = """
import pytest

@pytest.fixture
def shard(rank):
    name = f"shard-{rank}"
    if rank == 1:
        breakpoint()  # in the fixture's setup, inside the rank
    yield name

@pytest.mark.multirank(world_size=2, timeout=60)
def test_uses_shard(shard, rank):
    assert shard == f"shard-{rank}"
"""


def test_breakpoint_in_a_rank_fixtures_setup_lends_it_the_terminal(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fixture_break=FIXTURE_BREAKS)
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "test_fixture_break.py"], str(pytester.path)
    )
    _look_and_continue(proc, "rank 1: breakpoint", "p name", "shard-1")
    assert proc.wait() == 0, proc.text
    assert "1 passed" in proc.text


def _look_and_continue(proc: PtyProcess, banner: str, expression: str, shows: str) -> None:
    """At the breakpoint ``banner`` announces: ``expression`` shows ``shows``; then continue."""
    proc.expect(banner)
    proc.expect("(Pdb) ")
    proc.send(expression)
    proc.expect(shows)
    proc.send("c")


def test_a_breakpoint_without_a_terminal_does_not_hang(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_break="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops(rank):
            breakpoint()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1")
    result.assert_outcomes(passed=1)  # an xdist worker has no terminal to lend: passed over
    assert "BrokenPipeError" not in result.stdout.str()
    assert result.duration < 40


def test_pdb_opens_on_a_rank_fixtures_error_and_pytest_stays_away(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixture_fails="""
        import pytest

        @pytest.fixture
        def data(rank):
            missing = f"shard-{rank}.bin"
            if rank == 1:
                raise FileNotFoundError(missing)
            return missing

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_uses_data(data):
            pass

        def test_after():
            pass
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_fixture_fails.py"], str(pytester.path)
    )
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p missing")
    proc.expect("shard-1.bin")
    proc.send("q")
    proc.wait()
    text = proc.text
    assert "1 passed, 1 error" in text, text
    assert "PDB post_mortem" not in text, "pytest's own debugger stayed away"


def test_quitting_at_a_ranks_breakpoint_fails_the_test_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_quit="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops_on_rank1(rank):
            if rank == 1:
                breakpoint()
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "test_quit.py"], str(pytester.path)
    )
    proc.expect("rank 1: breakpoint")
    proc.expect("(Pdb) ")
    proc.send("q")
    assert proc.wait() == 1
    assert "rank 1: failed: the debugger was quit (q) in this rank" in proc.text
    assert "BdbQuit" not in proc.text


SPECIAL_FAILS = """
import pytest

@pytest.mark.special
def test_isolated_fails():
    secret = 41
    assert secret == 42

@pytest.mark.special
@pytest.mark.multirank(world_size=2, timeout=60)
def test_isolated_ranks_fail(rank):
    secret = 40 + rank
    assert rank == 0

def test_after():
    pass
"""


def test_pdb_reaches_a_special_tests_interpreter_and_its_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_special_pdb=SPECIAL_FAILS)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_special_pdb.py"]
    proc = PtyProcess(argv, str(pytester.path))
    proc.expect("the special test has the terminal")
    proc.expect("the special test: post-mortem of its failure")
    proc.expect("(Pdb) ")
    proc.send("p secret * 2")
    proc.expect("82")
    proc.send("q")
    proc.expect("rank 1 of the special test has the terminal")
    proc.expect("rank 1: post-mortem of its failure")
    proc.send("p secret * 3")
    proc.expect("123")
    proc.send("q")
    assert proc.wait() == 1, proc.text
    text = proc.text
    # the failures stand as failures (not "the interpreter died"), and the session went on
    assert "2 failed, 1 passed" in text
    assert "interpreter died" not in text and "Quitting debugger" not in text
    assert "FAILED test_special_pdb.py::test_isolated_fails - assert 41 == 42" in text


SPECIAL_BREAKS = """
import pytest

@pytest.mark.special
def test_isolated_stops():
    secret = 7
    breakpoint()
    assert secret == 7

@pytest.mark.special
@pytest.mark.multirank(world_size=2, timeout=60)
def test_isolated_rank_stops(rank):
    secret = 8
    if rank == 1:
        breakpoint()
    assert secret == 8
"""


@pytest.mark.parametrize("capture", ["-s", "--capture=fd"])
def test_breakpoint_in_a_special_test_lends_it_the_sessions_terminal(pytester: pytest.Pytester, capture: str) -> None:
    pytester.makepyfile(test_special_break=SPECIAL_BREAKS)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", capture, "test_special_break.py"]
    proc = PtyProcess(argv, str(pytester.path))
    _look_and_continue(proc, "the special test: breakpoint", "p secret * 6", "42")
    _look_and_continue(proc, "rank 1: breakpoint", "p secret * 6", "48")
    assert proc.wait() == 0, proc.text
    assert "2 passed" in proc.text


@pytest.mark.parametrize("where", ["special test", "rank fixture"])
def test_a_breakpoint_without_a_terminal_to_lend_is_passed_over(pytester: pytest.Pytester, where: str) -> None:
    source, tests = (SPECIAL_BREAKS, 2) if where == "special test" else (FIXTURE_BREAKS, 1)
    pytester.makepyfile(test_breaks=source)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "1")
    result.assert_outcomes(passed=tests)  # an xdist worker has no terminal to lend
    assert "the debugger was quit" not in result.stdout.str()


def test_trace_stops_each_rank_at_the_tests_first_line_and_the_test_still_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_traced="""
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_always_fails(rank):
            first = f"line one on rank {rank}"
            assert False, "the body ran"
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--trace", "test_traced.py"], str(pytester.path)
    )
    seen = 0  # what was on the terminal before the last line typed
    for _ in range(2):  # the ranks take turns at the terminal
        proc.expect("--trace, at the test's first line", since=seen)
        for line, shows in (("n", "(Pdb) "), ("p first", "'line one on rank "), ("c", "")):
            proc.expect("(Pdb) ", since=seen)
            seen = len(proc.output)
            proc.send(line)
            proc.expect(shows, since=seen)
    assert proc.wait() == 1, proc.text
    assert "1 failed" in proc.text and "AssertionError: the body ran" in proc.text


def test_quitting_under_trace_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_traced="""
        import pytest

        @pytest.mark.multirank(world_size=1, timeout=60)
        def test_passes(rank):
            assert True
        """
    )
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--trace", "test_traced.py"], str(pytester.path)
    )
    proc.expect("--trace, at the test's first line")
    proc.expect("(Pdb) ")
    proc.send("q")
    assert proc.wait() == 1, proc.text
    assert "rank 0: failed: the debugger was quit (q) in this rank" in proc.text


@pytest.mark.parametrize("call", ["pytest.set_trace()", "pdb.set_trace()"])
def test_pytest_and_pdb_set_trace_in_a_rank_lend_it_the_terminal(pytester: pytest.Pytester, call: str) -> None:
    pytester.makepyfile(
        test_break=f"""
        import pdb
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_stops_on_rank1(rank):
            x = 40 + rank
            if rank == 1:
                {call}
                x += 1
            dist.barrier()
            assert x == 40 + 2 * rank
        """
    )
    proc = PtyProcess([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_break.py"], str(pytester.path))
    _look_and_continue(proc, "rank 1: breakpoint", "p x", "41")
    assert proc.wait() == 0, proc.text
    assert "1 passed" in proc.text


def test_ctrl_c_at_a_ranks_prompt_keeps_the_session_as_pdb_does(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS)
    proc = PtyProcess(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pdb", "test_fails.py"], str(pytester.path)
    )
    proc.expect("rank 1: post-mortem of its failure")
    proc.expect("(Pdb) ")
    seen = len(proc.output)
    os.write(proc.fd, b"\x03")  # Ctrl-C
    proc.expect("--KeyboardInterrupt--", since=seen)
    proc.send("p value")
    proc.expect("11", since=seen)
    proc.send("q")
    assert proc.wait() == 1, proc.text
    assert "1 failed, 1 passed" in proc.text, proc.text
    assert "PDB post_mortem" not in proc.text and "debugger.py" not in proc.text


def test_without_pytests_debugging_plugin_ranks_run_as_ever(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails=FAILS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:debugging")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*rank 1: failed: assert 11 == 1*"])
    result.stdout.no_fnmatch_line("*no option named*")


def test_ctrl_c_while_a_ranks_stepped_line_runs_stops_the_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_busy="""
        import threading
        import pytest

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_steps_into_a_long_wait(rank):
            if rank == 0:
                breakpoint()
                threading.Event().wait(60)
        """
    )
    proc = PtyProcess([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_busy.py"], str(pytester.path))
    proc.expect("rank 0: breakpoint")
    proc.expect("-> threading.Event().wait(60)")
    proc.expect("(Pdb) ")
    seen = len(proc.output)
    # a statement that says it runs, then waits 60 s: the rank is not at its prompt
    proc.send("!print('stepping in', flush=True); threading.Event().wait(60)")
    proc.expect("stepping in\r\n", since=seen)
    seen = len(proc.output)
    os.write(proc.fd, b"\x03")  # Ctrl-C
    assert proc.wait(timeout=30) == 2, proc.text  # interrupted, as pytest ends a session on Ctrl-C
    assert b"--KeyboardInterrupt--" not in proc.output[seen:]
