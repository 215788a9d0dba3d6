"""A multirank test reports each phase where it happened, as a plain test does: a fixture
that fails inside a rank is an ERROR at setup (or in teardown), a body that fails is FAILED."""

from __future__ import annotations

import textwrap


def test_a_fixture_that_fails_inside_a_rank_is_an_error_at_setup(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def dataset(rank):
            if rank == 1:
                raise OSError("rank 1 has no data")
            return [rank]

        @pytest.mark.multirank(world_size=2)
        def test_uses_it(rank, dataset):
            dist.barrier()

        def test_next():
            pass
        """,
        "-rA",
    )
    ran.result.assert_outcomes(errors=1, passed=1)
    ran.lines(
        "*ERROR at setup of test_uses_it*",
        "multirank test failed on rank 1 of 2",
        "*rank 1: failed in fixture setup: OSError: rank 1 has no data*",
    )
    ran.lines("*rank 1 (first failure): error in fixture setup inside the rank*", "*OSError: rank 1 has no data")
    ran.lines("ERROR test_inner.py::test_uses_it - rank 1: OSError: rank 1 has no data")


def test_a_fixture_whose_teardown_fails_inside_a_rank_is_an_error_in_teardown(inner) -> None:
    ran = inner(
        """
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def connection(rank):
            yield rank
            if rank == 0:
                raise RuntimeError("could not close")

        @pytest.mark.multirank(world_size=2)
        def test_uses_it(rank, connection):
            dist.barrier()
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines(
        "*ERROR at teardown of test_uses_it*", "*rank 0: failed in fixture teardown: RuntimeError: could not close*"
    )


def test_a_rank_whose_body_and_fixture_teardown_both_fail_reports_both(inner) -> None:
    # as pytest does for a plain test: the test fails, and its teardown is an error of its own
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def connection(rank):
            yield rank
            raise RuntimeError(f"could not close on {rank}")

        @pytest.mark.multirank(world_size=2)
        def test_uses_it(rank, connection):
            assert rank == 1, "the body fails on rank 0"

        @pytest.fixture
        def session(rank):
            yield
            if rank == 0:
                raise RuntimeError("no goodbye")

        @pytest.mark.multirank(world_size=2)
        def test_one_rank_fails_twice(rank, session):
            assert rank == 1, "rank 0 fails"
        """,
        "-rA",
    )
    ran.result.assert_outcomes(failed=2, errors=2)
    # the call is the body's failure alone: rank 1's body passed, its teardown is the error's
    ran.lines(
        "*_ test_uses_it _*",
        "multirank test failed on rank 0 of 2",
        "*rank 0: failed: AssertionError*",
        "  rank 1: passed",
    )
    ran.lines(
        "*ERROR at teardown of test_one_rank_fails_twice*",
        "*rank 0: failed in fixture teardown: RuntimeError: no goodbye*",
    )
    ran.lines("*rank 0: failed: AssertionError: the body fails on rank 0*")
    ran.lines(
        "*ERROR at teardown of test_uses_it*",
        "*rank 0: failed in fixture teardown: RuntimeError: could not close on 0*",
    )
    ran.lines("*rank 1: failed in fixture teardown: RuntimeError: could not close on 1*")


def test_a_body_that_fails_is_still_failed_and_fixtures_that_work_stay_quiet(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def value(rank):
            yield rank * 10

        @pytest.mark.multirank(world_size=2)
        def test_body(rank, value):
            assert value == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("*rank 1: failed: assert 10 == 0*")
    ran.no_lines("*fixture setup*")


def test_a_failed_test_whose_rank_a_fault_or_a_peer_takes_out_in_teardown_stays_failed(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def marks_in_teardown(rank, recorder):
            yield
            recorder.mark("teardown")

        @pytest.mark.multirank(world_size=2)
        def test_killed_in_teardown(rank, faults, marks_in_teardown):
            faults.kill(rank=1, at="mark:teardown")  # a fault taking a rank out is no failure...
            assert rank == 0, "the body failed first"  # ...but this one had failed already

        @pytest.fixture
        def dies0(rank):
            yield
            if rank == 0:
                os._exit(4)

        @pytest.mark.multirank(world_size=2)
        def test_peer_gone_then_dies(rank, dies0):
            if rank == 1:
                os._exit(3)
            dist.barrier()

        REC = __import__("pytest_ddphooks").Recorder()  # made in the pytest process

        @pytest.mark.multirank(world_size=2)
        def test_module_recorder(rank):
            with REC:
                REC.mark("hello")
            assert [e.name for e in REC.timeline().events] == ["hello"]
        """
    )
    ran.result.assert_outcomes(failed=2, passed=1)
    ran.lines("*_ test_killed_in_teardown _*", "*", "multirank test failed on rank 1 of 2", "*", "  rank 1: failed: *")
    ran.lines(
        "*_ test_peer_gone_then_dies _*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: failed after rank 1, because its peer went away: *",
        "*",
        "  rank 1: died (exit code 3)",
    )
    ran.lines("FAILED test_inner.py::test_peer_gone_then_dies - rank 1 died (exit code 3)")
    ran.no_lines("*recorded in process*")


def test_a_skipped_or_xfailed_rank_whose_teardown_fails_reports_the_error(inner) -> None:
    # as pytest does for a plain test: skipped (or xfailed), and an error at teardown
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def closes_badly(rank):
            yield
            if rank == 1:
                raise RuntimeError("could not close on rank 1")

        @pytest.mark.multirank(world_size=2)
        def test_skipped(rank, closes_badly):
            pytest.skip("not on this machine")

        @pytest.mark.multirank(world_size=2)
        def test_xfailed(rank, closes_badly):
            pytest.xfail("known")

        @pytest.fixture
        def closes_well(rank):
            yield

        @pytest.mark.multirank(world_size=2)
        def test_skipped_cleanly(rank, closes_well):
            pytest.skip("not on this machine")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(skipped=2, xfailed=1, errors=2)
    ran.lines(
        "*ERROR at teardown of test_skipped*",
        "*rank 1: failed in fixture teardown: RuntimeError: could not close on rank 1*",
    )
    ran.lines("ERROR test_inner.py::test_skipped - rank 1: RuntimeError*")
    ran.lines("ERROR test_inner.py::test_xfailed - rank 1: RuntimeError*")
    ran.no_lines("ERROR test_inner.py::test_skipped_cleanly*")


def test_a_rank_that_dies_in_a_fixture_teardown_is_an_error_in_teardown(inner) -> None:
    ran = inner(
        """
        import os
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def server(rank):
            yield
            if rank == 1:
                os._exit(3)  # a native library's shutdown that kills the process

        @pytest.mark.multirank(world_size=2)
        def test_uses_it(rank, server):
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_body_dies(rank):
            if rank == 0:
                os._exit(4)
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1, errors=1, failed=1)
    ran.lines(
        "*ERROR at teardown of test_uses_it*",
        "multirank test failed on rank 1 of 2",
        "  rank 1: died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its body passed",
    )
    # a rank that dies in its body is FAILED, as before
    ran.lines("*_ test_body_dies _*", "multirank test failed on rank 0 of 2", "  rank 0: died (exit code 4)")


def test_a_rank_whose_test_failed_then_died_or_hung_in_teardown_still_shows_the_failure(inner, pytester) -> None:
    ran = inner(
        """
        import os
        import time
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.fixture
        def stuck(rank):
            yield
            if rank == 1:
                dist.barrier()  # rank 0 has finished: nobody comes

        @pytest.fixture
        def sleeps(rank):
            yield
            if rank == 1:
                time.sleep(60)

        @pytest.fixture
        def fine(rank):
            yield

        @pytest.mark.multirank(world_size=2)
        def test_then_dies(rank, dies):
            assert rank == 0, "failed in the body first"

        @pytest.mark.multirank(world_size=2)
        def test_then_stalls(rank, stuck):
            assert rank == 0, "failed in the body first"

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_then_hangs(rank, sleeps):
            assert rank == 0, "failed in the body first"

        @pytest.mark.multirank(world_size=2)
        def test_plain(rank, fine):
            assert rank == 0, "failed in the body first"
        """,
        "--junitxml=junit.xml",
    )
    ran.result.assert_outcomes(failed=4)
    ran.lines(
        "*_ test_then_dies _*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: passed",
        "  rank 1: failed: AssertionError: failed in the body first",
        "    then died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its test had failed (below)",
        "",
        "*- rank 1 -*",
        "*",
        '>       assert rank == 0, "failed in the body first"',
    )
    ran.lines(
        "*_ test_then_stalls _*",
        "hang: the ranks were stopped after * s, not at the * s limit: they wait for ranks that finished the test",
        "*",
        "  rank 0: finished the test body (passed), then waited for the other ranks",
        "  rank 1: blocked in barrier #1 on the default group for * s,"
        " in a fixture's teardown after its test failed (below)",
        "*",
        "*",
        "*- rank 1 -*",
        "*",
        '>       assert rank == 0, "failed in the body first"',
    )
    ran.lines(
        "*_ test_then_hangs _*",
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: finished the test body (passed), then waited for the other ranks",
        "  rank 1: still running, in a fixture's teardown after its test failed (below)",
        "    stuck at test_inner.py:22 in sleeps: time.sleep(60)",
        "",
        "*- rank 1 -*",
    )
    ran.lines(
        "FAILED test_inner.py::test_then_dies - rank 1: AssertionError: failed in the *",
    )
    # junit's message says it on its first line, as a summary shows only that one
    junit = (pytester.path / "junit.xml").read_text()
    assert (
        'message="rank 1: AssertionError: failed in the body first (then it died in fixture teardown: exit code 3)'
        in junit
    )
    # a test that failed and tore down well says nothing of its teardown
    plain = ran.text.split("_ test_plain _")[1].split("generated xml file")[0]
    assert "fixture teardown" not in plain and "fixture's teardown" not in plain and "died" not in plain, plain


def test_a_rank_tells_its_code_which_phase_runs_as_pytest_does(inner) -> None:
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def phases(rank):
            seen = [os.environ["PYTEST_CURRENT_TEST"]]
            yield seen
            seen.append(os.environ["PYTEST_CURRENT_TEST"])
            assert seen == [
                "test_inner.py::test_phases (setup)",
                "test_inner.py::test_phases (call)",
                "test_inner.py::test_phases (teardown)",
            ], seen

        @pytest.mark.multirank(world_size=2)
        def test_phases(rank, phases):
            phases.append(os.environ["PYTEST_CURRENT_TEST"])
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_what_a_rank_logged_in_teardown_is_shown_once(inner) -> None:
    ran = inner(
        """
        import logging
        import pytest

        @pytest.fixture
        def fx(rank):
            yield
            logging.getLogger("proj").warning("fx teardown r%d", rank)

        @pytest.mark.multirank(world_size=2)
        def test_out(fx, rank):
            assert rank == 0
        """
    )
    ran.result.assert_outcomes(failed=1)
    text = ran.result.stdout.str()
    assert text.count("Captured log rank 1 teardown") == 1, text
    assert text.count("fx teardown r1") == 1, text


def test_a_skipped_or_xfailed_rank_that_then_dies_in_teardown_keeps_its_outcome_and_errs_in_teardown(inner) -> None:
    # as pytest says of a plain test whose teardown errs after a skip: skipped (or xfailed), and an error
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.fixture
        def fine(rank):
            yield

        @pytest.mark.multirank(world_size=2)
        def test_skip_then_dies(rank, dies):
            pytest.skip("not on this machine")

        @pytest.mark.multirank(world_size=2)
        def test_xfail_then_dies(rank, dies):
            pytest.xfail("known")

        @pytest.mark.xfail(reason="known by the marker", raises=AssertionError)
        @pytest.mark.multirank(world_size=2)
        def test_xfail_marker_then_dies(rank, dies):
            assert rank < 0, "fails as expected"

        @pytest.mark.multirank(world_size=2)
        def test_skipped_cleanly(rank, fine):
            pytest.skip("not on this machine")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(skipped=2, xfailed=2, errors=3)
    ran.lines(
        "*ERROR at teardown of test_skip_then_dies*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: skipped",
        "  rank 1: died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its body skipped",
    )
    ran.lines(
        "*ERROR at teardown of test_xfail_then_dies*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: xfailed",
        "  rank 1: died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its body xfailed",
    )
    # the marker expected the body's failure: the death after it is no part of what it expected
    ran.lines(
        "*ERROR at teardown of test_xfail_marker_then_dies*",
        "multirank test failed on ranks 0,1 of 2",
        "  rank 0: failed: AssertionError: fails as expected*",
        "  rank 1: failed: AssertionError: fails as expected*",
        "    then died in fixture teardown (exit code 3)",
    )
    ran.lines("SKIPPED [[]1[]] test_inner.py:16: not on this machine")
    ran.lines("XFAIL test_inner.py::test_xfail_then_dies - known")
    ran.lines("XFAIL test_inner.py::test_xfail_marker_then_dies - known by the marker")
    ran.lines("ERROR test_inner.py::test_skip_then_dies - rank 1 died (exit code 3)")
    ran.lines("ERROR test_inner.py::test_xfail_then_dies - rank 1 died (exit code 3)")
    ran.lines("ERROR test_inner.py::test_xfail_marker_then_dies - rank 1: AssertionError*")
    ran.no_lines("*before it could report*")
    ran.no_lines("ERROR test_inner.py::test_skipped_cleanly*")


def test_a_skipped_or_xfailed_rank_that_then_hangs_in_teardown_keeps_its_outcome_and_errs_in_teardown(inner) -> None:
    ran = inner(
        """
        import time
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def sleeps(rank):
            yield
            if rank == 1:
                time.sleep(60)

        @pytest.fixture
        def stuck(rank):
            yield
            if rank == 1:
                dist.barrier()  # rank 0 has finished: nobody comes

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_skip_then_hangs(rank, sleeps):
            pytest.skip("not on this machine")

        @pytest.mark.multirank(world_size=2)
        def test_xfail_then_stalls(rank, stuck):
            pytest.xfail("known")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(skipped=1, xfailed=1, errors=2)
    ran.lines(
        "*ERROR at teardown of test_skip_then_hangs*",
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: finished the test body (skipped), then waited for the other ranks",
        "  rank 1: still running, in a fixture's teardown after its body skipped",
        "    stuck at test_inner.py:9 in sleeps: time.sleep(60)",
    )
    ran.lines(
        "*ERROR at teardown of test_xfail_then_stalls*",
        "hang: the ranks were stopped after * s, not at the * s limit: they wait for ranks that finished the test",
        "*",
        "  rank 0: finished the test body (xfailed), then waited for the other ranks",
        "  rank 1: blocked in barrier #1 on the default group for * s, in a fixture's teardown after its body xfailed",
    )
    ran.lines("SKIPPED [[]1[]] test_inner.py:19: not on this machine")
    ran.lines("XFAIL test_inner.py::test_xfail_then_stalls - known")


def test_a_skip_on_some_ranks_stays_the_call_beside_another_ranks_teardown_error(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def closes_badly(rank):
            yield
            if rank == 1:
                raise RuntimeError("could not close on rank 1")

        @pytest.fixture
        def fine(rank):
            yield

        @pytest.mark.multirank(world_size=2)
        def test_some_skip(rank, closes_badly):
            if rank == 0:
                pytest.skip("no data on rank 0")

        @pytest.mark.multirank(world_size=2)
        def test_some_xfail(rank, closes_badly):
            if rank == 0:
                pytest.xfail("rank 0 knows it fails")

        @pytest.mark.multirank(world_size=2)
        def test_some_skip_cleanly(rank, fine):
            if rank == 0:
                pytest.skip("no data on rank 0")
        """,
        "-rA",
    )
    ran.result.assert_outcomes(skipped=2, xfailed=1, errors=2)
    ran.lines("SKIPPED [[]1[]] test_inner.py:16: no data on rank 0 (on rank 0; the other ranks pas*")
    ran.lines("XFAIL test_inner.py::test_some_xfail - rank 0 knows it fails (on rank 0; the oth*")
    ran.lines(
        "*ERROR at teardown of test_some_skip*",
        "*rank 1: failed in fixture teardown: RuntimeError: could not close on rank 1*",
    )
    ran.lines("ERROR test_inner.py::test_some_skip - rank 1: RuntimeError: could not close*")
    ran.lines("ERROR test_inner.py::test_some_xfail - rank 1: RuntimeError: could not*")
    ran.no_lines("PASSED test_inner.py::test_some_skip*")
    ran.no_lines("ERROR test_inner.py::test_some_skip_cleanly*")


def test_an_xfail_marker_judges_another_ranks_teardown_error_at_teardown_as_pytest_does(inner) -> None:
    # the body's failure is the call's, another rank's teardown error is the teardown's, where
    # the marker judges it as pytest judges a plain test's: an xfail without raises= takes it too
    # ("XFAIL at teardown"), one with raises= it does not match leaves it an error
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def closes_badly(rank):
            yield
            if rank == 1:
                raise RuntimeError("could not close on rank 1")

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.fixture
        def closes_badly_plain():
            yield
            raise RuntimeError("could not close")

        @pytest.mark.xfail(reason="rank 0 is known to fail")
        @pytest.mark.multirank(world_size=2)
        def test_marked(rank, closes_badly):
            assert rank == 1, "rank 0 fails"

        @pytest.mark.xfail(reason="known to fail")
        def test_plain_marked(closes_badly_plain):
            assert False

        @pytest.mark.xfail(reason="rank 0 is known to fail", raises=AssertionError)
        @pytest.mark.multirank(world_size=2)
        def test_marked_raises(rank, closes_badly):
            assert rank == 1, "rank 0 fails"

        @pytest.mark.xfail(reason="known to fail", raises=AssertionError)
        def test_plain_marked_raises(closes_badly_plain):
            assert False

        @pytest.mark.xfail(reason="rank 0 is known to fail")
        @pytest.mark.multirank(world_size=2)
        def test_marked_then_dies(rank, dies):
            assert rank == 1, "rank 0 fails"

        @pytest.mark.xfail(reason="rank 0 is known to fail", raises=AssertionError)
        @pytest.mark.multirank(world_size=2)
        def test_marked_raises_then_dies(rank, dies):
            assert rank == 1, "rank 0 fails"

        @pytest.mark.multirank(world_size=2)
        def test_unmarked(rank, closes_badly):
            assert rank == 1, "rank 0 fails"
        """,
        "-rA",
    )
    ran.result.assert_outcomes(xfailed=9, failed=1, errors=4)
    for name in ("test_marked", "test_plain_marked", "test_marked_then_dies"):
        ran.lines(f"XFAIL test_inner.py::{name} - *known to fail")
        ran.lines(f"XFAIL at teardown of test_inner.py::{name} - *known to fail")
    for name in ("test_marked_raises", "test_plain_marked_raises", "test_marked_raises_then_dies"):
        ran.lines(f"XFAIL test_inner.py::{name} - *known to fail")
        ran.no_lines(f"XFAIL at teardown of test_inner.py::{name} *")
    for name in ("test_marked_raises", "test_unmarked"):
        ran.lines(
            f"*ERROR at teardown of {name} *",
            "multirank test failed on rank 1 of 2",
            "*rank 1: failed in fixture teardown: RuntimeError: could not close on rank 1*",
        )
        ran.lines(f"ERROR test_inner.py::{name} - rank 1: RuntimeError: *")
    ran.lines("ERROR test_inner.py::test_plain_marked_raises - RuntimeError: could not close")
    ran.lines(
        "*ERROR at teardown of test_marked_raises_then_dies*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: its body failed (see the call)",
        "  rank 1: died in fixture teardown (exit code 3)",
    )
    ran.lines("ERROR test_inner.py::test_marked_raises_then_dies - rank 1 died (exit code 3)*")
    ran.lines("FAILED test_inner.py::test_unmarked - rank 0: AssertionError: rank 0 fails*")
    # the call's failure is the body's alone
    unmarked = ran.text.split("_ test_unmarked _")[1].split("short test summary info")[0]
    assert "could not close" not in unmarked, unmarked


def test_a_body_failure_then_a_death_in_teardown_is_not_restarted(inner) -> None:
    # a failure is the test's outcome, not a death to restart: the death is its teardown story,
    # on the failed rank or on another whose body had passed
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.mark.multirank(world_size=2, restarts=1)
        def test_then_dies(rank, dies, restart_count):
            print(f"attempt {restart_count} on rank {rank}")
            assert rank == 0, "failed in the body first"

        @pytest.mark.multirank(world_size=2, restarts=1)
        def test_fails_beside(rank, dies, restart_count):
            print(f"attempt {restart_count} on rank {rank}")
            assert rank == 1, "rank 0 fails in its body"
        """,
        "-rA",
    )
    ran.result.assert_outcomes(failed=2, errors=1)
    ran.lines(
        "*_ test_then_dies _*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: passed",
        "  rank 1: failed: AssertionError: failed in the body first",
        "    then died in fixture teardown (exit code 3)",
    )
    ran.lines("FAILED test_inner.py::test_then_dies - rank 1: AssertionError: failed in the *")
    ran.lines("ERROR test_inner.py::test_fails_beside - rank 1 died (exit code 3)")
    ran.lines("FAILED test_inner.py::test_fails_beside - rank 0: AssertionError: rank 0 fail*")
    ran.no_lines("*attempt 1 on rank*")
    ran.no_lines("*Captured attempts*")


def test_which_deaths_a_restart_stands_for() -> None:
    """A restart stands for a death, never for a failure: judged on the runs' reports alone."""
    from pytest_ddphooks.plugin.multirank import _death
    from pytest_ddphooks.report import RankExit, RankResult, RunReport

    def run(**results: RankResult) -> RunReport:
        report = RunReport(2, 10.0, results={int(r[1:]): res for r, res in results.items()})
        report.exits = {0: RankExit(0, 100, 3, None), 1: RankExit(1, 101, 0, None)}
        report.first_failure = 1 if "r1" in results and results["r1"].outcome == "failed" else None
        return report

    gone = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242"
    # rank 0 died mid-body: rank 1's failure is a consequence
    assert _death(run(r1=RankResult(1, "failed", message=gone)), body_passed=set())
    # rank 0's body passed, then it died in teardown (it served the store): rank 1 failed of that
    assert _death(run(r1=RankResult(1, "failed", message=gone)), body_passed={0})
    # ... while everyone else passed: a death as ever
    assert _death(run(r1=RankResult(1, "passed")), body_passed={0})
    # ... beside rank 1's failure of its own, which came first: the test's outcome
    assert not _death(run(r1=RankResult(1, "failed", message="AssertionError: no")), body_passed={0})
    # its own failure, told before it died in teardown
    told = run(r1=RankResult(1, "passed"))
    told.before_teardown = {0: RankResult(0, "failed", message="AssertionError: no")}
    assert not _death(told, body_passed=set())
    # its failure reported in full, then it crashed as it left
    crashed = run(r0=RankResult(0, "failed", message="AssertionError: no"), r1=RankResult(1, "passed"))
    assert not _death(crashed, body_passed=set())


def test_an_xfail_with_raises_judges_another_ranks_teardown_error_by_its_type_as_pytest_does(inner) -> None:
    # pytest checks raises= against a plain test's teardown exception too: each multirank test
    # ends as its plain twin, the rank's teardown error being the twin's
    ran = inner(
        """
        import pytest

        @pytest.fixture
        def closes_badly(rank):
            yield
            if rank == 1:
                raise RuntimeError("could not close on rank 1")

        @pytest.fixture
        def closes_badly_plain():
            yield
            raise RuntimeError("could not close")

        known = pytest.mark.xfail(reason="known", raises=RuntimeError)

        @known
        @pytest.mark.multirank(world_size=2)
        def test_raises_beside(rank, closes_badly):
            if rank == 0:
                raise RuntimeError("body")

        @known
        def test_plain_raises(closes_badly_plain):
            raise RuntimeError("body")

        @known
        @pytest.mark.multirank(world_size=2)
        def test_asserts_beside(rank, closes_badly):
            assert rank == 1, "rank 0 fails"

        @known
        def test_plain_asserts(closes_badly_plain):
            assert False, "fails"

        @known
        @pytest.mark.multirank(world_size=2)
        def test_passes_beside(rank, closes_badly):
            pass

        @known
        def test_plain_passes(closes_badly_plain):
            pass
        """,
        "-rA",
    )
    ran.result.assert_outcomes(xfailed=8, failed=2, xpassed=2)
    for name in ("test_raises_beside", "test_plain_raises"):
        ran.lines(f"XFAIL test_inner.py::{name} - known")
    for name in ("test_asserts_beside", "test_plain_asserts"):
        ran.lines(f"FAILED test_inner.py::{name} - *AssertionError*")
    for name in ("test_passes_beside", "test_plain_passes"):
        ran.lines(f"XPASS test_inner.py::{name} - known")
    for name in ("raises_beside", "plain_raises", "asserts_beside", "plain_asserts", "passes_beside", "plain_passes"):
        ran.lines(f"XFAIL at teardown of test_inner.py::test_{name} - known")
    ran.no_lines("ERROR *")


CLOSES_BADLY_ON_1 = """
import threading

import pytest
import torch.distributed as dist


@pytest.fixture
def closes_badly(rank):
    yield
    if rank == 1:
        raise RuntimeError("could not close on rank 1")
"""


def test_a_body_failure_beside_another_ranks_teardown_error_names_each_rank_truthfully_in_both(inner) -> None:
    ran = inner(
        CLOSES_BADLY_ON_1
        + textwrap.dedent(
            """
        @pytest.mark.multirank(world_size=2)
        def test_fail_beside_error(rank, closes_badly):
            assert rank == 1, "rank 0 fails"

        @pytest.fixture
        def group_td(rank):
            yield
            if rank == 1:
                dist.barrier()  # rank 0 left after its failure: nobody comes
            else:
                dist.destroy_process_group()

        @pytest.mark.multirank(world_size=2)
        def test_fail_then_peer_gone_in_teardown(rank, group_td):
            assert rank == 1, "rank 0 fails"
        """
        ),
        "-rA",
    )
    ran.result.assert_outcomes(failed=2, errors=1)
    ran.lines(
        "*ERROR at teardown of test_fail_beside_error*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: its body failed (see the call)",
        "  rank 1: failed in fixture teardown: RuntimeError: could not close on rank 1",
    )
    ran.lines(
        "*_ test_fail_beside_error _*",
        "multirank test failed on rank 0 of 2",
        "  rank 0: failed: AssertionError: rank 0 fails",
        "  rank 1: body passed; its fixture teardown failed (see the error at teardown)",
    )
    # rank 1's teardown error is a consequence of rank 0's failure: one failure, told as ever
    ran.lines(
        "*_ test_fail_then_peer_gone_in_teardown _*",
        "multirank test failed on rank 0 of 2",
        "  rank 0: failed: AssertionError: rank 0 fails",
        "  rank 1: failed after rank 0, because its peer went away: RuntimeError: *",
        "    at test_inner.py:* in group_td: dist.barrier()*",
    )
    section = ran.text.split("_ test_fail_then_peer_gone_in_teardown _")[1].split("short test summary info")[0]
    assert "recorded timeline:" in section, section
    ran.no_lines("*ERROR at teardown of test_fail_then_peer_gone_in_teardown*")
    ran.no_lines("  rank ?: passed")


def test_beside_a_teardown_error_a_stopped_rank_is_stopped_and_a_setup_skip_is_the_setups(inner) -> None:
    ran = inner(
        CLOSES_BADLY_ON_1
        + textwrap.dedent(
            """
        @pytest.mark.multirank(world_size=3)
        def test_third_rank_never_ends(rank, closes_badly):
            if rank == 2:
                threading.Event().wait()  # stopped by the harness once the others failed
            assert rank != 0, "rank 0 fails"

        @pytest.fixture
        def skips_on_1(rank):
            if rank == 1:
                pytest.skip("no data on rank 1")

        @pytest.mark.multirank(world_size=2)
        def test_setup_skip_beside(rank, closes_badly, skips_on_1):
            assert rank != 0, "rank 0 fails"
        """
        ),
        "-rA",
    )
    ran.result.assert_outcomes(failed=2, errors=2)
    # the stopped rank is stopped in both reports, never dead nor "body passed"
    ran.lines(
        "*ERROR at teardown of test_third_rank_never_ends*",
        "multirank test failed on rank 1 of 3",
        "  rank 0: its body failed (see the call)",
        "  rank 1: failed in fixture teardown: RuntimeError: could not close on rank 1",
        "  rank 2: stopped after rank ? failed; it was running",
    )
    ran.lines(
        "*_ test_third_rank_never_ends _*",
        "multirank test failed on rank 0 of 3",
        "  rank 0: failed: AssertionError: rank 0 fails",
        "  rank 1: body passed; its fixture teardown failed (see the error at teardown)",
        "  rank 2: stopped after rank ? failed; it was running",
    )
    ran.lines(
        "*_ test_setup_skip_beside _*",
        "multirank test failed on rank 0 of 2",
        "  rank 0: failed: AssertionError: rank 0 fails",
        "  rank 1: setup skipped; its fixture teardown failed (see the error at teardown)",
    )
    ran.no_lines("*rank 2: died*")


def test_a_teardown_error_does_not_cut_a_slower_peers_body_short(inner) -> None:
    ran = inner(
        CLOSES_BADLY_ON_1
        + textwrap.dedent(
            """
        import time

        @pytest.mark.multirank(world_size=2)
        def test_rank_0_is_slow(rank, closes_badly):
            if rank == 0:
                time.sleep(2)  # longer than the grace a failure gives its peers
        """
        ),
        "-rA",
    )
    # rank 0's body ran to its end and passed: the call passed, rank 1's teardown is the error
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines("*ERROR at teardown of test_rank_0_is_slow*", "multirank test failed on rank 1 of 2")
    ran.no_lines("*stopped after rank 1 failed*")


def test_a_skip_in_a_fixtures_setup_then_a_death_in_teardown_is_skipped_and_an_error_in_teardown(inner) -> None:
    # as the plain twin: SKIPPED, and an ERROR at teardown
    ran = inner(
        """
        import os
        import time
        import pytest

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.fixture
        def sleeps(rank):
            yield
            if rank == 1:
                time.sleep(60)

        @pytest.fixture
        def skips_on_1(rank):
            if rank == 1:
                pytest.skip("setup skip on rank 1")
            yield

        @pytest.mark.multirank(world_size=2)
        def test_setup_skip_then_death(rank, dies, skips_on_1):
            pass

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_setup_skip_then_hang(rank, sleeps, skips_on_1):
            pass

        @pytest.fixture
        def errs():
            yield
            raise RuntimeError("teardown")

        @pytest.fixture
        def skips():
            pytest.skip("setup skip")

        def test_plain_twin(errs, skips):
            pass
        """,
        "-rA",
    )
    ran.result.assert_outcomes(skipped=3, errors=3)
    ran.lines("SKIPPED [[]2[]] test_inner.py:*: setup skip on rank 1 (on rank 1; the other ranks passed)")
    ran.lines(
        "*ERROR at teardown of test_setup_skip_then_death*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: passed",
        "  rank 1: died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its setup skipped",
    )
    ran.lines(
        "*ERROR at teardown of test_setup_skip_then_hang*",
        "hang: the test did not finish within 3 s (2 ranks)",
        "*",
        "  rank 1: still running, in a fixture's teardown after its setup skipped",
    )
    ran.lines("ERROR test_inner.py::test_setup_skip_then_death - rank 1 died (exit code 3)")
    ran.no_lines("*ERROR at setup of test_setup_skip_then_*")
    ran.no_lines("*body skipped*")


def test_a_death_in_teardown_beside_another_ranks_body_failure_is_the_teardowns_error(inner) -> None:
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def dies(rank):
            yield
            if rank == 1:
                os._exit(3)

        @pytest.mark.multirank(world_size=2)
        def test_fail_beside_death(rank, dies):
            assert rank == 1, "rank 0 fails"
        """,
        "-rA",
    )
    ran.result.assert_outcomes(failed=1, errors=1)
    ran.lines(
        "*ERROR at teardown of test_fail_beside_death*",
        "multirank test failed on rank 1 of 2",
        "  rank 0: its body failed (see the call)",
        "  rank 1: died in fixture teardown (exit code 3)",
        "",
        "rank 1 died: exit code 3 in a fixture's teardown, after its body passed",
    )
    ran.lines(
        "*_ test_fail_beside_death _*",
        "multirank test failed on rank 0 of 2",
        "  rank 0: failed: AssertionError: rank 0 fails",
        "  rank 1: body passed; its fixture teardown failed (see the error at teardown)",
    )
    ran.lines("FAILED test_inner.py::test_fail_beside_death - rank 0: AssertionError*")
    ran.lines("ERROR test_inner.py::test_fail_beside_death - rank 1 died (exit code 3)")
