"""Lines run in ranks, in special tests' interpreters and in what ranks spawn count in the
session's coverage report, with pytest-cov or with ``coverage run``, and nothing to set up."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("pytest_cov", reason="pytest-cov is installed with the test extras (ci/constraints.txt)")

PACKAGE = """
def on_rank(rank):
    if rank == 0:
        return "zero"
    return "other"


def in_special():
    return "special"


def in_spawned_child():
    return "child"


def only_rank1_before_its_hang():
    return "rank 1 got here"
"""

TESTS = """
import time
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from mypkg.code import in_spawned_child, in_special, on_rank, only_rank1_before_its_hang


@pytest.mark.multirank(world_size=2)
def test_branches_on_different_ranks(rank):
    assert on_rank(rank) == ("zero" if rank == 0 else "other")
    dist.barrier()


@pytest.mark.special
def test_in_its_own_interpreter():
    assert in_special() == "special"


def _child(i):
    in_spawned_child()


@pytest.mark.multirank(world_size=1)
def test_a_rank_spawns_a_child():
    mp.start_processes(_child, nprocs=1, start_method="spawn")
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.mkpydir("mypkg")
    (pytester.path / "mypkg" / "code.py").write_text(PACKAGE)
    pytester.makepyfile(test_cov=TESTS)
    return pytester


def _with_cov(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner session measuring mypkg with pytest-cov (report options and tests in ``args``)."""
    return project.runpytest_subprocess("-p", "no:cacheprovider", "--cov=mypkg", *args)


def _measured(project: pytest.Pytester, name: str, source: str, **outcomes: int) -> pytest.RunResult:
    """Run the test module ``name`` (``source``) alone with pytest-cov's missing-lines report."""
    project.makepyfile(**{name: source})
    result = _with_cov(project, "--cov-report=term-missing", f"{name}.py")
    result.assert_outcomes(**outcomes)
    return result


def _missing(text: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith("mypkg/code.py"))
    return line


def test_pytest_cov_counts_lines_run_in_ranks_and_special_interpreters(project) -> None:
    result = _with_cov(project, "--cov-report=term-missing", "-k", "not spawns")
    result.assert_outcomes(passed=2)
    # everything but the spawned child's function and the hang helper
    result.stdout.fnmatch_lines(["mypkg/code.py * 10 * 2 * 80% * 13, 17"])
    assert not list(project.path.glob(".coverage.*")), "the ranks' data files were combined, none left"


def test_a_function_whose_branches_run_on_different_ranks_shows_100_percent(project) -> None:
    _only_ranks(project)
    result = _with_cov(project, "--cov-report=term-missing", "test_only_ranks.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["mypkg/code.py * 4 * 0 * 100%"])


EVERY_PLACE = """
def fixture_setup():
    return 1


def fixture_teardown():
    return 2


def asked_for():
    return 3


def finalizer():
    return 4


def in_thread():
    return 5


def in_body(rank):
    if rank == 0:
        return 6
    return 7
"""


def test_the_tests_own_code_counts_wherever_a_rank_runs_it(project) -> None:
    # a rank traces only the test's own code (its fixtures, its body, its finalizers), not the
    # harness between them: each place the test's code is called from is measured
    (project.path / "mypkg" / "places.py").write_text(EVERY_PLACE)
    source = """
        import threading
        import pytest
        from mypkg import places

        @pytest.fixture
        def asked():
            return places.asked_for()

        @pytest.fixture
        def prepared(rank, request):
            places.fixture_setup()
            request.addfinalizer(places.finalizer)
            assert request.getfixturevalue("asked") == 3
            yield
            places.fixture_teardown()

        class TestPlaces:
            @pytest.mark.multirank(world_size=2)
            def test_every_place(self, rank, prepared):
                t = threading.Thread(target=places.in_thread)
                t.start()
                t.join()
                places.in_body(rank)
    """
    result = _measured(project, "test_places", source, passed=1)
    result.stdout.fnmatch_lines(["mypkg/places.py * 14 * 0 * 100%"])


ERRORS = """class Oops(Exception):
    def __init__(self, msg='', code=None):
        super().__init__(msg)
        self.code = code

    def __str__(self):
        if self.code is not None:
            return f'failed with code {self.code}'
        return super().__str__()
"""

# line 6 stops at a breakpoint; never_called() is lines 13-699
DEEP = """def outer():
    inner()


def inner():
    breakpoint()


def finalizer():
    return 2


def never_called():
""" + "".join(f"    x{i} = {i}\n" for i in range(14, 700))


def test_the_projects_code_a_failing_ranks_report_runs_counts(project) -> None:
    # the rank formats its failure: the exception's own __str__ runs there, as it runs in the
    # pytest process for a plain test's report
    # (the pytest process remakes the exception from its text: Oops("failed with code 3"))
    (project.path / "mypkg" / "errors.py").write_text(ERRORS)
    source = """
        import pytest
        from mypkg.errors import Oops

        @pytest.mark.multirank(world_size=1)
        @pytest.mark.xfail(raises=Oops, strict=True)
        def test_rank_raises(rank):
            raise Oops(code=3)
    """
    result = _measured(project, "test_fails", source, xfailed=1)
    result.stdout.fnmatch_lines(["mypkg/errors.py * 8 * 0 * 100%"])


def test_a_debugger_taking_the_tracer_in_a_rank_adds_no_line_that_never_ran(project) -> None:
    # pdb replaces coverage's tracer at a breakpoint() and clears it at "continue": started
    # again, coverage's record of the frames it was in would no longer match them, and the
    # harness's lines would be counted in the project's file
    from ptyproc import PtyProcess

    (project.path / "mypkg" / "deep.py").write_text(DEEP)
    project.makepyfile(
        test_deep="""
        import pytest
        from mypkg import deep

        @pytest.fixture
        def finalized(rank, request):
            request.addfinalizer(deep.finalizer)
            request.addfinalizer(deep.finalizer)

        @pytest.mark.multirank(world_size=1, timeout=60)
        def test_breaks(rank, finalized):
            deep.outer()
        """
    )
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "--cov=mypkg", "--cov-report=term-missing"]
    proc = PtyProcess([*argv, "test_deep.py"], str(project.path))
    proc.expect("(Pdb) ")
    proc.send("c")
    assert proc.wait() == 0, proc.text
    missed = next(line for line in proc.text.splitlines() if line.startswith("mypkg/deep.py")).split()[-1]
    assert missed.endswith("14-699"), proc.text  # not one line of never_called()


ONLY_RANKS = """
import pytest
import torch.distributed as dist
from mypkg.code import on_rank

@pytest.mark.multirank(world_size=2)
def test_branches(rank):
    on_rank(rank)
    dist.barrier()
"""


def _only_ranks(project) -> None:
    project.makepyfile(test_only_ranks=ONLY_RANKS)
    (project.path / "mypkg" / "code.py").write_text(PACKAGE.split("\n\n\ndef in_special")[0] + "\n")


def test_branch_coverage_joins_the_branches_each_rank_took(project) -> None:
    _only_ranks(project)
    result = _with_cov(project, "--cov-branch", "--cov-report=term-missing", "test_only_ranks.py")
    result.assert_outcomes(passed=1)
    # Stmts Miss Branch BrPart Cover: the if's two branches were taken on two different ranks
    result.stdout.fnmatch_lines(["mypkg/code.py * 4 * 0 * 2 * 0 * 100%"])


def test_with_dynamic_contexts_the_ranks_lines_still_count(project) -> None:
    # a rank whose measurement switches contexts saves a data file of its own, combined at the end
    _only_ranks(project)
    (project.path / ".coveragerc").write_text("[run]\ndynamic_context = test_function\n")
    result = _with_cov(project, "--cov-report=term-missing", "test_only_ranks.py")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["mypkg/code.py * 4 * 0 * 100%"])
    assert not list(project.path.glob(".coverage.*")), "the ranks' data files were combined, none left"


def test_a_failing_rank_and_its_passing_peer_both_count(project) -> None:
    project.makepyfile(
        test_fails="""
        import pytest
        from mypkg.code import on_rank

        @pytest.mark.multirank(world_size=2)
        def test_rank1_fails(rank):
            on_rank(rank)
            assert rank == 0
        """
    )
    (project.path / "mypkg" / "code.py").write_text(PACKAGE.split("\n\n\ndef in_special")[0] + "\n")
    result = _with_cov(project, "--cov-report=term-missing", "test_fails.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["mypkg/code.py * 4 * 0 * 100%"])


def test_coverage_run_counts_them_too_and_a_spawned_child(project) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "coverage", "run", "--source=mypkg", "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=project.path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Combined " not in done.stdout + done.stderr, "the harness's combining is not the user's to read"
    report = subprocess.run(
        [sys.executable, "-m", "coverage", "report", "-m"], cwd=project.path, capture_output=True, text=True
    )
    line = _missing(report.stdout)
    assert line.split()[1:] == ["10", "1", "90%", "17"], report.stdout  # all but the hang helper


def test_under_xdist_the_workers_ranks_are_counted(project) -> None:
    result = _with_cov(project, "-n", "2", "--cov-report=term-missing", "-k", "branches")
    result.assert_outcomes(passed=1)
    # both branches of on_rank ran, on different ranks of a worker
    result.stdout.fnmatch_lines(["mypkg/code.py * 10 * 3 * 70% * 9, 13, 17"])


def test_a_rank_killed_at_the_limit_loses_only_its_own_lines(project) -> None:
    project.makepyfile(
        test_hang="""
        import time
        import pytest
        import torch.distributed as dist
        from mypkg.code import on_rank, only_rank1_before_its_hang

        @pytest.mark.multirank(world_size=2, timeout=3)
        def test_rank1_hangs(rank):
            if rank == 1:
                only_rank1_before_its_hang()
                time.sleep(600)
            on_rank(rank)
        """
    )
    result = _with_cov(project, "--cov-report=term-missing", "test_hang.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*hang: the test did not finish within 3 s*"])
    # rank 1 was killed at the limit: what it ran (5, 17) is lost; rank 0's lines (3, 4) are kept
    result.stdout.fnmatch_lines(["mypkg/code.py * 10 * 4 * 60% * 5, 9, 13, 17"])


def test_a_child_a_rank_forks_counts_its_own_lines(project) -> None:
    # the rank's measurement was started once in the fork server and is only resumed in the
    # rank: a process the test forks still measures itself and saves as it leaves
    project.makepyfile(
        test_fork="""
        import os
        import pytest
        from mypkg.code import in_spawned_child, on_rank

        @pytest.mark.multirank(world_size=2)
        def test_rank0_forks(rank):
            on_rank(rank)
            if rank == 0:
                pid = os.fork()
                if pid == 0:
                    in_spawned_child()
                    os._exit(0)
                assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        """
    )
    result = _with_cov(project, "--cov-report=term-missing", "test_fork.py")
    result.assert_outcomes(passed=1)
    # both ranks' branches and the forked child's function: only the two helpers not run
    result.stdout.fnmatch_lines(["mypkg/code.py * 10 * 2 * 80% * 9, 17"])
    assert not list(project.path.glob(".coverage.*")), "the child's data file was combined, none left"


def _torchrun(project, *args: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "pytest", "-p", "no:cacheprovider", *args]
    done = subprocess.run(command, cwd=project.path, capture_output=True, text=True, timeout=180)
    return done.returncode, done.stdout + done.stderr


def test_under_torchrun_rank_0_reports_the_lines_of_every_rank(project) -> None:
    # every launched rank runs the session: rank 1's lines reach rank 0's report, and no rank
    # races another over the data files (each saving and combining them lost some)
    _only_ranks(project)
    code, out = _torchrun(
        project,
        "--cov=mypkg",
        "--cov-branch",
        "--cov-report=term-missing",
        "--cov-fail-under=100",
        "test_only_ranks.py",
    )
    assert code == 0, out
    assert out.count("mypkg/code.py") == 1, out  # one report: rank 0's
    assert [ln.split()[1:] for ln in out.splitlines() if ln.startswith("mypkg/code.py")] == [
        ["4", "0", "2", "0", "100%"]
    ], out
    assert "Couldn't use data file" not in out, out
    assert sorted(p.name for p in project.path.glob(".coverage*")) == [".coverage"]


def test_under_torchrun_a_line_no_rank_ran_is_missed(project) -> None:
    project.makepyfile(
        test_rank0_only="""
        import pytest
        import torch.distributed as dist
        from mypkg.code import on_rank

        @pytest.mark.multirank(world_size=2)
        def test_zero(rank):
            on_rank(0)
            dist.barrier()
        """
    )
    (project.path / "mypkg" / "code.py").write_text(PACKAGE.split("\n\n\ndef in_special")[0] + "\n")
    code, out = _torchrun(
        project, "--cov=mypkg", "--cov-report=term-missing", "--cov-fail-under=100", "test_rank0_only.py"
    )
    assert code != 0, out  # rank 0's total decides, and it is under 100
    assert [ln.split()[1:] for ln in out.splitlines() if ln.startswith("mypkg/code.py")] == [["4", "1", "75%", "5"]], (
        out
    )


def test_with_test_contexts_a_ranks_lines_belong_to_its_test(project) -> None:
    # --cov-context=test: the lines rank 1 ran are the test's, in its "run" phase, as a plain
    # test's body lines would be
    _only_ranks(project)
    (project.path / ".coveragerc").write_text("[json]\nshow_contexts = True\n")
    result = _with_cov(project, "--cov-context=test", "--cov-report=json", "test_only_ranks.py")
    result.assert_outcomes(passed=1)
    import json

    report = json.loads((project.path / "coverage.json").read_text())
    contexts = report["files"]["mypkg/code.py"]["contexts"]
    # line 4: `return "other"`, run on rank 1 only; line 3 on rank 0 only
    assert contexts["4"] == ["test_only_ranks.py::test_branches|run"], contexts
    assert contexts["3"] == ["test_only_ranks.py::test_branches|run"], contexts


def test_with_test_contexts_a_ranks_fixture_lines_belong_to_its_setup_and_teardown(project) -> None:
    # as pytest-cov has it for a plain test: a fixture's code before its yield is the test's
    # "setup", after it the "teardown", the body's the "run"
    project.makepyfile(
        test_phases="""
        import pytest
        from mypkg.code import in_spawned_child, in_special, on_rank

        @pytest.fixture
        def prepared(rank):
            in_special()
            yield
            in_spawned_child()

        @pytest.mark.multirank(world_size=2)
        def test_phases(rank, prepared):
            on_rank(rank)
        """
    )
    (project.path / ".coveragerc").write_text("[json]\nshow_contexts = True\n")
    result = _with_cov(project, "--cov-context=test", "--cov-report=json", "test_phases.py")
    result.assert_outcomes(passed=1)
    import json

    contexts = json.loads((project.path / "coverage.json").read_text())["files"]["mypkg/code.py"]["contexts"]
    # line 9: in_special's return, 13: in_spawned_child's, 3 and 4: on_rank's branches
    assert contexts["9"] == ["test_phases.py::test_phases|setup"], contexts
    assert contexts["13"] == ["test_phases.py::test_phases|teardown"], contexts
    assert contexts["3"] == contexts["4"] == ["test_phases.py::test_phases|run"], contexts


def test_with_test_contexts_a_special_tests_lines_belong_to_it(project) -> None:
    # its interpreter measures itself: it switches to pytest-cov's context of each phase too
    (project.path / ".coveragerc").write_text("[json]\nshow_contexts = True\n")
    result = _with_cov(project, "--cov-context=test", "--cov-report=json", "test_cov.py", "-k", "own_interpreter")
    result.assert_outcomes(passed=1, deselected=2)
    import json

    contexts = json.loads((project.path / "coverage.json").read_text())["files"]["mypkg/code.py"]["contexts"]
    # line 9: `return "special"`
    assert contexts["9"] == ["test_cov.py::test_in_its_own_interpreter|run"], contexts
