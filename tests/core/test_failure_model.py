"""The failure model without ranks: synthetic RunReports in, a classified verdict and the
words a user reads out."""

from __future__ import annotations

import signal

from synth import Sim

from pytest_ddphooks.failure import DEATH, DESYNC, FAILURE, HANG, STALL, classify, render
from pytest_ddphooks.report import RankExit, RankResult, RunReport, Stall
from pytest_ddphooks.stacks import parse_stacks


def _passed(rank: int) -> RankResult:
    return RankResult(rank, "passed")


def _failed(rank: int, message: str, *, phase: str = "call", line: int = 7) -> RankResult:
    return RankResult(
        rank,
        "failed",
        longrepr=f"E   {message}",
        message=message,
        location=("test_x.py", line),
        phase=phase,
    )


def _report(world: int = 2, **kwargs) -> RunReport:
    report = RunReport(world, 3.0, **kwargs)
    for rank in range(world):
        if rank in report.results and rank not in report.exits:
            report.exits[rank] = RankExit(rank, 100 + rank, 0, None)
    return report


def test_every_rank_passing_is_a_pass() -> None:
    verdict = classify(_report(results={0: _passed(0), 1: _passed(1)}))
    assert verdict.outcome == "passed"
    assert verdict.failure is None and verdict.teardown is None


def test_one_failing_rank_is_the_culprit_and_its_line_is_the_location() -> None:
    verdict = classify(_report(results={0: _passed(0), 1: _failed(1, "assert 1 == 2")}, first_failure=1))
    f = verdict.failure
    assert verdict.outcome == "failed" and f is not None
    assert (f.cause, f.phase, f.culprits) == (FAILURE, "call", [1])
    rendered = render(f)
    assert rendered.message == "rank 1: assert 1 == 2"
    assert rendered.location == ("test_x.py", 7)
    assert rendered.text.splitlines()[:3] == [
        "multirank test failed on rank 1 of 2",
        "  rank 0: passed",
        "  rank 1: failed: assert 1 == 2",
    ]
    assert "E   assert 1 == 2" in rendered.text


def test_a_rank_that_failed_because_its_peer_went_away_is_a_consequence() -> None:
    gone = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    report = _report(results={0: _failed(0, "ValueError: bad batch"), 1: _failed(1, gone)}, first_failure=0)
    f = classify(report).failure
    assert f is not None and f.culprits == [0]
    assert [(rf.rank, rf.how, rf.after) for rf in f.failures] == [(0, "failed", None), (1, "consequence", 0)]
    text = render(f).text
    assert "  rank 1: failed after rank 0, because its peer went away: RuntimeError: [pair.cc:553] Connection" in text


def test_a_rank_whose_store_went_with_the_rank_serving_it_is_a_consequence() -> None:
    """Rank 0 serves the run's store: ranks waiting in ``timeline()`` lose it when rank 0's
    body fails and it leaves."""
    gone = (
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed."
        " Did the remote server shutdown or crash?"
    )
    results = {0: _failed(0, "ValueError: rank 0 broke"), 1: _failed(1, gone), 2: _failed(2, gone)}
    f = classify(_report(3, results=results, first_failure=0)).failure
    assert f is not None and f.culprits == [0]
    assert [(rf.rank, rf.how, rf.after) for rf in f.failures] == [
        (0, "failed", None),
        (1, "consequence", 0),
        (2, "consequence", 0),
    ]
    assert render(f).text.splitlines()[0] == "multirank test failed on rank 0 of 3"


def test_a_peers_end_noticed_after_the_rank_that_lost_it_reported_is_still_the_cause() -> None:
    gone = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:48798: Connection reset by peer"
    died = _report(results={0: _failed(0, gone)}, first_failure=0)  # rank 0's result came in first
    died.exits[1] = RankExit(1, 101, 3, None)
    f = classify(died).failure
    assert f is not None and (f.cause, f.culprits) == (DEATH, [1])
    assert [(rf.rank, rf.how, rf.after) for rf in f.failures] == [(0, "consequence", 1), (1, "died", None)]
    assert render(f).text.splitlines()[0] == "multirank test failed on rank 1 of 2"
    slower = _report(results={0: _failed(0, gone), 1: _failed(1, "ValueError: bad batch")}, first_failure=0)
    f = classify(slower).failure
    assert f is not None and f.culprits == [1]
    # and a failure of its own, first, stays the cause
    own = _report(results={0: _failed(0, "ValueError: bad batch"), 1: _failed(1, gone)}, first_failure=0)
    f = classify(own).failure
    assert f is not None and f.culprits == [0]


def test_ranks_that_lost_a_peer_an_injected_fault_killed_are_its_consequences() -> None:
    gone = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    report = _report(
        3,
        results={0: _failed(0, gone), 1: _failed(1, gone)},
        first_failure=0,  # rank 0 only lost its peer first
        fired={2: [{"action": "kill", "sign": "SIGKILL", "fault": "kill(rank=2, at='dist.barrier#1')"}]},
    )
    report.exits[2] = RankExit(2, 102, None, signal.SIGKILL)
    f = classify(report).failure
    assert f is not None
    assert [(rf.rank, rf.how, rf.after) for rf in f.failures] == [(0, "consequence", 2), (1, "consequence", 2)]


def test_a_death_before_reporting_stops_the_others_and_is_the_root_cause() -> None:
    report = _report(
        exits={1: RankExit(1, 101, None, signal.SIGSEGV), 0: RankExit(0, 100, None, signal.SIGKILL, True)},
        stopped={0: "stopped after rank 1 died (killed by SIGSEGV)"},
        first_failure=1,
        outputs={
            1: ("", "Fatal Python error: Segmentation fault\n\nCurrent thread 0x0001 (most recent call first):\n")
        },
    )
    f = classify(report).failure
    assert f is not None and (f.cause, f.culprits) == (DEATH, [1])
    assert f.ranks[0].state == "running" and f.ranks[0].reason.startswith("stopped after rank 1 died")
    rendered = render(f)
    assert rendered.message == "rank 1 died (killed by SIGSEGV)"
    assert "rank 1 died: killed by SIGSEGV before it could report" in rendered.text
    assert "  Fatal Python error: Segmentation fault" in rendered.text
    assert "  rank 0: stopped after rank 1 died (killed by SIGSEGV); it was running" in rendered.text


def _rank0_in_barrier(sim: Sim) -> None:
    sim.cstart(0, "barrier")
    sim.mark(1, "busy")


def test_a_hang_at_the_limit_says_who_is_blocked_in_what_and_who_never_came() -> None:
    sim = Sim(2)
    _rank0_in_barrier(sim)
    stacks = parse_stacks('Thread 0x00000001 (most recent call first):\n  File "test_x.py", line 9 in test_y\n')
    report = _report(
        timed_out=True,
        stopped={0: "timed out after 3 s", 1: "timed out after 3 s"},
        stacks={0: stacks, 1: stacks},
        timeline=sim.timeline(),
        stopped_at_ns=sim.t + 2_500_000_000,
    )
    f = classify(report).failure
    assert f is not None and (f.cause, sorted(f.culprits)) == (HANG, [0, 1])
    blocked = f.ranks[0].blocked
    assert blocked is not None and (blocked.op, blocked.seq, blocked.missing) == ("barrier", 1, (1,))
    assert f.ranks[1].state == "running"
    rendered = render(f)
    assert rendered.text.splitlines()[:4] == [
        "hang: the test did not finish within 3 s (2 ranks)",
        "  rank 0: blocked in barrier #1 on the default group for 2.5 s",
        "    ranks that never entered barrier #1: 1",
        "    stuck at test_x.py:9 in test_y: ",
    ]
    assert rendered.message == "hang after 3 s; rank 0: blocked in barrier #1 on the default group for 2.5 s"
    assert "recorded timeline:" in rendered.text


def test_different_collectives_at_one_place_of_the_sequence_are_a_desync_said_first() -> None:
    sim = Sim(2)
    sim.cstart(0, "all_reduce")
    sim.cstart(1, "broadcast", root=0)
    report = _report(desynced=True, stopped={0: "stopped", 1: "stopped"}, timeline=sim.timeline(), duration=1.0)
    f = classify(report).failure
    assert f is not None and f.cause == DESYNC
    rendered = render(f)
    first = (
        "desync: collective #1 on the default group: rank 0 all_reduce(float32[4]), rank 1 broadcast(float32[4], src=0)"
    )
    assert rendered.message == first
    assert rendered.text.splitlines()[0] == first
    assert "not at the 3 s limit: they are blocked in collectives that can never match" in rendered.text


def test_waiting_for_a_rank_that_finished_is_a_stall_named_as_such() -> None:
    sim = Sim(2)
    sim.cstart(0, "barrier")
    report = _report(
        results={1: _passed(1)},
        stall=Stall({0: "barrier #1 on the default group"}, {1: "passed"}),
        stopped={0: "stopped: it waited for ranks that had finished the test", 1: "stopped"},
        timeline=sim.timeline(),
        duration=0.2,
    )
    f = classify(report).failure
    assert f is not None and f.cause == STALL
    rendered = render(f)
    assert rendered.message == (
        "rank 1 finished the test without calling barrier #1 on the default group; rank 0 waits in it"
    )
    assert "  rank 1: finished the test body (passed), then waited for the other ranks" in rendered.text


def test_a_receive_from_a_rank_that_finished_names_the_send_it_left_out() -> None:
    report = _report(
        results={2: _passed(2)},
        stall=Stall({0: "recv from rank 2"}, {2: "passed"}),
        stopped={0: "stopped: it waited for ranks that had finished the test", 1: "stopped"},
        duration=0.2,
    )
    f = classify(report).failure
    assert f is not None and f.cause == STALL
    assert render(f).message == "rank 2 finished the test without a send to rank 0; rank 0 waits in recv from rank 2"


def test_a_frozen_rank_is_reported_as_stopped_by_sigstop() -> None:
    sim = Sim(2)
    _rank0_in_barrier(sim)
    report = _report(
        timed_out=True,
        frozen={1},
        stopped={0: "timed out after 3 s", 1: "timed out after 3 s"},
        timeline=sim.timeline(),
    )
    f = classify(report).failure
    assert f is not None and f.ranks[1].state == "frozen"
    assert "  rank 1: stopped (SIGSTOP)" in render(f).text.splitlines()


def test_a_rank_fixture_that_fails_to_set_up_is_reported_at_setup() -> None:
    report = _report(
        results={0: _failed(0, "OSError: no data", phase="setup")},
        exits={0: RankExit(0, 100, 0, None), 1: RankExit(1, 101, None, signal.SIGKILL, True)},
        stopped={1: "stopped after rank 0 failed"},
        first_failure=0,
    )
    f = classify(report, setup_done={1}).failure
    assert f is not None and f.phase == "setup"
    assert "  rank 0: failed in fixture setup: OSError: no data" in render(f).text


def test_a_rank_still_setting_up_when_the_run_hung_is_a_setup_error() -> None:
    report = _report(timed_out=True, stopped={0: "timed out", 1: "timed out"})
    assert classify(report, setup_done={0}).failure.phase == "setup"
    assert classify(report, setup_done={0, 1}).failure.phase == "call"


def test_a_run_that_hangs_after_every_body_passed_hangs_in_teardown() -> None:
    report = _report(timed_out=True, stopped={0: "timed out", 1: "timed out"})
    verdict = classify(report, setup_done={0, 1}, body_passed={0, 1})
    assert verdict.outcome == "passed" and verdict.teardown is not None and verdict.teardown.cause == HANG
    assert verdict.teardown.phase == "teardown"
    assert "  rank 0: still running, in a fixture's teardown after its body passed" in render(verdict.teardown).text
    # one body still running: the hang is the call's, and that rank is not said to tear down
    verdict = classify(report, setup_done={0, 1}, body_passed={1})
    assert verdict.outcome == "failed" and verdict.failure is not None and verdict.failure.phase == "call"
    lines = render(verdict.failure).text.splitlines()
    assert "  rank 0: still running" in lines
    assert "  rank 1: still running, in a fixture's teardown after its body passed" in lines


def test_a_fixture_teardown_that_fails_after_a_passing_body_leaves_the_test_passed() -> None:
    report = _report(results={0: _passed(0), 1: _failed(1, "RuntimeError: close", phase="teardown")})
    verdict = classify(report)
    assert verdict.outcome == "passed" and verdict.teardown is not None
    assert "error in fixture teardown inside the rank" in render(verdict.teardown).text


def test_a_rank_that_skipped_then_died_in_teardown_keeps_the_skip_and_errs_in_teardown() -> None:
    skipped = RankResult(1, "skipped", message="Skipped: no data", location=("test_x.py", 3))
    report = _report(
        results={0: RankResult(0, "skipped", message="Skipped: no data", location=("test_x.py", 3))},
        before_teardown={1: skipped},
        exits={1: RankExit(1, 101, 3, None)},
    )
    verdict = classify(report, setup_done={0, 1})
    assert (verdict.outcome, verdict.message, verdict.failure) == ("skipped", "Skipped: no data", None)
    torn = verdict.teardown
    assert torn is not None and (torn.cause, torn.phase, torn.culprits) == (DEATH, "teardown", [1])
    lines = render(torn).text.splitlines()
    assert lines[:3] == [
        "multirank test failed on rank 1 of 2",
        "  rank 0: skipped",
        "  rank 1: died in fixture teardown (exit code 3)",
    ]
    assert "rank 1 died: exit code 3 in a fixture's teardown, after its body skipped" in lines


def test_a_skip_on_some_ranks_stays_the_call_beside_another_ranks_teardown_error() -> None:
    skipped = RankResult(0, "skipped", message="Skipped: no data", location=("test_x.py", 3))
    verdict = classify(_report(results={0: skipped, 1: _failed(1, "RuntimeError: close", phase="teardown")}))
    assert (verdict.outcome, verdict.message) == ("skipped", "Skipped: no data (on rank 0; the other ranks passed)")
    assert verdict.teardown is not None and verdict.teardown.culprits == [1]


def test_a_body_failure_and_another_ranks_teardown_error_are_the_call_and_the_teardown() -> None:
    results = {0: _failed(0, "assert 0 == 1"), 1: _failed(1, "RuntimeError: close", phase="teardown")}
    verdict = classify(_report(results=results, first_failure=0))
    assert verdict.failure is not None and verdict.failure.culprits == [0]
    assert verdict.teardown is not None and verdict.teardown.culprits == [1]
    assert "RuntimeError" not in render(verdict.failure).text


def test_a_failure_then_a_death_in_teardown_is_the_call_or_under_an_xfail_a_teardown_error() -> None:
    report = _report(
        results={0: _passed(0)}, before_teardown={1: _failed(1, "assert 1 == 0")}, exits={1: RankExit(1, 101, 3, None)}
    )
    verdict = classify(report, setup_done={0, 1})
    f = verdict.failure
    assert f is not None and (f.cause, f.phase) == (DEATH, "call") and verdict.teardown is None
    # what an xfail marker expecting the failure makes of it: the body's failure, then the death
    expected = verdict.expected
    assert expected is not None and expected.failure is not None and expected.teardown is not None
    assert (expected.failure.cause, expected.failure.culprits) == (FAILURE, [1])
    assert (expected.teardown.cause, expected.teardown.phase) == (DEATH, "teardown")
    assert "    then died in fixture teardown (exit code 3)" in render(expected.teardown).text


def test_skips_and_xfails_merge_across_ranks() -> None:
    skipped = RankResult(1, "skipped", message="Skipped: no data", location=("test_x.py", 3))
    verdict = classify(_report(results={0: _passed(0), 1: skipped}))
    assert (verdict.outcome, verdict.message) == ("skipped", "Skipped: no data (on rank 1; the other ranks passed)")
    xfailed = RankResult(0, "xfailed", message="known")
    assert classify(_report(results={0: xfailed, 1: skipped})).outcome == "xfailed"


def test_ranks_that_skip_for_different_reasons_each_keep_theirs() -> None:
    def skip(rank: int, why: str) -> RankResult:
        return RankResult(rank, "skipped", message=f"Skipped: {why}", location=("test_x.py", 3))

    results = {0: _passed(0), 1: skip(1, "no data"), 2: skip(2, "no GPU"), 3: skip(3, "no data")}
    verdict = classify(_report(4, results=results))
    # each reason as pytest shows a plain skip's: no "Skipped: " inside the line
    assert verdict.message == "no data (on ranks 1,3); no GPU (on rank 2); the other ranks passed"
    same = _report(results={0: skip(0, "no data"), 1: skip(1, "no data")})
    assert classify(same).message == "Skipped: no data"


def test_each_of_a_split_failure_and_teardown_error_names_the_other_ranks_failure() -> None:
    results = {0: _failed(0, "assert 0 == 1"), 1: _failed(1, "RuntimeError: close", phase="teardown")}
    verdict = classify(_report(results=results, first_failure=0))
    assert verdict.failure is not None and verdict.teardown is not None
    assert (verdict.failure.beside, verdict.teardown.beside) == ({1: "teardown"}, {0: "call"})
    call, torn = render(verdict.failure).text.splitlines(), render(verdict.teardown).text.splitlines()
    assert call[2] == "  rank 1: body passed; its fixture teardown failed (see the error at teardown)"
    assert torn[1] == "  rank 0: its body failed (see the call)"


def test_a_teardown_error_that_is_a_peer_gone_after_a_body_failure_stays_its_consequence() -> None:
    gone = _failed(1, "RuntimeError: Connection closed by peer [127.0.0.1]:7605", phase="teardown")
    verdict = classify(_report(results={0: _failed(0, "assert 0 == 1"), 1: gone}, first_failure=0))
    assert verdict.teardown is None and verdict.failure is not None
    assert (verdict.failure.cause, verdict.failure.phase, verdict.failure.culprits) == (FAILURE, "call", [0])
    lines = render(verdict.failure).text.splitlines()
    assert lines[2].startswith("  rank 1: failed after rank 0, because its peer went away: RuntimeError: Connection")


def test_a_death_in_teardown_after_a_passing_body_beside_a_body_failure_is_the_teardowns() -> None:
    report = _report(results={0: _failed(0, "assert 0 == 1")}, exits={1: RankExit(1, 101, 3, None)}, first_failure=0)
    verdict = classify(report, setup_done={0, 1}, body_passed={1})
    f, torn = verdict.failure, verdict.teardown
    assert f is not None and (f.cause, f.phase, f.culprits, f.beside) == (FAILURE, "call", [0], {1: "teardown"})
    assert torn is not None and (torn.cause, torn.phase, torn.culprits, torn.beside) == (
        DEATH,
        "teardown",
        [1],
        {0: "call"},
    )
    assert "rank 1 died: exit code 3 in a fixture's teardown, after its body passed" in render(torn).text


def test_a_skip_in_a_fixtures_setup_then_a_death_is_the_call_and_the_death_an_error_in_teardown() -> None:
    skipped = RankResult(1, "skipped", message="Skipped: no data", location=("test_x.py", 3), phase="setup")
    report = _report(results={0: _passed(0)}, before_teardown={1: skipped}, exits={1: RankExit(1, 101, 3, None)})
    verdict = classify(report, setup_done={0})
    assert (verdict.outcome, verdict.message) == ("skipped", "Skipped: no data (on rank 1; the other ranks passed)")
    torn = verdict.teardown
    assert torn is not None and (torn.cause, torn.phase) == (DEATH, "teardown")
    assert "rank 1 died: exit code 3 in a fixture's teardown, after its setup skipped" in render(torn).text
