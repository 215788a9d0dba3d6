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
        (["--ddp-pdb-rank=1.5"], "", "--ddp-pdb-rank=1.5: a rank is a whole number >= 0"),
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


def test_a_report_path_that_is_a_folder_stops_the_run_and_leaves_nothing(pytester) -> None:
    pytester.mkdir("pages")
    pytester.makepyfile(test_bad=MULTIRANK_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ddp-report=pages")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --ddp-report=pages: */pages is a folder; give the page a file name, such as*"])
    assert not list((pytester.path / "pages").iterdir())
    assert not [p.name for p in pytester.path.iterdir() if p.name.endswith(".tmp")]


MARKER_CLASHES = """
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2)
@pytest.mark.multirank(world_size=4)
class TestTwice:
    def test_in_class(self):
        pass

@pytest.mark.multirank(world_size=[2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sizes_parametrized_too(world_size):
    pass

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("a, rank", [(1, 7)])
def test_rank_parametrized(a, rank):
    pass

@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.multirank(world_size=[1, 2]))])
def test_list_in_param_marks(n):
    pass

@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.multirank(world_size=2))])
def test_one_size_in_param_marks(n, world_size):
    assert dist.get_world_size() == world_size == 2

@pytest.mark.special(timeout=3)
def test_special_with_arguments():
    pass

def test_plain():
    pass
"""


def test_markers_that_cannot_all_hold_are_errors_of_their_tests_not_of_collection(pytester) -> None:
    pytester.makepyfile(test_clash=MARKER_CLASHES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=2, errors=6)
    result.stdout.fnmatch_lines(
        [
            "*test_clash.py::TestTwice::test_in_class: @pytest.mark.multirank is given 2 times on this class;*",
            "*test_clash.py::test_sizes_parametrized_too[[]2[]]: @pytest.mark.parametrize gives 'world_size',"
            " which a multirank test's ranks give*",
            "*test_clash.py::test_rank_parametrized[[]1-7[]]: @pytest.mark.parametrize gives 'rank'*",
            "*test_clash.py::test_list_in_param_marks[[]2[]]: @pytest.mark.multirank(world_size=[[]...[]]) makes one"
            " test per size where it marks the test function, its class or its module, as the module is"
            " collected; a marker added later (in pytest.param(..., marks=...), or by a hook such as*",
            "*test_clash.py::test_special_with_arguments: @pytest.mark.special takes no arguments, got (timeout=3);*",
        ],
        consecutive=False,
    )


def test_two_markers_on_a_module_are_an_error_of_each_test(pytester) -> None:
    pytester.makepyfile(
        test_module_twice="""
        import pytest

        pytestmark = [pytest.mark.multirank(world_size=2), pytest.mark.multirank(world_size=4)]

        def test_x():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.multirank is given 2 times on this module;*"])


def test_a_special_test_with_a_bad_marker_starts_no_interpreter(pytester) -> None:
    log = pytester.path / "imports.log"
    pytester.makeconftest(f"open({str(log)!r}, 'a').write('imported\\n')")
    pytester.makepyfile(
        test_special_bad="""
        import pytest

        @pytest.mark.special
        @pytest.mark.multirank(world_size=0)
        def test_x():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*world_size must be an int >= 1 or a list of them, got 0 (int)*"])
    assert log.read_text().count("imported") == 1  # the session's own, no child interpreter's


def test_a_subclass_marker_overrides_its_bases_and_a_nearer_size_must_agree(pytester) -> None:
    pytester.makepyfile(
        test_nearest="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        class TestBase:
            expected = 2

            def test_size(self):
                assert dist.get_world_size() == self.expected

        @pytest.mark.multirank(world_size=3)
        class TestSub(TestBase):
            expected = 3

        class TestInherits(TestBase):
            pass
        """,
        test_module_sizes="""
        import pytest
        import torch.distributed as dist

        pytestmark = pytest.mark.multirank(world_size=[1, 2])

        @pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.multirank(world_size=1))])
        def test_param(n, world_size):
            assert dist.get_world_size() == world_size
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*test_module_sizes.py::test_param[[]1-2[]]: this test runs by @pytest.mark.multirank(world_size=1),"
            " but a marker of its class or module made it for world_size=2*"
        ]
    )


def test_an_empty_choice_in_the_ini_file_is_its_default(pytester) -> None:
    pytester.makeini("[pytest]\nddp_leaks =\nddp_spmd =\n")
    pytester.makepyfile(test_ok=MULTIRANK_TEST)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_current_folder_a_fixture_removed_is_named_not_a_traceback(inner) -> None:
    ran = inner(
        """
        import os
        import pytest

        @pytest.fixture
        def gone(tmp_path):
            back = os.getcwd()
            work = tmp_path / "work"
            work.mkdir()
            os.chdir(work)
            work.rmdir()
            yield
            os.chdir(back)

        @pytest.mark.multirank(world_size=2)
        def test_in_a_removed_folder(rank, gone):
            pass

        @pytest.mark.multirank(world_size=2)
        def test_next(rank):
            pass
        """
    )
    ran.result.assert_outcomes(errors=1, passed=1)
    ran.lines(
        "the current folder was removed before the ranks could start in it (os.getcwd() fails): ranks start in the"
        " folder the test runs in, so a fixture that changes into a folder must leave it in place while the test"
        " runs, or change back before it removes it"
    )
    ran.no_lines("*multirank.py*")


@pytest.mark.parametrize("at_import", [True, False])
def test_a_group_a_conftest_starts_as_it_is_imported_is_named_as_the_cause(pytester, at_import: bool) -> None:
    # every rank starts as a copy of a process that imported the conftest: its group comes along
    pytester.makeconftest(
        f"""
        import pytest
        import torch.distributed as dist

        def start():
            dist.init_process_group("gloo", init_method="file://{pytester.path}/store", rank=0, world_size=1)

        if {at_import}:
            start()

        @pytest.fixture(scope="session")
        def single():  # the same group, in a fixture of the pytest process: the ranks never see it
            start()
            yield
            dist.destroy_process_group()
        """
    )
    pytester.makepyfile(
        test_inherited="""
        import pytest
        import torch.distributed as dist

        def test_plain(single):
            assert dist.get_world_size() == 1

        @pytest.mark.multirank(world_size=2)
        def test_ranks(rank):
            dist.barrier()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "--ddp-leaks=off")
    if not at_import:
        result.assert_outcomes(passed=2)
        return
    result.assert_outcomes(errors=2)  # (the plain test's fixture finds the group there already)
    result.stdout.fnmatch_lines(
        [
            "*rank 0: failed in fixture setup: RuntimeError: a default process group existed before the rank set its"
            " own up: code the test's files run as they are imported (a conftest, the test module) called"
            " init_process_group*",
        ]
    )
