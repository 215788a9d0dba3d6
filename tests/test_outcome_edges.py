"""A multirank test gets the outcome a plain test of the same code gets, in the corners of
pytest a user meets: output no encoding can write, finalizers the body adds, what plugins
read from ``item.funcargs``, pytest-side fixtures that hang, two failing teardowns."""

from __future__ import annotations

import json
import os


def test_printing_a_lone_surrogate_passes_as_in_a_plain_test(inner) -> None:
    ran = inner(
        """
        import os
        import sys
        import pytest

        def list_and_print(folder):
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(os.fsencode(folder), b"data_\\xff.bin"), "wb").close()
            for name in os.listdir(folder):
                print("found", name)
            sys.stderr.write("err " + name + "\\n")

        def test_plain(tmp_path):
            list_and_print(str(tmp_path / "d"))

        @pytest.mark.multirank(world_size=2)
        def test_multirank(rank, tmp_path):
            list_and_print(str(tmp_path / f"d{rank}"))
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=2)
    ran.lines("*Captured stdout rank 0 call*", "found data_?.bin", "*Captured stderr rank 0 call*", "err data_?.bin")


def test_a_finalizer_the_body_adds_runs_in_each_rank_at_teardown(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_finalizers(rank, request):
            request.addfinalizer(lambda: print(f"request finalizer on rank {rank}"))
            request.node.addfinalizer(lambda: print(f"node finalizer on rank {rank}"))
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    # last added, first run, as pytest runs them
    for rank in (0, 1):
        ran.lines(
            f"*Captured stdout rank {rank} teardown*",
            f"node finalizer on rank {rank}",
            f"request finalizer on rank {rank}",
        )


def test_item_funcargs_in_a_rank_holds_autouse_and_usefixtures_values(inner, pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(autouse=True)
        def auto_fx():
            return "auto"

        @pytest.fixture
        def used_fx():
            return "used"

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(pyfuncitem):
            # what a plugin such as anyio reads before calling the test
            print("funcargs:", sorted(k for k in pyfuncitem.funcargs if k.endswith("_fx")))
        """
    )
    ran = inner(
        """
        import pytest

        @pytest.mark.usefixtures("used_fx")
        @pytest.mark.multirank(world_size=2)
        def test_it(rank):
            pass
        """,
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    ran.lines("*Captured stdout rank 0 call*", "funcargs: ['auto_fx', 'used_fx']")


def test_a_pytest_side_fixture_that_hangs_fails_at_the_limit_of_pytest_timeout(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest

        @pytest.fixture
        def hangs_in_setup():
            threading.Event().wait()

        @pytest.fixture
        def hangs_in_teardown():
            yield
            threading.Event().wait()

        @pytest.mark.multirank(world_size=2)
        def test_setup_hangs(hangs_in_setup, rank):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_teardown_hangs(hangs_in_teardown, rank):
            pass

        @pytest.fixture
        def quick():
            yield 1

        @pytest.mark.multirank(world_size=2)
        def test_within_the_limit(quick, rank):
            assert quick == 1
        """,
        "--timeout=2",
        "-p",
        "no:randomly",
    )
    ran.result.assert_outcomes(passed=2, errors=2)
    ran.lines(
        "*ERROR at setup of test_setup_hangs*",
        "E*Failed: Timeout (>2.0s) from pytest-timeout, in the setup of this multirank test's fixtures that run"
        " in the pytest process",
    )
    ran.lines(
        "*ERROR at teardown of test_teardown_hangs*",
        "E*Failed: Timeout (>2.0s) from pytest-timeout, in the teardown of this multirank test's fixtures*",
    )
    assert ran.seconds < 30


def test_the_marker_timeout_limits_a_pytest_side_fixture_too(inner) -> None:
    ran = inner(
        """
        import threading
        import pytest

        @pytest.fixture
        def hangs():
            threading.Event().wait()

        @pytest.mark.multirank(world_size=2, timeout=1.5)
        def test_it(hangs, rank):
            pass
        """
    )
    ran.result.assert_outcomes(errors=1)
    ran.lines("E*Failed: Timeout (>1.5s) from multirank(timeout=1.5), in the setup*")


def test_a_rank_teardown_error_and_a_pytest_side_one_are_both_reported(inner, pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def rank_side(rank):
            yield
            if rank == 1:
                raise RuntimeError("rank-side teardown failed on rank 1")

        @pytest.fixture
        def py_side():
            yield
            raise RuntimeError("pytest-side teardown failed")
        """
    )
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_two_teardowns(rank_side, py_side):
            pass
        """
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines("*errors while tearing down <Function test_two_teardowns>*")
    ran.lines("*MultirankFailed: rank 1: RuntimeError: rank-side teardown failed on rank 1")
    ran.lines("*RuntimeError: pytest-side teardown failed")


def test_a_teardown_error_shows_the_fixtures_frame_not_the_plugins(inner, pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def py_side():
            yield
            raise RuntimeError("pytest-side teardown failed")

        @pytest.fixture
        def rank_side(rank):
            yield
            raise RuntimeError("rank-side teardown failed")
        """
    )
    ran = inner(
        """
        import pytest

        def test_plain(py_side):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_multirank(rank_side):
            pass
        """
    )
    ran.result.assert_outcomes(passed=2, errors=2)
    ran.lines('>*raise RuntimeError("pytest-side teardown failed")')
    ran.no_lines("*pytest_ddphooks/plugin/*")


def test_every_failed_test_gets_a_trace_file_of_its_own(inner, pytester) -> None:
    traces = pytester.path / "tr"
    ran = inner(
        """
        import pytest

        @pytest.mark.parametrize("path", ["a/b", "a_b", "x" * 150 + "1", "x" * 150 + "2"])
        @pytest.mark.multirank(world_size=2)
        def test_load(rank, path):
            assert rank == 0
        """,
        f"--ddp-trace-dir={traces}",
    )
    ran.result.assert_outcomes(failed=4)
    names = sorted(os.listdir(traces))
    assert len(names) == 4, names
    for name in names:
        assert len(name) < 130
        with open(traces / name) as f:
            assert json.load(f)["traceEvents"]


def test_xfail_raises_matches_an_exception_class_defined_in_the_test(inner) -> None:
    ran = inner(
        """
        import pytest

        @pytest.mark.xfail(raises=TypeError)
        @pytest.mark.multirank(world_size=2)
        def test_local_subclass(rank):
            class ShapeError(TypeError):
                pass
            raise ShapeError("bad shape")

        @pytest.mark.xfail(raises=ValueError)
        @pytest.mark.multirank(world_size=2)
        def test_local_subclass_of_another(rank):
            class ShapeError(TypeError):
                pass
            raise ShapeError("bad shape")
        """
    )
    ran.result.assert_outcomes(xfailed=1, failed=1)
    ran.lines("FAILED test_inner.py::test_local_subclass_of_another - ranks 0,1 failed*")
    ran.lines("*ShapeError: bad shape")


def test_only_plain_autouse_values_travel_for_item_funcargs(inner, pytester) -> None:
    pickled = pytester.path / "pickled"
    pytester.makeconftest(
        f"""
        import pytest

        class Costly:
            def __reduce__(self):
                with open({str(pickled)!r}, "a") as f:
                    f.write("pickled\\n")
                return (Costly, ())

        @pytest.fixture(scope="session")
        def dataset():
            return Costly()

        @pytest.fixture
        def model(dataset):
            return 1

        @pytest.fixture(autouse=True)
        def registry_entry():
            return Costly()  # not plain data: never sent, never needed

        @pytest.fixture(autouse=True)
        def backend():
            return ("asyncio", {{"debug": True}})
        """
    )
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_it(rank, model, request):
            assert model == 1
            assert request.node.funcargs["backend"] == ("asyncio", {"debug": True})
            assert "registry_entry" not in request.node.funcargs
            assert "dataset" not in request.node.funcargs
        """
    )
    ran.result.assert_outcomes(passed=1)
    assert not pickled.exists(), "a value the ranks never ask for was pickled"


def test_pytest_timeout_func_only_leaves_the_fixtures_unlimited(inner) -> None:
    ran = inner(
        """
        import time
        import pytest

        @pytest.fixture
        def slow_teardown():
            yield
            time.sleep(2.5)

        @pytest.mark.timeout(1.5, func_only=True)
        @pytest.mark.multirank(world_size=2)
        def test_multirank(rank, slow_teardown):
            pass
        """
    )
    ran.result.assert_outcomes(passed=1)


def test_a_timer_a_fixture_runs_survives_the_limit_of_the_fixtures(inner) -> None:
    ran = inner(
        """
        import signal
        import time
        import pytest

        @pytest.fixture(scope="session")
        def sampler():
            ticks = []
            signal.signal(signal.SIGALRM, lambda *_: ticks.append(1))
            signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
            yield ticks
            signal.setitimer(signal.ITIMER_REAL, 0)

        @pytest.fixture
        def own_handler():
            signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a timer nobody set called this"))
            yield

        def test_first(sampler):
            pass

        @pytest.mark.multirank(world_size=2, timeout=30)
        def test_multirank(rank, sampler):
            pass

        def test_plain_after(sampler):
            before = len(sampler)
            time.sleep(0.5)
            assert len(sampler) > before, "the session's interval timer was stopped"

        def test_stop_sampler(sampler):
            signal.setitimer(signal.ITIMER_REAL, 0)

        @pytest.mark.multirank(world_size=2, timeout=1)
        def test_handler_without_timer(rank, own_handler):
            pass

        def test_nothing_fires_later():
            time.sleep(1.5)
        """,
        "-p",
        "no:randomly",
    )
    ran.result.assert_outcomes(passed=6)


def test_an_xfail_marker_a_rank_adds_while_the_test_runs_counts_as_in_a_plain_test(inner) -> None:
    # the marker stayed in the rank: the test was FAILED where a plain one is XFAIL
    ran = inner(
        """
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_known_bug(rank, request):
            request.node.add_marker(pytest.mark.xfail(reason="known on rank 1"))
            assert rank == 0

        @pytest.fixture
        def known(rank, request):
            request.node.add_marker(pytest.mark.xfail(reason="known everywhere", strict=True))

        @pytest.mark.multirank(world_size=2)
        def test_fixed_since(rank, known):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_unmarked(rank):
            assert rank == 0
        """,
        "-rA",
    )
    ran.result.assert_outcomes(xfailed=1, failed=2)
    ran.lines("XFAIL test_inner.py::test_known_bug - known on rank 1")
    ran.lines("FAILED test_inner.py::test_fixed_since*XPASS(strict)*known everywhere*")
