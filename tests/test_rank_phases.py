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


def test_a_rank_that_hangs_in_a_fixture_teardown_is_an_error_in_teardown(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def never_closes(rank):
            yield
            threading.Event().wait()  # a shutdown that never returns

        @pytest.fixture
        def closes_alone(rank):
            yield
            if rank == 0:
                dist.barrier()  # rank 1's teardown has no barrier

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_slow_teardown(rank, never_closes):
            pass

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_lonely_teardown(rank, closes_alone):
            pass

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_body_hangs(rank):
            if rank == 0:
                threading.Event().wait()
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=2, errors=2, failed=1)
    ran.lines(
        "*ERROR at teardown of test_slow_teardown*",
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: still running, in a fixture's teardown after its body passed",
        "    stuck at test_inner.py:8 in never_closes: threading.Event().wait()  # a shutdown that never returns",
    )
    ran.lines(
        "*ERROR at teardown of test_lonely_teardown*",
        "hang: the ranks were stopped after * s, not at the 30 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling barrier #1 on the default group; rank 0 waits in it",
        "  rank 0: blocked in barrier #1 on the default group for * s, in a fixture's teardown after its body passed",
    )
    # a hang in a body is FAILED, as before, and says nothing of teardown
    ran.lines("*_ test_body_hangs _*", "hang: the test did not finish within 3 s (2 ranks)", "  rank 0: still running")
    assert "ERROR test_inner.py::test_body_hangs" not in ran.text
