"""The suite under torchrun: every launched rank runs the session (SPMD mode)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest


def torchrun(folder: Path, *args: str, nproc: int = 2, timeout: float = 120) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "pytest", "-p", "no:cacheprovider", *args]
    started = time.monotonic()
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_results_of_all_ranks_are_merged_on_rank_0(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(
        test_spmd="""
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_launched(rank, world_size, recorder):
            assert "pytest" in open(f"/proc/{os.getpid()}/cmdline").read()  # the launched process itself
            assert rank == int(os.environ["RANK"]) and world_size == 2
            t = torch.ones(1)
            dist.all_reduce(t)
            recorder.mark("done")
            assert recorder.timeline().ranks == [0, 1]

        @pytest.mark.multirank(world_size=2)
        def test_fails_on_rank_1(rank):
            print(f"said on rank {rank}")
            dist.barrier()
            assert rank == 0, "only rank 0 may pass"

        @pytest.mark.multirank(world_size=3)
        def test_three(rank):
            pass

        def test_plain(tmp_path_factory):
            open(os.path.join(os.environ["MARKS"], "plain-" + os.environ["RANK"]), "w").close()
        """
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    xml = tmp_path / "junit.xml"
    import os

    os.environ["MARKS"] = str(marks)
    try:
        code, out, _ = torchrun(pytester.path, f"--junitxml={xml}")
    finally:
        del os.environ["MARKS"]
    assert code != 0, out
    assert out.count("= 1 failed, 2 passed, 1 deselected") == 1, out
    for line in (
        "multirank test failed on rank 1 of 2",
        "  rank 1: failed: AssertionError: only rank 0 may pass",
        "test_spmd.py::test_three: world_size=3, but torchrun launched 2 ranks",
    ):
        assert line in out, out
    # each rank's output, labelled (not rank 0's alone, as if it were the test's)
    assert "Captured stdout rank 1 call" in out and "said on rank 1" in out, out
    assert "Captured stdout rank 0 call" in out and "Captured stdout call -" not in out, out
    assert [p.name for p in marks.iterdir()] == ["plain-0"]
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert set(cases) == {"test_launched", "test_fails_on_rank_1", "test_plain"}
    assert cases["test_fails_on_rank_1"].find("failure") is not None


def test_a_run_that_deselects_everything_exits_0(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_none="""
        import pytest

        @pytest.mark.multirank(world_size=4)
        def test_four(rank):
            pass
        """
    )
    code, out, _ = torchrun(pytester.path)
    assert code == 0, out
    assert "no test matched the 2 launched ranks; nothing to run" in out


def test_ranks_that_collect_different_tests_are_stopped(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_differ="""
        import os
        import pytest

        @pytest.mark.parametrize("i", range(1 + int(os.environ["RANK"])))
        @pytest.mark.multirank(world_size=2)
        def test_some(i, rank):
            pass
        """
    )
    code, out, _ = torchrun(pytester.path)
    assert code != 0
    assert "under torchrun every rank must collect the same tests in the same order;" in out
    assert "rank 1 collected 2 tests, rank 0 only 1; the first extra: 'test_differ.py::test_some[1]'" in out
    assert out.count("every rank must collect the same tests") == 1, out  # said once, by rank 0
    assert re.search(r"exitcode\s*:\s*4\b", out), out  # every rank ends as a usage error


def test_a_rank_that_hangs_ends_the_run_with_its_stack(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_stuck="""
        import time
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang(rank):
            print(f"rank {rank} was here")
            if rank == 1:
                while True:
                    time.sleep(0.05)
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_after(rank):
            pass
        """
    )
    code, out, seconds = torchrun(pytester.path, "--junitxml=out.xml", "--ddp-trace-dir=traces")
    assert code != 0
    assert "test_stuck.py::test_hang did not finish within 2 s; the run stops" in out
    # the swimlanes of both ranks, and the trace
    assert "recorded timeline:" in out and "rank 0 " in out and "| rank 1" in out, out
    assert [p.suffix for p in (pytester.path / "traces").iterdir()] == [".json"]
    # who waits where, and who never came
    assert "  barrier #1 on group default: rank 0 waits in it, rank 1 never entered it" in out
    assert "test_stuck.py:10 in test_hang: time.sleep(0.05)" in out
    assert seconds < 60
    # what every rank printed, each in its own section
    lines = pytest.LineMatcher(out.splitlines())
    lines.fnmatch_lines(["*Captured stdout rank 0 call*", "rank 0 was here"])
    lines.fnmatch_lines(["*Captured stdout rank 1 call*", "rank 1 was here"])
    # rank 0 still reports the test and ends the session's reports
    assert "FAILED test_stuck.py::test_hang - test_stuck.py::test_hang did not finish" in out
    assert "ddphooks: test_stuck.py::test_hang hung; the run stops before the 1 test after it" in out
    case = ET.parse(pytester.path / "out.xml").getroot().find(".//testcase[@name='test_hang']")
    assert case is not None
    failure = case.find("failure")
    assert failure is not None and "rank 1 never entered it" in (failure.text or "")
    # its time is what it lasted: until the ranks' own watchdogs ended the run, 5 s past the
    # 2 s limit (it once said the limit twice, for the call and the teardown: 4 s)
    assert 7.0 <= float(case.get("time", "0")) < seconds, (case.get("time"), seconds)
    # the ranks end as a session with a failed test does (3 would say pytest crashed)
    assert not re.search(r"exitcode\s*:\s*3\b", out), out


FIXTURE_HANGS = """
import time
import pytest
import torch.distributed as dist

@pytest.fixture
def stuck(rank):
    if WHEN == "setup" and rank == WHO:
        while True:
            time.sleep(0.05)
    yield
    if WHEN == "teardown" and rank == WHO:
        while True:
            time.sleep(0.05)

@pytest.mark.multirank(world_size=2)
def test_hang(stuck):
    dist.barrier()

@pytest.mark.multirank(world_size=2)
def test_after(rank):
    assert rank in (0, 1)
"""


@pytest.mark.parametrize(("when", "who"), [("setup", 0), ("teardown", 1)])
def test_a_rank_stuck_in_a_fixture_ends_the_run_with_its_stack(pytester: pytest.Pytester, when: str, who: int) -> None:
    # without torchrun the launcher times a rank's fixtures; under it, each rank's watchdog does
    # (the run once waited forever for a rank 0 stuck in its setup)
    pytester.makepyfile(test_fixture_hang=f"WHEN, WHO = {when!r}, {who}\n" + FIXTURE_HANGS)
    code, out, seconds = torchrun(pytester.path, "--ddp-timeout=3", "--junitxml=out.xml", timeout=100)
    assert code != 0
    lines = pytest.LineMatcher(out.splitlines())
    lines.fnmatch_lines(
        [
            f"*ERROR at {when} of test_hang*",
            f"*the {when} of test_fixture_hang.py::test_hang (its fixtures) did not finish within 3 s*",
            "*stuck at *test_fixture_hang.py:* in stuck: time.sleep(0.05)",
        ]
    )
    if who == 0:  # rank 0 reports, and says the other waited for it
        lines.fnmatch_lines(["rank 1:", f"  ended its {when} and waits for the others"])
    else:
        assert f"rank {who} hung in test_fixture_hang.py::test_hang" in out, out
    suite = ET.parse(pytester.path / "out.xml").getroot()
    case = suite.find(".//testcase[@name='test_hang']")
    assert case is not None and case.find("error") is not None
    assert suite.find(".//testcase[@name='test_after']") is None  # the run stopped there
    assert seconds < 60, seconds  # the limit and the watchdog's 5 s, not torchrun's kill
    assert "Thread 0x" not in out, out  # the ranks ended their sessions before rank 0 left: no stack dump


def test_a_pytest_timeout_above_the_default_limit_is_the_fixtures_limit_under_torchrun(
    pytester: pytest.Pytester,
) -> None:
    # the ranks waiting for rank 0's setup wait its limit (pytest-timeout's), not --ddp-timeout's
    pytester.makepyfile(test_fixture_hang="WHEN, WHO = 'setup', 0\n" + FIXTURE_HANGS)
    code, out, _ = torchrun(pytester.path, "--ddp-timeout=2", "--timeout=4", timeout=100)
    assert code != 0
    assert "1 passed, 1 error" in out, out
    assert "Timeout (>4.0s) from pytest-timeout, in the setup of this multirank test's fixtures on rank 0" in out
    assert "did not end the" not in out, out


def test_markers_mean_under_torchrun_what_they_mean_without_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_markers="""
        import os
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, init_process_group=False)
        def test_own_group(rank):
            assert not dist.is_initialized()
            dist.init_process_group("gloo")
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2  # left alive, as trainers leave theirs

        @pytest.mark.multirank(world_size=2, init_process_group=False)
        def test_own_group_again_fails_on_rank_1(rank):
            assert not dist.is_initialized()
            dist.init_process_group("gloo")
            if rank == 1:
                raise ValueError("boom")
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_the_sessions_group_is_back(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

        @pytest.mark.multirank(world_size=2, backend="nccl")
        def test_nccl(rank):
            raise AssertionError("ran without a GPU")

        @pytest.mark.multirank(world_size=2)
        def test_node_rank(rank):
            assert os.environ["NODE_RANK"] == os.environ["GROUP_RANK"] == "0"
        """
    )
    code, out, _ = torchrun(pytester.path, "-rA")
    assert code != 0
    assert "PASSED test_markers.py::test_own_group" in out
    assert "FAILED test_markers.py::test_own_group_again_fails_on_rank_1 - rank 1" in out
    assert "rank 1: failed: ValueError: boom" in out
    assert "leaked" not in out
    assert "PASSED test_markers.py::test_the_sessions_group_is_back" in out
    assert "SKIPPED [1] test_markers.py:28: multirank(backend='nccl') needs 2 GPUs per node" in out
    assert "PASSED test_markers.py::test_node_rank" in out
    assert "1 failed, 3 passed, 1 skipped" in out


def test_ranks_hung_in_collectives_that_cannot_match_are_a_desync(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_mismatch="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_mismatch(rank):
            t = torch.ones(4)
            dist.all_reduce(t)
            if rank == 0:
                dist.all_reduce(t)
            else:
                dist.broadcast(t, src=0)
        """
    )
    code, out, seconds = torchrun(pytester.path)
    assert code != 0 and seconds < 60
    desync = "desync: collective #2 on the default group: rank 0 all_reduce(float32[4]), rank 1 broadcast(float32[4]"
    assert desync in out
    assert "FAILED test_mismatch.py::test_mismatch - desync: collective #2" in out
    assert "never entered" not in out


def test_a_mismatch_the_test_looks_at_itself_is_its_own_under_torchrun_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_checked="""
        import pytest
        import torch
        import torch.distributed as dist

        def differing_ops(rank):
            dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)

        @pytest.mark.multirank(world_size=2)
        def test_looked_at(rank, recorder):
            differing_ops(rank)
            assert len(recorder.timeline().collective_mismatches()) == 1

        @pytest.mark.multirank(world_size=2)
        def test_not_looked_at(rank, recorder):
            differing_ops(rank)
        """
    )
    code, out, _ = torchrun(pytester.path, "-rA")
    assert code != 0
    assert "PASSED test_checked.py::test_looked_at" in out
    assert "FAILED test_checked.py::test_not_looked_at - desync: collective #" in out


def test_a_rank_that_finished_while_rank_0_hangs_lets_rank_0_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_skip="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=2)
        def test_hang(rank):
            if rank == 0:
                dist.barrier()
        """
    )
    code, out, seconds = torchrun(pytester.path, "--junitxml=out.xml")
    assert code != 0 and seconds < 60
    assert "  barrier #1 on group default: rank 0 waits in it, rank 1 never entered it" in out
    assert "  finished the test body (passed), then waited for the other ranks" in out
    assert "said nothing" not in out
    assert "FAILED test_skip.py::test_hang" in out
    assert (pytester.path / "out.xml").exists()


def test_faults_under_torchrun_are_a_clear_error_and_restarts_a_normal_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_faulty="""
        import os
        import pytest
        import torch.distributed as dist
        from pytest_ddphooks import FaultError

        @pytest.mark.multirank(world_size=2)
        def test_arms(rank, faults):
            with pytest.raises(FaultError, match="faults need the plugin's own ranks"):
                faults.kill(rank=1, at="dist.barrier#1")
            dist.barrier()

        @pytest.mark.multirank(world_size=2, restarts=1)
        def test_restarts_without_a_death(rank, restart_count):
            assert restart_count == int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
            dist.barrier()
        """
    )
    code, out, _ = torchrun(pytester.path)
    assert code == 0, out
    assert out.count("= 2 passed") == 1, out


def test_exploring_schedules_under_torchrun_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_explored="""
        import pytest

        @pytest.mark.multirank(world_size=2, explore=5)
        def test_marked(rank):
            pass
        """
    )
    code, out, _ = torchrun(pytester.path, "--ddp-explore=3")
    assert code != 0
    assert "--ddp-explore: schedules need the plugin's own ranks: under torchrun the ranks belong to" in out, out
    code, out, _ = torchrun(pytester.path)
    assert code != 0
    assert "multirank(explore=..., schedule=...): schedules need the plugin's own ranks" in out, out
    assert out.count("= 1 failed") == 1, out


def test_a_failed_test_blames_nobody_for_the_group_rebuilt_after_it(pytester: pytest.Pytester) -> None:
    """The failed test's group is replaced before the next multirank test is set up: its
    sockets are no leak of that test."""
    pytester.makepyfile(
        test_after_failure="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_1_fails(rank):
            assert rank == 0

        @pytest.mark.multirank(world_size=2)
        def test_2_next(rank):
            dist.barrier()
        """
    )
    code, out, _ = torchrun(pytester.path)
    assert code != 0, out
    assert "= 1 failed, 1 passed" in out, out
    assert "leaked" not in out, out


def test_a_setup_or_teardown_that_fails_on_one_rank_fails_on_all_and_rank_0_says_so(pytester: pytest.Pytester) -> None:
    """A fixture that failed on rank 1 only once sent rank 1 on to the next test while rank 0
    waited for it in this one (the run stopped, the error unsaid); a teardown error or a
    leak on rank 1 never reached rank 0's report (it said passed, torchrun exited 1). A skip
    in one rank's setup skips the test on all."""
    pytester.makepyfile(
        test_phases="""
        import subprocess
        import unittest
        import pytest
        import torch.distributed as dist

        @pytest.fixture
        def data(rank):
            if rank == 1:
                raise OSError("rank 1 has no data")

        @pytest.fixture
        def closing(rank):
            yield
            if rank == 1:
                raise OSError("rank 1 could not close")

        @pytest.fixture
        def gpu(rank):
            if rank == 1:
                pytest.skip("no GPU on rank 1")

        @pytest.mark.multirank(world_size=2)
        def test_1_setup(rank, data):
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_2_teardown(rank, closing):
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_3_leak(rank):
            if rank == 1:
                subprocess.Popen(["sleep", "300"])
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_4_skip(rank, gpu):
            dist.barrier()

        @pytest.fixture
        def unittest_skip(rank):
            if rank == 1:
                raise unittest.SkipTest("unittest skip on rank 1")

        @pytest.mark.multirank(world_size=2)
        def test_5_unittest_skip(rank, unittest_skip):
            dist.barrier()

        @pytest.mark.xfail(run=False, reason="not yet")
        @pytest.mark.multirank(world_size=2)
        def test_6_xfail_not_run(rank):
            dist.barrier()

        @pytest.mark.multirank(world_size=2)
        def test_7_next(rank):
            dist.barrier()
        """
    )
    code, out, _ = torchrun(pytester.path, "-rA", "--junitxml=out.xml")
    assert code != 0, out
    assert "= 3 passed, 2 skipped, 1 xfailed, 3 errors" in out, out
    expected = [
        "ERROR at setup of test_1_setup",
        "rank 1: failed in fixture setup: OSError: rank 1 has no data",
        "ERROR at teardown of test_2_teardown",
        "rank 1: failed in teardown: OSError: rank 1 could not close",
        "ERROR at teardown of test_3_leak",
        "rank 1: failed in teardown: Failed: test_phases.py::test_3_leak leaked (cleaned up before the next test):",
        "process * is still running: sleep 300",
    ]
    pytester_lines = pytest.LineMatcher(out.splitlines())
    pytester_lines.fnmatch_lines([f"*{line}*" for line in expected])
    pytester_lines.fnmatch_lines(["SKIPPED [[]1[]] test_phases.py:*: no GPU on rank 1 (on rank 1)"])
    # rank 1's own traceback, as pytest shows its fixture's error
    pytester_lines.fnmatch_lines(
        ["*-- rank 1 --*", "*def data(rank):", '>*raise OSError("rank 1 has no data")', "E*OSError: rank 1 has no data"]
    )
    junit = ET.parse(pytester.path / "out.xml").getroot()
    assert junit.find("testsuite").get("errors") == "3", out  # type: ignore[union-attr]


def test_plain_tests_on_every_rank_fail_where_any_rank_failed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain_all="""
        import os

        def test_rank_1_only_fails():
            assert os.environ["RANK"] == "0", "not rank 0"

        def test_everywhere_fine():
            pass
        """
    )
    code, out, _ = torchrun(pytester.path, "--ddp-plain-tests=all")
    assert code != 0, out
    # rank 0 learns it as the test's teardown ends: an error there, in the report and junit XML
    assert "= 2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_rank_1_only_fails" in out, out
    assert "the plain test failed on rank 1 (--ddp-plain-tests=all runs it on every rank): call:" in out, out
    assert "not rank 0" in out, out


def test_a_failure_on_one_rank_is_reported_at_once_and_rank_0_reports_last(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_mixed="""
        import time
        import pytest
        import torch.distributed as dist

        KEEP = []

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_rank1_raises(rank):
            if rank == 1:
                raise ValueError("boom on rank 1")
            dist.barrier()  # rank 1 never comes: its group goes, and this fails at once

        @pytest.mark.multirank(world_size=2)
        def test_leaks_a_group(rank):
            KEEP.append(dist.new_group([0, 1]))

        @pytest.mark.multirank(world_size=2)
        def test_clean_after_the_leak(rank):
            dist.barrier()

        def test_plain_on_rank_0_after_rank_1_is_done():
            time.sleep(0.5)
        """
    )
    code, out, seconds = torchrun(
        pytester.path, "--junitxml=out.xml", "-rfE", "--ddp-report=page.html", "--ddp-trace-dir=traces"
    )
    assert code != 0 and seconds < 50, out[-3000:]
    # rank 0's page holds every multirank test; the failed one's timeline is a trace
    assert "<title>pytest-ddphooks: 3 multirank tests</title>" in (pytester.path / "page.html").read_text()
    assert [p.name for p in (pytester.path / "traces").iterdir()] == ["test_mixed.py_test_rank1_raises.json"]
    assert "  rank 1: failed: ValueError: boom on rank 1" in out
    assert "  rank 0: failed after rank 1, because its peer went away: RuntimeError:" in out
    # the leaking test alone is blamed: the session's own group, rebuilt, is nobody's leak
    assert "ERROR test_mixed.py::test_leaks_a_group" in out
    assert "test_clean_after_the_leak leaked" not in out
    # rank 1 ended first with a failure: rank 0 still ran its plain test and wrote its reports
    assert "1 failed, 3 passed, 1 error" in out
    # meanwhile rank 1 waited for rank 0 in short steps on the store, whose client warns of each
    # step that timed out: not onto the terminal, nor into a test's captured stderr
    assert "waitForInput" not in out, out
    root = ET.parse(pytester.path / "out.xml").getroot()
    assert {c.get("name") for c in root.iter("testcase")} >= {
        "test_rank1_raises",
        "test_clean_after_the_leak",
        "test_plain_on_rank_0_after_rank_1_is_done",
    }


def test_pytest_timeouts_limit_and_a_rank_that_skipped_under_torchrun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_limits="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.timeout(2)
        @pytest.mark.multirank(world_size=2)
        def test_rank1_skips(rank):
            if rank == 1:
                pytest.skip("no data on rank 1")
            dist.barrier()
        """
    )
    code, out, seconds = torchrun(pytester.path)
    assert code != 0 and seconds < 40, out[-3000:]
    assert "test_limits.py::test_rank1_skips did not finish within 2 s; the run stops" in out
    assert "  finished the test body (skipped: Skipped: no data on rank 1), then waited for the other ranks" in out


def test_a_marker_one_rank_adds_is_every_ranks_under_torchrun_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marked="""
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_rank1_expects_the_failure(rank, request):
            if rank == 1:
                request.applymarker(pytest.mark.xfail(reason="known on rank 1", raises=AssertionError))
            dist.barrier()
            assert False, f"broken on rank {rank}"

        @pytest.mark.multirank(world_size=2)
        def test_no_marker(rank):
            assert rank == 1
        """
    )
    code, out, _ = torchrun(pytester.path, "-rxf")
    assert code != 0, out
    # rank 0 added no marker, yet judges the test by rank 1's, as the pytest process does without torchrun
    assert out.count("= 1 failed, 1 xfailed") == 1, out
    assert "XFAIL test_marked.py::test_rank1_expects_the_failure - known on rank 1" in out, out


def test_a_rank_that_dies_still_lets_rank_0_report_in_the_time_torchrun_gives(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_die="""
        import os
        import pytest
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2, timeout=60)
        def test_rank1_dies(rank):
            dist.barrier()
            if rank == 1:
                os._exit(3)
            dist.barrier()

        def test_plain():
            pass
        """
    )
    code, out, seconds = torchrun(pytester.path, "--junitxml=out.xml")
    assert code != 0 and seconds < 40, out[-3000:]
    assert (
        "torchrun stopped the run while this rank ran: a rank ended (it died, or finished with an error),"
        " or torchrun itself was stopped" in out
    )
    assert "  rank 1: ended without reporting (its exit code is in torchrun's summary)" in out
    assert "  rank 0: failed: RuntimeError: " in out
    case = ET.parse(pytester.path / "out.xml").getroot().find(".//testcase[@name='test_rank1_dies']")
    assert case is not None and case.find("failure") is not None


def test_xdist_under_torchrun_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_x="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_x(rank):
            pass
        """
    )
    code, out, seconds = torchrun(pytester.path, "-n", "2")
    assert code != 0
    assert "pytest-xdist (-n) cannot run under torchrun: every rank torchrun launched runs the whole session" in out
    assert seconds < 60


def test_exitfirst_stops_every_rank_when_a_plain_test_fails_on_one(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_x_first="""
        import os
        import pytest
        import torch.distributed as dist

        def test_fails_on_rank_0():
            assert os.environ["RANK"] != "0"

        def test_never_runs():
            pass

        @pytest.mark.multirank(world_size=2)
        def test_multirank_never_runs(rank):
            dist.barrier()
        """
    )
    code, out, seconds = torchrun(pytester.path, "-x", "--ddp-plain-tests=all", "-rA")
    assert code != 0
    assert "= 1 failed in" in out, out
    assert "forcefully exiting" not in out, out  # rank 1 stopped too, torchrun never had to kill it
    assert seconds < 25


COVERED = """
def branchy(rank):
    if rank == 0:
        x = "zero"
    else:
        x = "other"
    return x


def never():
    return 1
"""

HANGS = {
    # every rank's watchdog fires: rank 0 reports from its watchdog's thread, its main one stuck
    "on every rank": "if rank == 1:\n        time.sleep(100)\n    dist.barrier()",
    # rank 0 finished the body: it learns of the hang in the main thread and ends its loop there
    "on rank 1 alone": "if rank == 1:\n        time.sleep(100)",
    "nowhere": "dist.barrier()",
}


@pytest.mark.parametrize("hang", list(HANGS))
def test_a_hang_keeps_the_coverage_of_every_rank_and_fail_under_decides(pytester: pytest.Pytester, hang: str) -> None:
    pytest.importorskip("pytest_cov", reason="pytest-cov is installed with the test extras (ci/constraints.txt)")
    pytester.mkpydir("mypkg")
    (pytester.path / "mypkg" / "__init__.py").write_text(COVERED)
    pytester.makepyfile(
        test_cov_tr="""
        import pytest
        import torch.distributed as dist
        import mypkg

        @pytest.mark.multirank(world_size=2)
        def test_branchy(rank):
            mypkg.branchy(rank)
            dist.barrier()
        """,
        test_then=textwrap.dedent(
            """
            import time
            import pytest
            import torch.distributed as dist

            @pytest.mark.multirank(world_size=2, timeout=3)
            def test_hang(rank):
                BODY

            def test_after():
                pass
            """
        ).replace("BODY", HANGS[hang]),
    )
    code, out, seconds = torchrun(
        pytester.path,
        "--junitxml=j.xml",
        "--cov=mypkg",
        "--cov-branch",
        "--cov-report=term-missing",
        "--cov-report=xml:cov.xml",
        "--cov-fail-under=90",
    )
    assert code != 0 and seconds < 60, out
    # rank 1's branch counts (its lines of the test before the hang): only never() is missed,
    # the same report as a run without a hang
    assert [ln.split()[1:] for ln in out.splitlines() if ln.startswith("mypkg/__init__.py")] == [
        ["7", "1", "2", "0", "89%", "11"]
    ], out
    assert "FAIL Required test coverage of 90% not reached. Total coverage: 88.89%" in out, out
    assert "Coverage XML written to file cov.xml" in out, out
    assert sorted(p.name for p in pytester.path.glob(".coverage*")) == [".coverage"]
    assert "handed none over" not in out, out
    cases = {c.get("name"): c for c in ET.parse(pytester.path / "j.xml").getroot().iter("testcase")}
    if hang == "nowhere":
        assert "= 3 passed" in out, out
        assert set(cases) == {"test_branchy", "test_hang", "test_after"}
    else:
        assert "FAILED test_then.py::test_hang" in out, out
        assert set(cases) == {"test_branchy", "test_hang"}
        # rank 0 wrote its reports before torchrun stopped it: nothing was killed
        assert "forcefully exiting" not in out, out


def test_under_torchrun_each_ranks_log_is_in_its_own_section(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_log_tr="""
        import logging
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_log(rank):
            print(f"printed on rank {rank}")
            logging.getLogger("app").warning("log from rank %d", rank)
            assert rank == 0

        @pytest.mark.multirank(world_size=2)
        def test_caplog_reads_its_own_rank(rank, caplog):
            logging.getLogger("app").warning("only mine %d", rank)
            assert [r.getMessage() for r in caplog.records] == [f"only mine {rank}"]

        def test_plain():
            logging.getLogger("app").warning("plain log")
        """
    )
    code, out, _ = torchrun(pytester.path, "-rA")
    assert code != 0
    assert "= 1 failed, 2 passed" in out, out
    # the failing rank's record too, each labelled, as without torchrun
    for words in ("WARNING  app:test_log_tr.py:7 log from rank 0", "WARNING  app:test_log_tr.py:7 log from rank 1"):
        assert out.count(words) == 1, out
    without = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")
    without.assert_outcomes(failed=1, passed=2)

    def headings(text: str) -> list[str]:
        return re.findall(r"^-+ (Captured .+?) -+$", text, re.MULTILINE)

    assert headings(out) == headings(without.stdout.str()), out
    assert headings(out)[:4] == [
        "Captured log rank 0 call",
        "Captured log rank 1 call",
        "Captured stdout rank 0 call",
        "Captured stdout rank 1 call",
    ], out
    assert headings(out).count("Captured log call") == 1, out  # the plain test's, as it was


def test_a_send_of_an_earlier_test_shifts_no_pairing_in_a_later_one(pytester: pytest.Pytester) -> None:
    """Under torchrun the group outlives each test: a send between two ranks moved their count
    of its calls and not the third's. Numbered from the count alone, the later test's first
    barrier on ranks 0 and 1 paired with the third rank's second, proving an order that did
    not hold; earlier collectives alone leave later orders proven."""
    pytester.makepyfile(
        test_shift="""
        import time
        import pytest
        import torch
        import torch.distributed as dist
        from pytest_ddphooks import TimelineAssertionError

        @pytest.mark.multirank(world_size=3)
        def test_1_collectives(rank):
            dist.all_reduce(torch.ones(2))

        @pytest.mark.multirank(world_size=3)
        def test_2_true_order_proven(rank, recorder):
            if rank == 0:
                recorder.mark("prepare")
            dist.barrier()
            recorder.mark("setup")
            recorder.timeline().assert_happens_before("prepare@0", "setup")

        @pytest.mark.multirank(world_size=3)
        def test_3_send(rank):
            t = torch.zeros(2)
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)

        @pytest.mark.multirank(world_size=3)
        def test_4_inversion_refused(rank, recorder, shared_tmp_path):
            dist.barrier()
            if rank == 0:
                recorder.mark("b")
                (shared_tmp_path / "b").write_text("done")
            if rank == 2:
                while not (shared_tmp_path / "b").exists():  # the test's time limit ends a wait that never does
                    time.sleep(0.01)
                recorder.mark("a")  # after b
            dist.barrier()
            with pytest.raises(TimelineAssertionError):
                recorder.timeline().assert_happens_before("a@2", "b@0")

        @pytest.mark.multirank(world_size=3)
        def test_5_true_order_still_proven(rank, recorder):
            # the earlier tests' recorders left the group's numbering to this one: nothing unsure
            test_2_true_order_proven(rank, recorder)
            assert not any(e.info.get("unsure") for e in recorder.timeline().events)

        @pytest.mark.multirank(world_size=3)
        def test_6_unseen_send(rank):
            t = torch.zeros(2)
            pg = dist.distributed_c10d._get_default_group()
            if rank == 0:
                torch.ops.c10d.send([t], pg.boxed(), 1, 0).wait()
            elif rank == 1:
                torch.ops.c10d.recv_([t], pg.boxed(), 0, 0).wait()

        @pytest.mark.multirank(world_size=3)
        def test_7_later_numbering_lost_and_said(rank, recorder):
            dist.barrier()
            recorder.mark("setup")
            tl = recorder.timeline()
            unsure = {e.rank for e in tl.events if e.info.get("unsure")}
            assert unsure == {0, 1}, tl.swimlanes()
        """
    )
    code, out, _ = torchrun(pytester.path, "-q", nproc=3)
    assert code == 0, out
    assert "7 passed" in out


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_pytest_exit_and_ctrl_c_in_a_rank_end_the_session_as_without_torchrun(
    pytester: pytest.Pytester, how: str
) -> None:
    # they were a failed test, and the session went on with the next
    stop = 'pytest.exit("stop now", returncode=7)' if how == "exit" else "raise KeyboardInterrupt"
    pytester.makepyfile(
        test_stops=f"""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_stops(rank):
            {stop}

        @pytest.mark.multirank(world_size=2)
        def test_after(rank):
            print("test_after ran")
        """
    )
    code, out, _ = torchrun(pytester.path, "-s")
    assert code != 0, out
    assert "test_after ran" not in out, out
    if how == "exit":
        assert "exitcode  : 7" in out, out
        assert "Exit: stop now" in out, out
    else:
        assert "exitcode  : 2" in out, out
        assert "KeyboardInterrupt" in out, out


def test_a_flaky_test_rerun_by_pytest_rerunfailures_blames_nobody_for_the_group_rebuilt(
    pytester: pytest.Pytester,
) -> None:
    # the group a failed run left is rebuilt before each run of a test, not only before the first
    pytester.makepyfile(
        test_flaky="""
        import pytest
        import torch
        import torch.distributed as dist

        @pytest.mark.multirank(world_size=2)
        def test_a_flaky(rank, tmp_path_factory):
            seen = tmp_path_factory.getbasetemp() / f"seen{rank}"
            first = not seen.exists()
            seen.write_text("1")
            assert not (first and rank == 1)

        @pytest.mark.multirank(world_size=2)
        def test_b_after(rank):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
        """
    )
    code, out, _ = torchrun(pytester.path, "-p", "rerunfailures", "--reruns", "1")
    assert code == 0, out
    assert "2 passed, 1 rerun" in out, out
    assert "leaked" not in out, out


def test_the_junit_file_rank_0_writes_has_what_every_rank_recorded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_props="""
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_props(rank, record_property, record_testsuite_property, record_xml_attribute):
            record_property(f"loss_rank{rank}", 0.5 + rank)
            record_testsuite_property(f"host_rank{rank}", f"node{rank}")
            if rank == 1:
                record_xml_attribute("owner", "rank-1-team")
        """
    )
    # xunit1: xunit2 (the default) keeps no attribute of a test's own, with or without ranks
    code, out, _ = torchrun(pytester.path, "--junitxml=junit.xml", "-o", "junit_family=xunit1")
    assert code == 0, out
    root = ET.parse(pytester.path / "junit.xml").getroot()
    case = next(root.iter("testcase"))
    found = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert found == {"loss_rank0": "0.5", "loss_rank1": "1.5"}
    suite = root.find("testsuite")
    assert suite is not None
    # the suite's own properties: those of rank 1 too, as without torchrun
    on_suite = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
    assert on_suite == {"host_rank0": "node0", "host_rank1": "node1"}, ET.tostring(root)
    assert case.get("owner") == "rank-1-team"


def test_a_file_one_rank_cannot_collect_is_said_with_its_error(pytester: pytest.Pytester) -> None:
    # it was "every rank must collect the same tests" (exit code 4), the error nowhere
    pytester.makepyfile(
        test_imports="""
        import os
        import pytest

        if os.environ.get("RANK") == "1":
            raise ImportError("rank 1 cannot import this")

        @pytest.mark.multirank(world_size=2)
        def test_a(rank):
            pass
        """
    )
    code, out, seconds = torchrun(pytester.path)
    assert code != 0, out
    assert "under torchrun a test file failed to collect on some rank:" in out, out
    assert "rank 1 could not collect test_imports.py: ImportError: rank 1 cannot import this" in out, out
    assert "must collect the same tests" not in out, out
    assert "exitcode  : 2" in out, out
    # rank 0 alone cannot: it ends too, no rank waits for another that left
    test_file = pytester.path / "test_imports.py"
    test_file.write_text(test_file.read_text().replace('== "1"', '== "0"'))
    code, out, seconds = torchrun(pytester.path)
    assert code != 0 and seconds < 60, out
    assert "rank 0 could not collect test_imports.py" in out, out
    assert "INTERNALERROR" not in out, out


def test_on_two_nodes_a_test_that_gives_nodes_runs_only_where_they_match(pytester: pytest.Pytester) -> None:
    # nodes=1 given explicitly ran on 2 nodes (LOCAL_RANK 0,0) and failed; not given, it runs
    pytester.makepyfile(
        test_nodes="""
        import os
        import pytest

        @pytest.mark.multirank(world_size=2)
        def test_any_nodes(rank):
            pass

        @pytest.mark.multirank(world_size=2, nodes=2)
        def test_two_nodes(rank):
            assert os.environ["LOCAL_WORLD_SIZE"] == "1"

        @pytest.mark.multirank(world_size=2, nodes=1)
        def test_one_node(rank):
            assert os.environ["LOCAL_WORLD_SIZE"] == "2"
        """
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    common += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nodes-test"]
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-rs"]
    nodes = [
        subprocess.Popen(
            [*common, f"--node-rank={k}", *pytest_args],
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)
    ]
    outs = [node.communicate(timeout=180)[0] for node in nodes]
    out = "\n".join(outs)
    assert all(node.returncode == 0 for node in nodes), out
    assert "2 passed, 1 deselected" in out, out
    assert "test_nodes.py::test_one_node: nodes=1, but torchrun launched 2 nodes" in out, out
