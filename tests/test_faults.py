"""Faults injected at a recorded point of a rank, each kind firing and not firing, the verdict
rules, elastic restarts with and without a death, and the errors of arming them."""

from __future__ import annotations

PRELUDE = """
import os
import time
import pytest
import torch
import torch.distributed as dist
from pytest_ddphooks import FaultError, InjectedFault


def two_steps():
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.all_reduce(t)
"""


def test_a_killed_peer_makes_the_other_rank_fail_fast_and_the_test_passes(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_peer_death_fails_fast(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#2")
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # rank 0 sees gloo's closed connection, never a hang
        two_steps()
    assert time.monotonic() - started < 5
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    assert ran.seconds < 25


def test_the_report_says_what_was_injected_where_and_when(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_rank0_does_not_expect_it(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#2")
    two_steps()
"""
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines("rank 1 was killed by the injected fault kill(at='dist.all_reduce#2') at event #*")
    ran.lines("*rank 0: failed after rank 1, because its peer went away: RuntimeError: *")


def test_a_fault_whose_point_is_never_reached_fails_the_test(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_one_step_only(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#2")
    dist.all_reduce(torch.ones(1))

@pytest.mark.multirank(world_size=2, timeout=30)
def test_a_mark_never_made(rank, faults, recorder):
    faults.delay(rank=0, at="mark:checkpoint", seconds=0.1)

@pytest.mark.multirank(world_size=2, restarts=1, timeout=30)
def test_an_attempt_that_never_comes(rank, faults, recorder):
    faults.kill(rank=0, at="mark:x", attempt=1)  # nothing dies in attempt 0: no attempt 1
    recorder.mark("x")

@pytest.mark.multirank(world_size=2, timeout=30)
def test_armed_after_its_point(rank, faults, recorder):
    recorder.mark("step")
    recorder.mark("step")
    faults.raise_(rank=1, at="mark:step#2")  # '#2' counts from the rank's start: passed already

@pytest.mark.multirank(world_size=2, timeout=30)
def test_armed_between_its_calls(rank, faults, recorder):
    recorder.mark("step")
    faults.raise_(rank=1, at="mark:step#2", exc=ValueError("second step"))
    if rank == 1:
        with pytest.raises(ValueError, match="second step"):
            recorder.mark("step")
"""
    )
    ran.result.assert_outcomes(failed=4, passed=1)
    ran.lines(
        "*FaultError: raise_(rank=1, at='mark:step#2'): rank 1 was past that point when the fault was armed"
        " (it had reached it 2 times; '#n' counts from the rank's start): arm it earlier, or name a later call"
    )
    ran.lines(
        "injected fault kill(rank=0, at='mark:x', attempt=1) never fired: attempt 1 never ran"
        " (the test ended in attempt 0)"
    )
    ran.lines("injected fault kill(rank=1, at='dist.all_reduce#2') never fired: rank 1 made 1 all_reduce call")
    ran.lines(
        "injected fault delay(rank=0, at='mark:checkpoint', seconds=0.1) never fired:"
        " rank 0 marked 'checkpoint' 0 times"
    )


def test_a_fault_only_another_rank_armed_or_one_that_leaves_no_rank_fails_the_test(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_only_rank_0_arms(rank, faults):
    if rank == 0:
        faults.kill(rank=1, at="dist.barrier#1")
    dist.barrier()

@pytest.mark.multirank(world_size=2, timeout=30)
def test_every_rank_killed(rank, faults):
    faults.kill(rank=[0, 1], at="dist.barrier#1")
    dist.barrier()
    assert False, "never reached"

@pytest.mark.multirank(world_size=2, restarts=1, timeout=30)
def test_every_rank_killed_then_a_clean_attempt(rank, faults, restart_count):
    faults.kill(rank=[0, 1], at="dist.barrier#1")  # attempt 0 only
    dist.barrier()
    assert restart_count == 1

# the rank skips before the fault's point: the skip is the story, not "never fired"
@pytest.mark.multirank(world_size=2, timeout=30)
def test_skips_before_its_fault(rank, faults):
    faults.kill(rank=1, at="dist.barrier#1")
    pytest.skip("no data for this case")
"""
    )
    ran.result.assert_outcomes(failed=2, passed=1, skipped=1)
    ran.lines(
        "injected fault kill(rank=1, at='dist.barrier#1') never fired: rank 1, where it acts, never armed it"
        " (rank 0 did; a fault acts only on a rank that arms it: arm it on every rank)"
    )
    ran.lines(
        "no rank finished the test: injected faults took out ranks 0,1, so nothing after them was tested"
        " (leave a rank to see what follows the fault)"
    )


def test_a_stopped_rank_is_frozen_and_a_hang_after_it_says_so(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=3)
def test_peer_frozen_in_barrier(rank, faults):
    faults.stop(rank=1, at="dist.barrier#1")
    dist.barrier()
"""
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "rank 1 was stopped by the injected fault stop(at='dist.barrier#1') at event #*",
        "hang: the test did not finish within 3 s (2 ranks), after the injected SIGSTOP of rank 1",
        "  rank 0: blocked in barrier #1 on the default group for *",
        "*",
        "  rank 1: stopped (SIGSTOP): stopped by the injected fault stop(at='dist.barrier#1') at event #*",
        "    it was stopped as it entered barrier #1 on the default group, not yet inside it",
    )
    ran.no_lines("*stopped inside*")
    ran.lines("rank 0 stack, MainThread (most recent call last):")


def test_a_stopped_rank_the_others_do_not_need_lets_the_test_pass(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_frozen_rank_alone(rank, faults, recorder):
    faults.stop(rank=1, at="mark:alone")
    if rank == 1:
        recorder.mark("alone")
"""
    )
    ran.result.assert_outcomes(passed=1)
    assert ran.seconds < 25


def test_a_delay_slows_the_rank_at_its_point(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_slow_peer(rank, faults):
    faults.delay(rank=[1], at="dist.barrier#1", seconds=0.4)
    started = time.monotonic()
    dist.barrier()
    assert time.monotonic() - started >= 0.35  # rank 0 waited for its slow peer
"""
    )
    ran.result.assert_outcomes(passed=1)


def test_raise_injects_an_exception_at_the_point(inner) -> None:
    ran = inner(
        PRELUDE
        + """
class Trainer:
    def setup(self):
        pass

@pytest.mark.multirank(world_size=2, timeout=30)
def test_raises_at_setup(rank, faults, recorder):
    trainer = recorder.instrument(Trainer())
    faults.raise_(rank=0, at="start:setup")
    faults.raise_(rank=1, at="end:setup", exc=ValueError("bad data"))
    expected = InjectedFault if rank == 0 else ValueError
    with pytest.raises(expected, match="injected fault raise_" if rank == 0 else "bad data"):
        trainer.setup()

@pytest.mark.multirank(world_size=2, timeout=30)
def test_not_caught(rank, faults):
    faults.raise_(rank=1, at="dist.barrier#1")
    dist.barrier()
"""
    )
    ran.result.assert_outcomes(passed=1, failed=1)
    ran.lines("*rank 1: failed: pytest_ddphooks.InjectedFault: injected fault raise_(at='dist.barrier#1')*")


def test_bad_faults_are_errors_at_arming(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
@pytest.mark.parametrize("case", range(11))
def test_arm(rank, faults, case):
    arm = [
        lambda: faults.kill(rank=1, at="dist.all_reduse#2"),
        lambda: faults.kill(rank=1, at="middle:setup"),
        lambda: faults.kill(rank=1, at="dist.barrier#0"),
        lambda: faults.kill(rank=2, at="dist.barrier#1"),
        lambda: faults.kill(rank=1, at="dist.barrier#1", signal="SIGNOPE"),
        lambda: faults.delay(rank=1, at="dist.barrier#1", seconds=-1),
        lambda: faults.raise_(rank=1, at="dist.barrier#1", exc=UnicodeDecodeError),
        lambda: faults.kill(rank=1, at="dist.barrier#1", attempt=1),  # the test has no restarts
        lambda: faults.kill(rank=1, at="dist.barrier#1", signal="SIGSTOP"),
        lambda: faults.kill(rank=1, at="dist.barrier#1", signal="tstp"),
        lambda: faults.kill(rank=1, at="dist.barrier#\u00b2"),  # a superscript two is no count
    ][case]
    with pytest.raises(FaultError) as bad:
        arm()
    print(bad.value)

def test_outside_a_multirank_test(faults):
    faults.kill(rank=0, at="dist.barrier#1")
""",
        "-s",
        subprocess=True,
    )
    ran.result.assert_outcomes(passed=11, failed=1)
    ran.lines("*[[]rank 0[]] at='dist.all_reduse#2': the recorder names no call 'dist.all_reduse' (it records *")
    ran.lines("*[[]rank 0[]] at='middle:setup': not a point the recorder knows; use 'dist.<op>#n', *")
    ran.lines("*[[]rank 0[]] at='dist.barrier#0': the count after '#' must be a number >= 1")
    ran.lines("*[[]rank 0[]] rank=2: a rank is an int from 0 to 1")
    ran.lines("*[[]rank 0[]] signal='SIGNOPE': not a signal name (e.g. 'SIGKILL', 'SIGTERM')")
    ran.lines("*[[]rank 0[]] seconds=-1: a delay is a number of seconds >= 0")
    ran.lines(
        "*[[]rank 0[]] exc=UnicodeDecodeError: cannot be made without arguments (TypeError: *):"
        " give an instance, such as exc=UnicodeDecodeError(...)"
    )
    ran.lines("*[[]rank 0[]] attempt=1: the test has no restarts, so only attempt 0 runs: give it restarts=1 or more")
    for given, name in (("'SIGSTOP'", "SIGSTOP"), ("'tstp'", "SIGTSTP")):
        ran.lines(
            f"*[[]rank 0[]] signal={given}: {name} stops the rank rather than killing it: use faults.stop(rank, at),"
            " which freezes it and kills it at the end of the test"
        )
    ran.lines("*[[]rank 0[]] at='dist.barrier#\u00b2': the count after '#' must be a number >= 1")
    ran.lines("*FaultError: faults act on the ranks of a multirank test*")


def test_a_rank_that_dies_is_restarted_with_every_other_rank(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_resumes(rank, faults, restart_count, shared_tmp_path):
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(restart_count)
    (shared_tmp_path / f"attempt{restart_count}-rank{rank}").write_text(str(os.getpid()))
    faults.kill(rank=1, at="dist.all_reduce#2")  # attempt 0 only
    two_steps()
    assert restart_count == 1
    assert sorted(p.name for p in shared_tmp_path.iterdir()) == [
        "attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    pids = {p.read_text() for p in shared_tmp_path.iterdir()}
    assert len(pids) == 4, "fresh processes"

@pytest.mark.multirank(world_size=2, restarts=2)
def test_no_death_no_restart(rank, restart_count):
    assert restart_count == 0
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=2)
    ran.lines(
        "*- Captured attempts call -*",
        "attempt 0: rank 0 * after rank 1* rank 1 killed by the injected fault"
        " kill(at='dist.all_reduce#2') at event #*",
        "attempt 1: rank 0 passed; rank 1 passed",
    )


def test_before_a_restart_the_surviving_ranks_get_two_seconds_to_end_on_their_own(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_survivor_ends(rank, faults, recorder, restart_count):
    faults.kill(rank=1, at="mark:die")
    recorder.mark("die")
    if rank == 0 and restart_count == 0:
        time.sleep(1.4)  # more than a failure's grace, within a restart's

@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_survivor_busy(rank, restart_count):
    if restart_count == 0:
        if rank == 1:
            os._exit(3)
        time.sleep(30)
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=2)
    ran.lines(
        "attempt 0: rank 0 passed; rank 1 killed by the injected fault kill(at='mark:die') at event #*",
        "attempt 1: rank 0 passed; rank 1 passed",
    )
    ran.lines(
        "attempt 0: rank 0 stopped after rank 1 died (exit code 3); rank 1 died (exit code 3)",
        "attempt 1: rank 0 passed; rank 1 passed",
    )


def test_a_test_whose_last_attempt_fails_reports_every_attempt(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_dies_twice(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#1", attempt=0)
    faults.kill(rank=1, at="dist.all_reduce#1", attempt=1)
    dist.all_reduce(torch.ones(1))

# rank 0 copes with the death and finishes every attempt: its line says so, as the verdict does
@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_copes(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#1", attempt=0)
    faults.kill(rank=1, at="dist.all_reduce#1", attempt=1)
    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1))
        assert False, "rank 0 finished"
    dist.all_reduce(torch.ones(1))
"""
    )
    ran.result.assert_outcomes(failed=2)
    ran.lines("attempt 1: rank 0 failed; rank 1 killed by the injected fault *", "*rank 0: failed: AssertionError: *")
    ran.lines(
        "attempt 0: rank 0 * after rank 1* rank 1 killed by the injected fault *",
        "attempt 1: *rank 1 killed by the injected fault kill(at='dist.all_reduce#1', attempt=1) at event #*",
        "no restart left: restarts=1 were all used",
    )
    # the last attempt's line and the verdict tell the same story of rank 0
    assert "the test is over" not in ran.text
    ran.lines(
        "attempt 1: rank 0 failed after rank 1, because its peer went away; rank 1 killed by the injected fault *",
        "*rank 0: failed after rank 1, because its peer went away: *",
    )


def test_a_raise_as_a_collective_begins_means_the_rank_never_entered_it(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=60)
def test_rank1_gives_up_on_its_second_step(rank, faults):
    faults.raise_(rank=1, at="dist.all_reduce#2")
    try:
        two_steps()
    except InjectedFault:
        pass

@pytest.mark.multirank(world_size=2, timeout=60)
def test_rank1_retries(rank, faults, recorder):
    faults.raise_(rank=1, at="dist.all_reduce#2")
    try:
        two_steps()
    except InjectedFault:
        dist.all_reduce(torch.ones(2))  # the retry is the second all_reduce of the group
    recorder.timeline().assert_collectives_match()
""",
        "-rA",
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that finished the test",
        "  rank 1 finished the test without calling all_reduce #2 on the default group; rank 0 waits in it",
    )
    assert ran.seconds < 30


def test_a_rank_waiting_for_one_a_fault_killed_is_stopped_naming_it(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=60)
def test_timeline_after_a_kill(rank, faults, recorder):
    faults.kill(rank=1, at="dist.all_reduce#2")
    if rank == 0:
        with pytest.raises(RuntimeError):
            two_steps()
        recorder.timeline()  # rank 1 can never join it
    else:
        two_steps()

@pytest.mark.multirank(world_size=3, timeout=60)
def test_ring_of_three(rank, faults):
    faults.kill(rank=2, at="dist.all_reduce#1")
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError:
        if rank == 0:
            raise
""",
        "-rA",
    )
    ran.result.assert_outcomes(failed=2)
    ran.lines(
        "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that were killed by an"
        " injected fault",
        "  rank 1, killed by the injected fault, can never take part in timeline(); rank 0 waits in it",
    )
    assert ran.seconds < 40


def test_a_fault_at_a_collective_only_native_code_issued_says_why_it_never_fired(inner) -> None:
    ran = inner(
        PRELUDE
        + """
from torch.nn.parallel import DistributedDataParallel as DDP

@pytest.mark.multirank(world_size=2, timeout=60)
def test_ddp_buckets(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#1")
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
""",
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "injected fault kill(rank=1, at='dist.all_reduce#1') never fired: rank 1 made 0 all_reduce calls a fault can"
        " act at, and 1 more that native code issued (DDP's gradient buckets, a compiled graph) or that a Recorder"
        " of the test's own took, which the harness sees only afterwards (for DDP, a Python comm hook makes each"
        " bucket's all-reduce a point)"
    )


def test_a_rank_left_in_a_group_join_by_one_a_fault_killed_is_stopped_naming_it(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=60)
def test_kill_in_new_group(rank, faults):
    faults.kill(rank=1, at="dist.new_group")
    dist.new_group([0, 1])

@pytest.mark.multirank(world_size=2, timeout=60, init_process_group=False)
def test_kill_in_init(rank, faults):
    faults.kill(rank=1, at="dist.init_process_group")
    dist.init_process_group("gloo")

# killed once the join is done: nobody waits for it there, and the test passes
@pytest.mark.multirank(world_size=2, timeout=60)
def test_kill_after_new_group(rank, faults, recorder):
    faults.kill(rank=1, at="mark:joined")
    dist.new_group([0, 1])
    recorder.mark("joined")
""",
        "-rA",
    )
    ran.result.assert_outcomes(failed=2, passed=1)
    for op in ("new_group", "init_process_group"):
        ran.lines(
            "hang: the ranks were stopped after * s, not at the 60 s limit: they wait for ranks that were killed by"
            " an injected fault",
            f"  rank 1, killed by the injected fault, can never take part in {op}; rank 0 waits in it",
            f"  rank 0: blocked in {op} for * s",
        )
    assert ran.seconds < 40


def test_a_kill_with_the_signal_the_harness_dumps_stacks_on_still_kills(inner) -> None:
    ran = inner(
        PRELUDE
        + """
# the crash signals, whose dumps faulthandler arms all at once, kill as a crash does; a name
# in any case is a signal's name
@pytest.mark.multirank(world_size=2, timeout=60)
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGSEGV", "abrt", "SIGBUS", "SIGFPE", "SIGILL"])
def test_usr1_kills(rank, faults, sig):
    faults.kill(rank=1, at="dist.all_reduce#2", signal=sig)
    if rank == 0:
        with pytest.raises(RuntimeError):
            two_steps()
    else:
        two_steps()
        raise AssertionError(f"rank 1 outlived its {sig}")

# Python's own KeyboardInterrupt is no handler of the test's: a SIGINT kill kills, wherever
# the point is reached (Python sets handlers from the main thread only)
@pytest.mark.multirank(world_size=2, timeout=60)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_sigint_kills(rank, faults, recorder, where):
    import threading
    faults.kill(rank=1, at="mark:here", signal="SIGINT")
    if where == "main":
        recorder.mark("here")
    else:
        worker = threading.Thread(target=recorder.mark, args=("here",))
        worker.start()
        worker.join()
    assert rank == 0, "rank 1 outlived its SIGINT"

@pytest.mark.multirank(world_size=2, timeout=60)
def test_winch_is_ignored(rank, faults):
    faults.kill(rank=1, at="dist.all_reduce#2", signal="SIGWINCH")
    two_steps()
    assert rank == 0
""",
        "-rA",
    )
    ran.result.assert_outcomes(failed=1, passed=8)
    ran.no_lines("*core dumped*")
    ran.lines(
        "rank 1 was sent the signal of the injected fault kill(at='dist.all_reduce#2', signal='SIGWINCH') at event #*,"
        " and lived on (it handles or ignores it)"
    )


def test_a_rank_that_failed_before_its_fault_is_not_said_to_have_never_armed_it(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=60)
def test_rank1_fails_first(rank, faults):
    if rank == 1:
        raise FileNotFoundError("data.bin")
    faults.kill(rank=1, at="dist.all_reduce#1")
    dist.all_reduce(torch.ones(2))

@pytest.mark.multirank(world_size=2, timeout=60)
def test_armed_too_late(rank, faults):
    two_steps()
    faults.kill(rank=1, at="dist.all_reduce#2")
""",
        "-rA",
    )
    ran.result.assert_outcomes(failed=2)
    ran.lines("*rank 1: failed: FileNotFoundError: data.bin")
    ran.lines("*rank 1: failed: pytest_ddphooks.FaultError: kill(rank=1, at='dist.all_reduce#2'): rank 1 was past*")
    ran.no_lines("*never fired*")
    ran.no_lines("*faults.py*")  # the error ends at the test's own line


def test_a_hang_behind_an_injected_delay_says_the_rank_sleeps_there(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=3)
def test_long_delay(rank, faults):
    faults.delay(rank=1, at="dist.all_reduce#1", seconds=100)
    two_steps()
"""
    )
    ran.result.assert_outcomes(failed=1)
    ran.lines(
        "  rank 1: delayed by the injected fault delay(at='dist.all_reduce#1', seconds=100) at event #*: sleeping"
        " there as it entered all_reduce #1 on the default group, not yet inside it"
    )
    ran.no_lines("  rank 1: blocked in*")


def test_a_delay_and_a_raise_at_one_call_both_act_whichever_was_armed_first(inner) -> None:
    # the delay sleeps as the call begins, then the raise ends it before it reaches the group:
    # rank 1 never enters, rank 0 never calls it, and nobody waits for anybody
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=20)
@pytest.mark.parametrize("raise_first", [False, True])
def test_delay_and_raise(rank, faults, raise_first):
    if raise_first:
        faults.raise_(rank=1, at="dist.all_reduce#1")
    faults.delay(rank=1, at="dist.all_reduce#1", seconds=1.0)
    if not raise_first:
        faults.raise_(rank=1, at="dist.all_reduce#1")
    if rank == 1:
        started = time.monotonic()
        with pytest.raises(InjectedFault):
            dist.all_reduce(torch.ones(1))
        assert time.monotonic() - started >= 1.0, "the delay acted before the raise"
""",
    )
    ran.result.assert_outcomes(passed=2)
    ran.no_lines("*never fired*")
    ran.no_lines("hang: *")


def test_a_fault_refused_as_armed_too_late_and_caught_is_not_said_never_armed(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_refusal_caught(rank, faults, recorder):
    recorder.mark("step")
    recorder.mark("step")
    try:  # every rank arms it; rank 1, where it acts, is past its point and says so
        faults.raise_(rank=1, at="mark:step#2")
    except FaultError:
        assert rank == 1
""",
    )
    ran.result.assert_outcomes(passed=1)
    ran.no_lines("*never fired*")


def test_a_process_left_in_an_attempt_that_ended_in_a_restart_is_reported(inner) -> None:
    ran = inner(
        PRELUDE
        + """
import subprocess

@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_leaks_then_restarts(rank, faults, restart_count):
    faults.kill(rank=1, at="dist.barrier#2")  # attempt 0 only
    if rank == 0 and restart_count == 0:
        subprocess.Popen(["sleep", "300"])
    dist.barrier()  # rank 0 started its process before rank 1 leaves this
    dist.barrier()
""",
    )
    ran.result.assert_outcomes(passed=1, errors=1)
    ran.lines("*rank 0 left process * running (killed) (attempt 0): sleep 300*")


def test_what_a_rank_the_harness_stopped_had_running_is_no_leak_of_the_attempt(inner) -> None:
    # rank 0 is busy (a DataLoader's workers, a child it waits for) when rank 1 dies: the harness
    # stops it to restart, and what it had running is the interrupted attempt's, killed with it
    # as torchrun would, not a process the test left behind
    ran = inner(
        PRELUDE
        + """
import subprocess

@pytest.mark.multirank(world_size=2, restarts=1, timeout=60)
def test_stuck_then_restarts(rank, faults, recorder, restart_count, shared_tmp_path):
    faults.kill(rank=1, at="mark:started")  # attempt 0 only
    started = shared_tmp_path / "started"
    if rank == 0 and restart_count == 0:
        worker = subprocess.Popen(["sleep", "300"])
        started.touch()
        worker.wait()
    while restart_count == 0 and not started.exists():  # rank 1 dies once the process runs
        time.sleep(0.01)
    recorder.mark("started")
    dist.barrier()
""",
        "-rA",
    )
    ran.result.assert_outcomes(passed=1)
    ran.lines("attempt 0: rank 0 stopped after rank 1 *", "attempt 1: rank 0 passed; rank 1 passed")
    ran.no_lines("*left process*")


def test_a_fault_after_the_one_that_took_its_rank_out_never_fires_and_says_why(inner) -> None:
    ran = inner(
        PRELUDE
        + """
@pytest.mark.multirank(world_size=2, timeout=30)
def test_killed_before_its_second_fault(rank, faults):
    faults.kill(rank=1, at="dist.barrier#1")
    faults.delay(rank=1, at="dist.barrier#2", seconds=0.1)  # rank 1 never gets there
    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.barrier()
    else:
        dist.barrier()
        dist.barrier()

@pytest.mark.multirank(world_size=2, timeout=30)
def test_killed_at_its_only_fault(rank, faults):
    faults.kill(rank=1, at="dist.barrier#1")
    if rank == 0:
        with pytest.raises(RuntimeError):
            dist.barrier()
    else:
        dist.barrier()
""",
    )
    ran.result.assert_outcomes(failed=1, passed=1)
    ran.lines(
        "*injected fault delay(rank=1, at='dist.barrier#2', seconds=0.1) never fired: rank 1 was killed by the"
        " injected fault kill(at='dist.barrier#1') first*"
    )
