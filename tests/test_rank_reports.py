"""What ranks say beyond pass and fail: their warnings reach the session's summary once each,
and every rank death is in the report, whoever reported first."""

from __future__ import annotations

import os
import signal
import time

from pytest_ddphooks.launch.job import Job
from pytest_ddphooks.launch.launcher import Launcher
from pytest_ddphooks.launch.procs import is_running

WARNS = """
import warnings
import pytest
import torch.distributed as dist


class TrainerWarning(UserWarning):
    pass


@pytest.mark.multirank(world_size=2)
def test_every_rank_warns(rank):
    warnings.warn("every rank says careful", TrainerWarning)
    if rank == 1:
        warnings.warn("only rank 1 says this", DeprecationWarning)
    dist.barrier()


@pytest.mark.multirank(world_size=2)
@pytest.mark.filterwarnings("error::UserWarning")
def test_filter_turns_it_into_an_error(rank):
    warnings.warn("an error on every rank", UserWarning)


@pytest.mark.multirank(world_size=2)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_filter_ignores_it(rank):
    warnings.warn("nobody hears this", UserWarning)


@pytest.mark.multirank(world_size=2)
def test_quiet(rank):
    dist.barrier()
"""


def test_rank_warnings_reach_the_summary_once_with_the_tests_filters(pytester) -> None:
    pytester.makepyfile(test_warns=WARNS)
    for args in ((), ("-n", "2")):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
        result.assert_outcomes(passed=3, failed=1, warnings=2)
        result.stdout.fnmatch_lines(
            [
                "*= warnings summary =*",
                "*test_warns.py:12: TrainerWarning: every rank says careful",
                "*test_warns.py:14: DeprecationWarning: only rank 1 says this",
            ]
        )
        text = result.stdout.str()
        assert text.count("TrainerWarning: every rank says careful") == 1, "one warning, not one per rank"
        assert "nobody hears this" not in text
        result.stdout.fnmatch_lines(
            ["*test_filter_turns_it_into_an_error*", "E       UserWarning: an error on every rank"]
        )


def test_without_pytests_warnings_plugin_a_ranks_warnings_are_printed_as_a_plain_tests(pytester) -> None:
    pytester.makepyfile(
        test_warns="""
        import warnings
        import pytest

        def test_plain():
            warnings.warn("plain says careful")

        @pytest.mark.multirank(world_size=2)
        def test_ranks(rank):
            warnings.warn(f"rank {rank} says careful")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:warnings", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*warnings summary*")
    result.stdout.fnmatch_lines(["*UserWarning: rank 1 says careful*"])  # in the rank's captured stderr


def test_an_exception_a_ranks_thread_did_not_catch_is_a_warning_as_in_a_plain_test(pytester) -> None:
    pytester.makepyfile(
        test_thread="""
        import threading
        import pytest

        def boom():
            raise ValueError("thread boom")

        @pytest.mark.multirank(world_size=2)
        def test_ranks(rank):
            worker = threading.Thread(target=boom)
            worker.start()
            worker.join()

        @pytest.mark.multirank(world_size=2)
        def test_quiet(rank):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*PytestUnhandledThreadExceptionWarning*", "*ValueError: thread boom*"])
    strict = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-W", "error::pytest.PytestUnhandledThreadExceptionWarning"
    )
    strict.assert_outcomes(passed=1, failed=1)


def test_a_rank_its_framework_kills_after_a_peer_failed_is_named(pytester) -> None:
    pytester.makepyfile(
        test_observer="""
        import os
        import signal
        import time
        import pytest

        def gone(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except OSError:
                return True

        @pytest.mark.multirank(world_size=2)
        def test_rank1_fails_then_rank0_is_killed(rank, shared_tmp_path):
            if rank == 1:
                (shared_tmp_path / "pid.tmp").write_text(str(os.getpid()))
                os.replace(shared_tmp_path / "pid.tmp", shared_tmp_path / "rank1.pid")
                raise RuntimeError("rank 1 blew up")
            # as Lightning's observer: once a peer has failed and exited, the job goes down
            while not (shared_tmp_path / "rank1.pid").exists():
                time.sleep(0.005)
            while not gone(int((shared_tmp_path / "rank1.pid").read_text())):
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "multirank test failed on ranks 0,1 of 2",
            "  rank 0: died (killed by SIGKILL)",
            "  rank 1: failed: RuntimeError: rank 1 blew up",
        ]
    )


def test_a_rank_that_ended_on_its_own_before_the_kill_is_not_called_stopped(tmp_path) -> None:
    def body(ctx):
        if ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    launcher = Launcher(lambda job: body, log_path=str(tmp_path / "launcher.log"))
    launcher.start()
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        job = Job("ended", "test_x", 2, 1, "gloo", False, 30.0, str(run_dir), dict(os.environ), str(tmp_path))
        pids, _ = launcher.spawn(job)
        deadline = time.monotonic() + 10
        while is_running(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.005)
        exits = {ex.rank: ex for ex in launcher.kill(job.test_id)}
        launcher.finish(job.test_id, job.label)
    finally:
        launcher.close()
    assert exits[0].signal == signal.SIGKILL and not exits[0].by_harness
    assert exits[1].signal == signal.SIGKILL and exits[1].by_harness
