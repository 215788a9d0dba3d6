"""What a failing multirank test says, in the words a user reads."""

from __future__ import annotations

import os
import re

import pytest


def test_assertion_on_some_ranks_names_each_with_its_own_traceback(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3)
        def test_values(rank):
            dist.barrier()
            expected = [0, 10, 20]
            value = rank * 10 if rank != 2 else 25
            if rank >= 1:
                assert value == expected[rank] + 1
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "multirank test failed on ranks 1,2 of 3",
        "  rank 0: passed",
        "  rank 1: failed: assert 10 == (10 + 1)",
        "  rank 2: failed: assert 25 == (20 + 1)",
        "*-- rank 1*",
        ">*assert value == expected[[]rank[]] + 1",
        "E*assert 10 == (10 + 1)",
        "*-- rank 2*",
        "E*assert 25 == (20 + 1)",
    )
    ran.lines("FAILED test_inner.py::test_values - ranks 1,2 failed; rank 1: assert 10*")


def test_ranks_failing_alike_show_the_traceback_once_and_the_reason_in_their_line(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=3)
        def test_order(rank, recorder):
            recorder.mark("prepare" if rank == 0 else "setup")
            recorder.timeline().assert_happens_before("prepare@0", "setup@1")
        """,
        "-l",
    )
    ran.result.assert_outcomes(failed=1)
    reason = (
        "pytest_ddphooks.TimelineAssertionError: 'prepare@0' does not happen before 'setup@1': prepare ended on"
        " rank 0 (event #2) and setup started on rank 1 (event #2), and no collective connects them: rank 1 took"
        " part in no collective with rank 0 before event #2"
    )
    ran.lines(
        "multirank test failed on ranks 0,1,2 of 3",
        f"  rank 0: failed: {reason}",
        f"  rank 1: failed: {reason}",
        f"  rank 2: failed: {reason}",
        "*-- rank 0 --*",
        "rank = 0",
        "E*'prepare@0' does not happen before 'setup@1':",
        "*-- rank 1 --*",
        "the same failure as rank 0, at the same line (its traceback is above)",
        "*-- rank 2 --*",
        "the same failure as rank 0, at the same line (its traceback is above)",
    )
    # pytest prints the whole message in the short summary when it sees CI set, so count above it
    failures = ran.text.split("short test summary info", 1)[0]
    assert failures.count("does not happen before 'setup@1':\n") == 1, "one traceback, not three"


def test_output_of_each_rank_is_its_own_report_section(inner) -> None:
    ran = inner(
        """
        import sys
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_talk(rank):
            print(f"out from rank {rank}")
            print(f"err from rank {rank}", file=sys.stderr)
            assert rank == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "*- Captured stdout rank 0 call -*",
        "out from rank 0",
        "*- Captured stderr rank 0 call -*",
        "err from rank 0",
        "*- Captured stdout rank 1 call -*",
        "out from rank 1",
        "*- Captured stderr rank 1 call -*",
        "err from rank 1",
    )


def test_output_of_passing_ranks_shows_with_rA(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_talk(rank):
            print(f"hello {rank}")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    ran.lines("*Captured stdout rank 0 call*", "hello 0", "*Captured stdout rank 1 call*", "hello 1")


def test_a_failed_comparison_in_a_rank_is_explained_as_in_a_plain_test(inner, pytester) -> None:
    pytester.makeconftest(
        """
        def pytest_assertrepr_compare(op, left, right):
            if isinstance(left, dict) and op == "==":
                return ["the project's own explanation"]
        """
    )
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_lists(rank):
            a = list(range(30))
            b = list(range(30))
            b[17] = 99
            assert a == b

        @pytest.mark.multirank(world_size=2)
        def test_dicts(rank):
            assert {"rank": rank} == {"rank": -1}
        """,
        "-vv",
    )
    ran.result.assert_outcomes(failed=2)
    ran.lines("E *At index 17 diff: 17 != 99")
    ran.lines("E *Full diff:*")  # -vv reaches the ranks
    ran.lines("E *the project's own explanation")


def test_output_of_rank_fixtures_is_reported_under_their_phase(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def data(rank):
            print(f"loading on {rank}")
            yield rank
            print(f"unloading on {rank}")

        @pytest.mark.multirank(world_size=2)
        def test_talk(data, capsys):
            print(f"body on {data}")  # held by capsys, never read: the call's, as pytest reports it
            assert data == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "*- Captured stdout rank 1 setup -*",
        "loading on 1",
        "*- Captured stdout rank 1 call -*",
        "body on 1",
        "*- Captured stdout rank 1 teardown -*",
        "unloading on 1",
    )
    # each line once, in the section of the phase that printed it
    assert ran.text.count("unloading on 1") == 1
    assert "loading on 1\nbody on 1" not in ran.text


DEATHS = {
    "exit": ("os._exit(3)", "rank 1 died: exit code 3"),
    "segv": ("os.kill(os.getpid(), signal.SIGSEGV)", "rank 1 died: killed by SIGSEGV"),
    "kill": ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1 died: killed by SIGKILL"),
}


@pytest.mark.parametrize("how", sorted(DEATHS))
def test_a_rank_that_dies_is_named_and_the_others_stop_at_once(inner, how: str) -> None:
    action, words = DEATHS[how]
    ran = inner(
        f"""
        import os
        import signal
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3)
        def test_die(rank):
            dist.barrier()
            if rank == 1:
                {action}
            dist.barrier()  # ranks 0 and 2 wait here for a rank that is gone
        """,
        "--ddp-timeout=60",
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("multirank test failed on rank 1 of 3", f"{words} before it could report")
    # the harness stops the others, unless they saw the peer vanish and failed first (a pause
    # in the pytest process, a collection of its garbage, is enough): rank 1 is named either way
    assert re.search(r"rank 0: (stopped after rank 1 died|failed after rank 1, because its peer went away)", ran.text)
    assert ran.seconds < 20, "the others must be stopped at once, not at the 60 s limit"


def test_the_summary_line_names_a_rank_that_raised_beside_one_that_died(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=3)
        def test_two_causes(rank):
            dist.barrier()
            if rank == 1:
                raise KeyError("no such shard")
            if rank == 2:
                os._exit(7)
        """,
        "--ddp-timeout=60",
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("FAILED test_inner.py::test_two_causes - rank 2 died (exit code 7); rank 1: K*")


@pytest.mark.parametrize("detail", [True, False], ids=["detail", "plain"])
def test_a_rank_crashed_under_detail_debugging_is_told_why(
    inner, monkeypatch: pytest.MonkeyPatch, detail: bool
) -> None:
    """torch 2.13 crashes building DDP in a forked process under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    if detail:
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    else:
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    ran = inner(
        """
        import os
        import signal
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_crash(rank):
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSEGV)
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("rank 1 died: killed by SIGSEGV before it could report")
    hint = "TORCH_DISTRIBUTED_DEBUG=DETAIL is set: with it torch 2.13 crashes (SIGSEGV) building DDP"
    assert (hint in ran.text) is detail


def test_a_rank_that_lost_its_peer_shows_a_short_traceback_unless_long_is_asked_for(inner) -> None:
    source = """
        import pytest

        def exchange():
            \"\"\"Swap the shards with the peer.

            A DOCSTRING LINE nobody needs to read when the peer is gone.
            \"\"\"
            raise RuntimeError("Read error: Connection reset by peer")

        @pytest.mark.multirank(world_size=2)
        def test_swap(rank):
            if rank == 0:
                exchange()
        """
    ran = inner(source)
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "*-- rank 0 --*",
        "test_inner.py:13: in test_swap",
        "    exchange()",
        "test_inner.py:8: in exchange",
        '    raise RuntimeError("Read error: Connection reset by peer")',
        "E   RuntimeError: Read error: Connection reset by peer",
    )
    ran.no_lines("*A DOCSTRING LINE*")
    ran = inner(source, "--tb=long")
    ran.lines("*A DOCSTRING LINE*")


def test_segfault_shows_the_crashing_line(inner) -> None:
    ran = inner(
        """
        import os
        import signal
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_die(rank):
            if rank == 0:
                os.kill(os.getpid(), signal.SIGSEGV)
        """
    )
    ran.lines(
        "rank 0 died: killed by SIGSEGV before it could report",
        "  Fatal Python error: Segmentation fault",
        "*test_inner.py*, line 8, in test_die",
        "*os.kill(os.getpid(), signal.SIGSEGV)",
    )


def test_a_rank_that_points_its_stderr_away_before_crashing_still_shows_the_dump(inner) -> None:
    ran = inner(
        """
        import os
        import signal
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_die(rank):
            if rank == 0:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
                os.kill(os.getpid(), signal.SIGSEGV)
        """
    )
    ran.lines(
        "rank 0 died: killed by SIGSEGV before it could report",
        "  Fatal Python error: Segmentation fault",
        "*os.kill(os.getpid(), signal.SIGSEGV)",
    )


def test_exception_on_one_rank_while_the_other_waits_ends_fast(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        def wait_for_the_others():
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_raise(rank):
            if rank == 0:
                raise ValueError("boom on rank 0")
            wait_for_the_others()
        """,
        "--ddp-timeout=60",
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("multirank test failed on rank 0 of 2", "  rank 0: failed: ValueError: boom on rank 0", "*rank 1:*")
    ran.lines("E*ValueError: boom on rank 0")
    assert ran.seconds < 20
    if "rank 1: failed after rank 0, because its peer went away" in ran.text:
        # its traceback is left out for rank 0's: where it was is said, and the timeline drawn
        ran.lines(
            "  rank 1: failed after rank 0, because its peer went away: *",
            "    at test_inner.py:5 in wait_for_the_others: dist.barrier()",
        )
        ran.lines("recorded timeline:", "rank 0 * | rank 1*")


def test_skip_and_xfail_in_the_body_behave_as_in_a_plain_test(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_skip(rank):
            pytest.skip("not on this machine")

        @pytest.mark.multirank(world_size=2)
        def test_xfail_call(rank):
            pytest.xfail("known bug")

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.xfail(reason="known", strict=True)
        def test_xfail_marker(rank):
            assert rank == 5

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.xfail(reason="should fail", strict=True)
        def test_xpass_strict(rank):
            pass

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.skipif(True, reason="skipped by marker")
        def test_skipif(rank):
            raise AssertionError("must not run")
        """,
        "-rsxX",
    )
    ran.result.assert_outcomes(skipped=2, xfailed=2, failed=1)
    ran.lines("SKIPPED [[]1[]] test_inner.py:5: not on this machine")
    ran.lines("*XFAIL test_inner.py::test_xfail_call - known bug*")
    ran.lines("*[[]XPASS(strict)[]] should fail*")


def test_skip_on_some_ranks_says_so(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_partial(rank):
            if rank == 1:
                pytest.skip("rank 1 has no data")

        @pytest.mark.multirank(world_size=2)
        def test_partial_xfail(rank):
            if rank == 0:
                pytest.xfail("rank 0 knows it fails")

        @pytest.mark.multirank(world_size=2)
        def test_xfail_everywhere(rank):
            pytest.xfail("known everywhere")
        """,
        "-rsx",
    )
    ran.result.assert_outcomes(skipped=1, xfailed=2)
    ran.lines("*rank 1 has no data (on rank 1; the other ranks passed)*")
    ran.lines("XFAIL test_inner.py::test_partial_xfail - rank 0 knows it fails (on rank 0; the other ranks passed)")
    ran.lines("XFAIL test_inner.py::test_xfail_everywhere - known everywhere")


BAD_MARKERS = {
    "zero": ("world_size=0", "world_size must be an int >= 1 or a list of them, got 0 (int)"),
    "negative": ("world_size=-1", "world_size must be an int >= 1 or a list of them, got -1 (int)"),
    "string": ('world_size="2"', "world_size must be an int >= 1 or a list of them, got '2' (str)"),
    "backend": ('world_size=2, backend="mpi2"', "backend='mpi2' is not supported; use one of: 'gloo', 'nccl'"),
    "keyword": ("world_size=2, nodez=2", "multirank() got an unexpected keyword argument 'nodez'*"),
    "nodes": ("world_size=3, nodes=2", "world_size=3 cannot be split evenly over nodes=2"),
    "timeout": ("world_size=2, timeout=-5", "timeout must be a number of seconds > 0 or None, got -5 (int)"),
}


@pytest.mark.parametrize("case", sorted(BAD_MARKERS))
def test_a_bad_marker_is_an_error_of_its_test_alone_and_spawns_nothing(inner, tmp_path, case: str) -> None:
    args, words = BAD_MARKERS[case]
    flag = tmp_path / "ran"
    ran = inner(
        f"""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_good(rank):
            open({str(flag)!r}, "a").write("good ran")

        @pytest.mark.multirank({args})
        def test_bad(rank):
            open({str(flag)!r}, "a").write("bad ran")
        """
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines("*ERROR at setup of test_bad*", f"test_inner.py::test_bad: @pytest.mark.multirank: {words}")
    assert flag.read_text() == "good ran" * 2, "the bad test never runs; the module's good test does, on 2 ranks"


def test_every_bad_marker_of_a_module_is_named_in_one_run(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=0)
        def test_zero(rank):
            pass

        @pytest.mark.multirank(world_size=2, timeout=float("nan"))
        def test_nan(rank):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_good(rank):
            pass
        """
    )
    ran.result.assert_outcomes(passed=1, errors=2)
    ran.lines(
        "*test_inner.py::test_zero: @pytest.mark.multirank: world_size must be an int >= 1*",
        "*test_inner.py::test_nan: @pytest.mark.multirank: timeout must be a number of seconds > 0 or None, got nan*",
    )


def test_stacked_multirank_markers_are_an_error(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        @pytest.mark.multirank(world_size=4)
        def test_twice(rank):
            pass

        @pytest.mark.multirank(world_size=3)
        class TestClass:
            @pytest.mark.multirank(world_size=2)
            def test_closest_wins(self, world_size):
                assert world_size == 2
        """
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines("*test_inner.py::test_twice: @pytest.mark.multirank is given 2 times on this test; give it once*")


def test_unittest_methods_are_refused_clearly(inner) -> None:
    ran = inner(
        """
        import unittest
        import pytest

        class TestCase(unittest.TestCase):
            @pytest.mark.multirank(world_size=2)
            def test_method(self):
                pass
        """,
        "-rs",
    )
    ran.result.assert_outcomes(errors=1)
    ran.lines(
        "*test_inner.py::TestCase::test_method: @pytest.mark.multirank runs pytest test functions on the ranks,"
        " not a unittest.TestCase method*"
    )


def _processes_with(tag: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_after_the_session_no_process_and_no_file_is_left(inner, tmp_path, monkeypatch) -> None:
    tag = f"DDPHOOKS_CLEANUP_TAG={os.getpid()}x{id(tmp_path)}"
    monkeypatch.setenv("DDPHOOKS_CLEANUP_TAG", tag.partition("=")[2])
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    ran = inner(
        """
        import os
        import signal
        import subprocess
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_pass(rank):
            dist.barrier()

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang(rank):
            if rank == 0:
                dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_grandchild(rank):
            subprocess.Popen(["sleep", "300"], start_new_session=True)

        @pytest.mark.multirank(world_size=2)
        def test_die(rank):
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()
        """,
        f"--basetemp={tmp_path / 'basetemp'}",
        subprocess=True,
    )
    # test_grandchild passes, then errors in teardown: its rank's child outlived it
    ran.result.assert_outcomes(passed=2, failed=2, errors=1)
    assert _processes_with(tag) == [], "a process the plugin started outlived the session"
    assert list(private_tmp.iterdir()) == [], "the plugin left files in the temporary folder"


def test_xfail_raises_is_checked_against_the_ranks_exceptions(inner) -> None:
    ran = inner(
        """
        import pytest

        class MyError(Exception):
            pass

        @pytest.mark.xfail(raises=ZeroDivisionError)
        @pytest.mark.multirank(world_size=2)
        def test_expected(rank):
            1 / 0

        @pytest.mark.xfail(raises=(MyError, KeyError))
        @pytest.mark.multirank(world_size=2)
        def test_either(rank):
            raise MyError("x") if rank == 0 else KeyError("y")

        @pytest.mark.xfail(raises=AssertionError, strict=True)
        @pytest.mark.multirank(world_size=2)
        def test_one_rank(rank):
            assert rank == 0

        @pytest.mark.xfail(raises=ZeroDivisionError)
        @pytest.mark.multirank(world_size=2)
        def test_other_error(rank):
            raise ValueError("not the expected one")

        @pytest.mark.xfail(raises=ZeroDivisionError)
        @pytest.mark.multirank(world_size=2)
        def test_one_expected_one_not(rank):
            if rank == 0:
                1 / 0
            raise ValueError("rank 1's own")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(xfailed=3, failed=2)
    ran.lines("FAILED test_inner.py::test_other_error - *")
    ran.lines("FAILED test_inner.py::test_one_expected_one_not - *")


def test_pytest_exit_in_a_rank_ends_the_session_with_its_code(inner) -> None:
    ran = inner(
        """
        import pytest

        def test_before():
            pass

        @pytest.mark.multirank(world_size=2)
        def test_stops(rank):
            pytest.exit("stop everything", returncode=3)

        @pytest.mark.multirank(world_size=2)
        def test_never_runs(rank):
            pass
        """,
        subprocess=True,
    )
    assert ran.result.ret == 3
    ran.result.assert_outcomes(passed=1)
    ran.lines("*! _pytest.outcomes.Exit: stop everything !*")
    assert "test_never_runs" not in ran.text


def test_what_matches_a_failure_sees_the_exception_the_ranks_raised(inner) -> None:
    # pytest-rerunfailures' --only-rerun / --rerun-except and a flaky marker's filters match
    # the exception: a multirank failure carries the failing rank's own as its cause
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_assert(rank):
            assert rank == 7

        @pytest.mark.flaky(reruns=2, only_rerun=ConnectionError)
        @pytest.mark.multirank(world_size=2)
        def test_connection(rank):
            raise ConnectionError("flaky network")

        @pytest.mark.flaky(reruns=2, only_rerun=ConnectionError)
        @pytest.mark.multirank(world_size=2)
        def test_value(rank):
            raise ValueError("not flaky")
        """,
        "--only-rerun",
        "AssertionError",
        "--reruns",
        "1",
    )
    ran.result.assert_outcomes(failed=3)
    # one rerun of the assertion, two of the connection error, none of the value error
    ran.lines("*3 failed, 3 rerun*")
