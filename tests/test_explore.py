"""Schedule exploration as a user meets it: a race a test does not assert is found, the seed
it names replays it, a correct test passes every schedule, and bad input is named."""

from __future__ import annotations

import re

RACE = """
import pytest
import torch.distributed as dist


def busy(n):
    return sum(i * i for i in range(n))


@pytest.mark.multirank(world_size=2, timeout=30)
def test_read_without_barrier(rank, shared_tmp_path):
    data = shared_tmp_path / "data.txt"
    if rank == 0:
        data.write_text("42")
    # the bug: no dist.barrier() here; rank 1 is busy first (~60 ms), so it reads late enough by luck
    if rank == 1:
        busy(1_000_000)
        assert data.read_text() == "42"
    dist.barrier()
"""

FIXED = """
import pytest
import torch.distributed as dist


@pytest.mark.multirank(world_size=2, timeout=30)
def test_read_after_barrier(rank, shared_tmp_path, recorder):
    data = shared_tmp_path / "data.txt"
    if rank == 0:
        # every schedule starts from the folder as the fixtures made it, not as a run left it
        assert not (shared_tmp_path / "left-by-an-earlier-run").exists()
        (shared_tmp_path / "left-by-an-earlier-run").touch()
        recorder.mark("writing")
        data.write_text("42")
    dist.barrier()
    if rank == 1:
        recorder.mark("reading")
        assert data.read_text() == "42"
    dist.barrier()
"""


def _seed(text: str) -> str:
    found = re.search(r"replay with --ddp-schedule=(0x[0-9a-f]+)", text)
    assert found is not None, text
    return found.group(1)


def test_exploration_finds_a_race_the_test_does_not_assert(inner) -> None:
    plain = inner(RACE)
    plain.result.assert_outcomes(passed=1)
    ran = inner(RACE, "--ddp-explore=20")
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "failed under schedule * of 20 (seed 0x*); replay with --ddp-schedule=0x*",
        "multirank test failed on rank 1 of 2",
        "  rank 1: failed: FileNotFoundError: *data.txt*",
    )
    ran.lines("where the schedule held the ranks:", "  rank 0 held * ms at *")
    # the summary line (pytest cuts it to the terminal's width) starts with the schedule
    ran.lines("FAILED test_inner.py::test_read_without_barrier - failed under schedule *")


def test_a_race_after_the_last_recorded_point_is_found_too(inner) -> None:
    """Nothing is recorded after rank 1's read: the time from its last point to the end of its
    body is a segment of the plain run all the same, and the holds outlast it."""
    race = RACE.replace("    dist.barrier()\n", "").replace("import torch.distributed as dist\n", "")
    race = race.replace("busy(1_000_000)", "busy(3_000_000)")  # ~0.15 s: 10x the shortest hold
    assert "dist.barrier()\n" not in race
    inner(race).result.assert_outcomes(passed=1)
    ran = inner(race, "--ddp-explore=20")
    ran.result.assert_outcomes(failed=1)
    ran.lines("failed under schedule * of 20 (seed 0x*); replay with --ddp-schedule=0x*")
    ran.lines("  rank 1: failed: FileNotFoundError: *data.txt*")


def test_the_seed_a_failure_names_replays_it(inner) -> None:
    found = inner(RACE, "--ddp-explore=20")
    seed = _seed(found.text)
    for _ in range(3):
        again = inner(RACE, f"--ddp-schedule={seed}")
        again.result.assert_outcomes(failed=1)
        again.lines(f"failed under schedule {seed} (--ddp-schedule={seed})", "*FileNotFoundError*")


def test_a_race_is_found_and_replayed_when_the_scheduled_runs_are_slower_than_the_plain_one(inner, pytester) -> None:
    """Rank 1's work takes three times as long in every run after the plain one (a loaded
    machine, a cold cache): holds sized from the plain run alone would end before it reads.
    A held rank waits for the ranks that go first to go through, so the order holds."""
    slower = RACE.replace("import pytest\n", "import pathlib\nimport pytest\n").replace(
        "        busy(1_000_000)\n",
        "        runs = pathlib.Path(__file__).with_name('runs')\n"
        "        busy(3_000_000 if runs.exists() else 1_000_000)\n"
        "        runs.touch()\n",
    )
    assert "runs.touch()" in slower
    found = inner(slower, "--ddp-explore=20")
    found.result.assert_outcomes(failed=1)
    found.lines("  rank 1: failed: FileNotFoundError: *data.txt*")
    found.lines("where the schedule held the ranks:", "  rank 0 held * ms at *, until rank 1 went through")
    seed = _seed(found.text)
    (pytester.path / "runs").unlink()
    again = inner(slower, f"--ddp-schedule={seed}")
    again.result.assert_outcomes(failed=1)
    again.lines(f"failed under schedule {seed} (--ddp-schedule={seed})", "*FileNotFoundError*")


def test_the_marker_explores_and_replays_too(inner) -> None:
    found = inner(RACE.replace("timeout=30", "timeout=30, explore=20"))
    found.result.assert_outcomes(failed=1)
    seed = _seed(found.text)
    again = inner(RACE.replace("timeout=30", f"timeout=30, schedule={seed}"))
    again.result.assert_outcomes(failed=1)
    again.lines(f"failed under schedule {seed} (--ddp-schedule={seed})")
    again.no_lines("*in place of the*")
    # both given: the replay wins, and says what it stands in for
    both = inner(RACE.replace("timeout=30", f"timeout=30, explore=20, schedule={seed}"))
    both.result.assert_outcomes(failed=1)
    both.lines(
        f"failed under schedule {seed} (--ddp-schedule={seed}); the one schedule replayed, in place of the 20 an"
        " exploration would run"
    )


def test_a_correct_test_passes_every_schedule_from_its_own_start(inner) -> None:
    ran = inner(FIXED, "--ddp-explore=30", "-rA")
    ran.result.assert_outcomes(passed=1)
    ran.lines("*Captured schedules call*", "passed under all 30 schedules explored (seeds 0x*, 0x*")
    ran.no_lines("*desync*")


def test_a_replay_whose_plain_run_fails_says_its_schedule_never_ran(inner) -> None:
    ran = inner(
        """
import pytest

@pytest.mark.multirank(world_size=2, timeout=20, schedule=7)
def test_fails_plainly(rank):
    assert rank == 0
"""
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "failed in the plain run; schedule 0x00000007 was not replayed (a replay runs the test plainly first,"
        " and replays the schedule only after a pass)",
        "multirank test failed on rank 1 of 2",
    )
    ran.lines("FAILED test_inner.py::test_fails_plainly - failed in the plain run: *")


def test_a_test_that_removes_its_own_folders_is_explored_from_them_as_they_were(inner) -> None:
    ran = inner(
        """
import shutil
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2, timeout=30, explore=3)
def test_cleans_up(rank, tmp_path, node_tmp_path):
    assert not (tmp_path / "out").exists() and not (node_tmp_path / "out").exists()
    dist.barrier()
    if rank == 0:
        (tmp_path / "out").write_text("x")
        (node_tmp_path / "out").write_text("x")
        shutil.rmtree(tmp_path)  # a trainer cleaning up its output folders
        shutil.rmtree(node_tmp_path)
    dist.barrier()

@pytest.mark.multirank(world_size=2, timeout=30)
def test_next(rank):
    dist.barrier()
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=2)
    ran.lines("passed under all 3 schedules explored (seeds 0x*")


def test_the_time_a_schedule_holds_the_ranks_is_not_the_tests_own(inner) -> None:
    """A correct test well within its limit, whose schedules' holds alone would pass it: no
    schedule fails it as a hang (each run's limit grows by what its holds may take)."""
    ran = inner(
        """
import time
import pytest
import torch.distributed as dist

@pytest.mark.multirank(world_size=2, timeout=2.0, explore=3)
def test_steps(rank):
    for _ in range(8):
        time.sleep(0.08)  # a step's work
        dist.barrier()
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    ran.lines("passed under all 3 schedules explored (seeds 0x*")


def test_exploration_is_off_by_default_and_runs_nothing_more(inner) -> None:
    ran = inner(FIXED, "-rA")
    ran.result.assert_outcomes(passed=1)
    ran.no_lines("*schedules*")


def test_exploration_under_xdist(inner) -> None:
    ran = inner(RACE + FIXED.split("\n\n\n", 1)[1], "--ddp-explore=20", "-n", "2")
    ran.result.assert_outcomes(passed=1, failed=1)
    ran.lines("*failed under schedule * of 20 (seed 0x*); replay with --ddp-schedule=0x*")


def test_bad_exploration_input_is_named(inner) -> None:
    for flag, words in (
        ("--ddp-explore=abc", "ERROR: --ddp-explore=abc: the number of schedules is an int from 0 to 10000"),
        ("--ddp-explore=-1", "ERROR: --ddp-explore=-1: the number of schedules is an int from 0 to 10000"),
        ("--ddp-schedule=zz", "ERROR: --ddp-schedule=zz: 'zz' is not a seed (an int, e.g. 0x5eed1234)"),
        ("--ddp-schedule=", "ERROR: --ddp-schedule=: give the seed of the schedule to replay (an int, e.g. 0x5*)"),
    ):
        ran = inner(FIXED, flag)
        assert ran.result.ret == 4, ran.text
        ran.result.stderr.fnmatch_lines([words])
    ran = inner(
        """
import pytest

@pytest.mark.multirank(world_size=2, explore=-1)
def test_negative(rank):
    pass

@pytest.mark.multirank(world_size=2, schedule="soon")
def test_not_a_seed(rank):
    pass
"""
    )
    ran.result.assert_outcomes(errors=2)
    ran.lines("*@pytest.mark.multirank: explore must be an int from 0 to 10000 (schedules), got -1 (int)")
    ran.lines("*@pytest.mark.multirank: schedule: 'soon' is not a seed (an int, e.g. 0x5eed1234)")


def test_a_test_that_restarts_its_ranks_is_explored_attempts_and_all(inner) -> None:
    ran = inner(
        """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_resumes(rank, faults, restart_count):
    faults.kill(rank=1, at="dist.all_reduce#1")  # every schedule's first attempt loses rank 1
    dist.all_reduce(torch.ones(1))
    assert restart_count == 1
""",
        "--ddp-explore=3",
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    ran.lines("passed under all 3 schedules explored (seeds 0x*")
    # the plain run and every schedule: rank 1 killed in the first attempt, the second passes
    assert ran.text.count("attempt 1: rank 0 passed; rank 1 passed") == 4, ran.text


def test_a_rank_teardown_failing_under_a_schedule_fails_it_and_a_failed_teardown_explores_nothing(
    inner, pytester
) -> None:
    runs = pytester.path / "runs"
    runs.mkdir()
    ran = inner(
        f"""
        import os
        import pytest
        import torch.distributed as dist

        def count(name, rank):
            path = os.path.join({str(runs)!r}, f"{{name}}-{{rank}}")
            n = int(open(path).read()) if os.path.exists(path) else 0
            open(path, "w").write(str(n + 1))
            return n

        @pytest.mark.multirank(world_size=2, explore=3, timeout=60)
        def test_fails_in_second_schedule(rank, request):
            n = count("second", rank)  # run 0 is the plain one, 1..3 the schedules
            def finalizer():
                if n == 2 and rank == 1:
                    raise RuntimeError(f"finalizer failed in run {{n}}")
            request.addfinalizer(finalizer)
            dist.barrier()

        @pytest.mark.multirank(world_size=2, explore=3, timeout=60)
        def test_fails_in_every_run(rank, request):
            count("every", rank)
            def finalizer():
                raise RuntimeError("finalizer failed")
            request.addfinalizer(finalizer)
            dist.barrier()
        """,
        "-p",
        "no:randomly",
    )
    ran.result.assert_outcomes(passed=2, errors=2)
    ran.lines(
        "*ERROR at teardown of test_fails_in_second_schedule*",
        "failed under schedule 2 of 3 (seed 0x*); replay with --ddp-schedule=0x*",
        "  rank 1: failed in fixture teardown: RuntimeError: finalizer failed in run 2",
    )
    ran.no_lines("*passed under all 3 schedules*")
    assert (runs / "every-0").read_text() == "1", "a test whose teardown failed is not explored"


RUNS = """
import os
import socket
import subprocess
import pytest
import torch.distributed as dist

RUNS = {runs!r}  # outside every folder a schedule restores: how many runs of a test came before


def earlier_runs(rank, test):
    prefix = f"{{test}}-{{rank}}."
    n = sum(1 for name in os.listdir(RUNS) if name.startswith(prefix))
    open(os.path.join(RUNS, f"{{prefix}}{{n}}"), "w").close()
    return n


@pytest.fixture
def served(tmp_path):
    # a fixture serving on a socket and a pipe in tmp_path: their live ends stay through every schedule
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "serve.sock"))
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "data").mkdir()
    yield tmp_path
    server.close()


@pytest.mark.multirank(world_size=2, timeout=30)
def test_served(rank, served):
    assert (served / "serve.sock").is_socket() and (served / "pipe").is_fifo()
    (served / "data" / f"rank{{rank}}").touch()
    dist.barrier()


@pytest.mark.multirank(world_size=2, timeout=30)
def test_leaks_under_a_schedule(rank):
    if earlier_runs(rank, "leaks") and rank == 0:
        subprocess.Popen(["sleep", "300"])  # only in the runs after the plain one
    dist.barrier()


@pytest.mark.multirank(world_size=2, timeout=30)
def test_skips_under_a_schedule(rank):
    dist.barrier()
    if earlier_runs(rank, "skips") and rank == 1:
        pytest.skip("data not ready")
"""


def test_live_ends_a_process_left_and_a_skip_under_a_schedule(inner, pytester) -> None:
    runs = pytester.path / "runs"
    runs.mkdir()
    ran = inner(RUNS.format(runs=str(runs)), "--ddp-explore=2", "-rA")
    # sockets and pipes a fixture made in tmp_path are left in place, not copied (they cannot be)
    ran.lines("*test_served*", "*passed under all 2 schedules explored*")
    # a process a rank leaves under a schedule is killed and reported, as in a plain run
    ran.lines("*rank 0 left process * running (killed) (under schedule 0x*): sleep 300*")
    # a rank that skips under a schedule skips the test, as in a plain run, naming the schedule
    ran.lines("SKIPPED [[]1[]] *: data not ready (on rank 1; the other ranks passed) (under schedule 1 of 2*")
    ran.result.assert_outcomes(passed=2, skipped=1, errors=1)
