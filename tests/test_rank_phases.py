"""A multirank test reports each phase where it happened, as a plain test does: a fixture
that fails inside a rank is an ERROR at setup (or in teardown), a body that fails is FAILED."""

from __future__ import annotations


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
