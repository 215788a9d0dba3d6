"""Bad input never reaches a traceback: one clear error naming the option or marker argument."""

from __future__ import annotations

import os

import pytest

MULTIRANK_TEST = """
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2)
def test_x(rank):
    dist.barrier()
"""


@pytest.mark.parametrize(
    ("args", "ini", "words"),
    [
        (["--ddp-timeout=nan"], "", "--ddp-timeout=nan: the time limit must be a number of seconds > 0 and <= 1e+06"),
        (["--ddp-timeout=inf"], "", "--ddp-timeout=inf: the time limit must be a number of seconds > 0 and <= 1e+06"),
        (["--ddp-timeout=-1"], "", "--ddp-timeout=-1: the time limit must be a number of seconds > 0*"),
        (["--ddp-timeout=abc"], "", "--ddp-timeout=abc: not a number of seconds"),
        ([], "ddp_leaks = loud", "ini ddp_leaks = loud: use one of fail, warn, off"),
        ([], "ddp_spmd = maybe", "ini ddp_spmd = maybe: use one of auto, on, off"),
        (
            [],
            "ddp_leaks_allow =\n    kettle:*",
            "ini ddp_leaks_allow: leak allowlist entry 'kettle:*': the kind must be*",
        ),
        ([], "ddp_timeout = abc", "ini ddp_timeout = abc: not a number of seconds"),
        (["--ddp-spmd=on"], "", "--ddp-spmd=on needs the environment torchrun gives its ranks*"),
    ],
)
def test_a_bad_option_stops_the_run_once_at_start(pytester, args, ini, words) -> None:
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(test_bad=MULTIRANK_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {words}"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


@pytest.mark.parametrize(
    ("marker", "words"),
    [
        ("timeout=float('nan')", "timeout must be a number of seconds > 0 or None, got nan (float)"),
        ("timeout=float('inf')", "timeout must be a number of seconds > 0 or None, got inf (float)"),
        ("timeout=True", "timeout must be a number of seconds > 0 or None, got True (bool)"),
        ("timeout=10**9", "timeout=1000000000 is more than 1e+06 seconds"),
        ("world_size=10**6", "world_size=1000000 is more ranks than one machine runs here (at most 1024)"),
    ],
)
def test_a_bad_marker_argument_is_an_error_naming_it(pytester, marker, words) -> None:
    pytester.makepyfile(
        test_marker=f"""
        import pytest

        @pytest.mark.multirank({marker})
        def test_x(rank):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*test_marker.py::test_x: @pytest.mark.multirank: {words}*"])


def test_an_unwritable_trace_dir_keeps_the_tests_own_failure(pytester, tmp_path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the folder should be")
    pytester.makepyfile(
        test_trace="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_fails(rank):
            assert rank == 5
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", f"--ddp-trace-dir={blocked}")
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*assert 0 == 5*"])
    result.stdout.fnmatch_lines([f"*PytestWarning: --ddp-trace-dir: cannot write {blocked}/*"])


def test_unwritable_trace_dir_and_page_change_no_outcome_even_when_warnings_are_errors(pytester, tmp_path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the folder should be")
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(
        test_trace="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_fails(rank):
            assert rank == 5

        @pytest.mark.multirank(world_size=2)
        def test_passes(rank):
            pass
        """
    )
    args = (f"--ddp-trace-dir={blocked}", f"--ddp-report={blocked}/report.html")
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["FAILED test_trace.py::test_fails - ranks 0,1 failed; rank 0: assert 0 == 5"])
    result.stdout.fnmatch_lines([f"ddphooks: PytestWarning: --ddp-trace-dir: cannot write {blocked}/*"])
    result.stdout.fnmatch_lines([f"ddphooks: PytestWarning: --ddp-report: cannot write {blocked}/report.html: *"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_the_folder_of_a_killed_session_is_removed_by_the_next(pytester, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    dead = tmp_path / "ddphooks-999999999-leftover"  # no process has this number
    (dead / "run-1").mkdir(parents=True)
    alive = tmp_path / f"ddphooks-{os.getpid()}-mine"
    alive.mkdir()
    pytester.makepyfile(test_plain="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not dead.exists()
    assert alive.exists(), "a live session's folder is left alone"


def test_every_flag_has_an_ini_twin(pytester) -> None:
    pytester.makeini("[pytest]\nddp_verbose_ranks = true\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error::pytest.PytestConfigWarning")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*Unknown config option*")
    pytester.makeini("[pytest]\nddp_verbose_ranks = maybe\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini ddp_verbose_ranks: invalid truth value 'maybe'; use true or false"])


def test_a_hypothesis_test_marked_multirank_is_a_clear_error(pytester) -> None:
    pytester.makepyfile(
        test_given="""
        import pytest

        def given_like(fn):
            fn.is_hypothesis_test = True  # what hypothesis' @given sets on the test it wraps
            return fn

        @pytest.mark.multirank(world_size=2)
        @given_like
        def test_drawn(rank):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_plain(rank):
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_drawn: @pytest.mark.multirank cannot run a hypothesis @given test: every rank would draw*"]
    )
