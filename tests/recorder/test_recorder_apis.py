"""Every API that issues a collective is recorded once, collectives pair by their group's real
sequence, asynchronous calls complete at their wait, and no order is ever proven wrongly."""

from __future__ import annotations

import pytest

PRELUDE = """
import pickle
import threading
import time
import pytest
import torch
import torch.distributed as dist
from pytest_ddphooks import TimelineAssertionError
"""


def run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_apis=PRELUDE + body)
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def test_methods_and_functions_are_paired_by_the_groups_real_sequence(pytester) -> None:
    """The false pass: rank 0 syncs through a method first, rank 1 through the function
    first. Paired by counting calls, the two dist.barrier() calls would be one collective and
    A would seem to happen before B, which really ran a second earlier."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_false_pass_refused(rank, recorder):
    pg = dist.group.WORLD
    if rank == 0:
        pg.barrier().wait()
        time.sleep(1.0)
        recorder.mark("A")
        dist.barrier()
    else:
        dist.barrier()
        recorder.mark("B")
        pg.barrier().wait()
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError, match="'A@0' does not happen before 'B@1'"):
        tl.assert_happens_before("A@0", "B@1")
    starts = [e for e in tl.for_rank(rank) if e.name == "dist.barrier" and e.phase == "start"]
    assert [(e.info["seq"], e.info.get("api")) for e in starts] == (
        [(1, "ProcessGroup.barrier"), (2, None)] if rank == 0 else [(1, None), (2, "ProcessGroup.barrier")]
    )
    assert tl.collective_mismatches() == []
""",
    )
    result.assert_outcomes(passed=1)


def test_a_call_the_recorder_cannot_see_without_a_flight_recorder_ends_the_groups_numbering(pytester) -> None:
    """Whether it was a collective (a gap: the numbering holds) or a send (a shift) nobody can
    tell: the rank's later calls on the group pair with nothing, and the assertion says why."""
    result = run(
        pytester,
        """
def unseen_all_reduce():
    # the pybind method itself, as native code calls it; without torch's flight recorder
    # nothing can see it
    dist.ProcessGroup.allreduce.__ddphooks_original__(dist.group.WORLD, [torch.ones(1)]).wait()

@pytest.fixture
def no_flight_recorder(monkeypatch):
    # as a torch built without the flight recorder, or with TORCH_FR_BUFFER_SIZE=0
    monkeypatch.setattr("pytest_ddphooks.recorder.native._dump", lambda: [])

@pytest.mark.multirank(world_size=2)
def test_gap(rank, recorder, no_flight_recorder):
    if rank == 0:
        unseen_all_reduce()
        time.sleep(0.5)
        recorder.mark("A")
        dist.all_reduce(torch.ones(1))
    else:
        dist.all_reduce(torch.ones(1))
        recorder.mark("B")
        unseen_all_reduce()
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError) as failed:
        tl.assert_happens_before("A@0", "B@1")
    said = " ".join(str(failed.value).split())
    assert "held nothing (switched off: TORCH_FR_BUFFER_SIZE=0?)" in said
    assert "all_reduce #? (unpaired)" in tl.swimlanes()
    assert tl.collective_mismatches() == [], "no two different collectives were paired"
""",
    )
    result.assert_outcomes(passed=1)


def test_a_send_or_receive_the_recorder_cannot_see_never_shifts_the_pairing(pytester) -> None:
    """A send issued through the dispatcher moves the group's count on the ranks it joins
    alone; counted as a collective, rank 0's first barrier would pair with rank 1's second (or a
    recorded send with the receive of the unseen message) and prove orders that did not hold.
    The flight recorder holds every collective and no send: what it does not hold ends the
    rank's numbering of the group."""
    result = run(
        pytester,
        """
def wait_for(path):
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)

def b_then_a_refused(rank, recorder, folder):
    # after a barrier, rank 1 marks b, then rank 0 marks a (told through a file): a@0 -> b@1 is false
    dist.barrier()
    if rank == 1:
        recorder.mark("b")
        (folder / "b").write_text("done")
    else:
        wait_for(folder / "b")
        recorder.mark("a")
    dist.barrier()
    with pytest.raises(TimelineAssertionError):
        recorder.timeline().assert_happens_before("a@0", "b@1")

def unseen_send(t, dst):
    pg = dist.distributed_c10d._get_default_group()
    torch.ops.c10d.send([t], pg.boxed(), dst, 0).wait()

def unseen_recv(t, src):
    pg = dist.distributed_c10d._get_default_group()
    torch.ops.c10d.recv_([t], pg.boxed(), src, 0).wait()

@pytest.mark.multirank(world_size=3)
def test_unseen_pair_shifts_no_barrier(rank, recorder, shared_tmp_path):
    t = torch.zeros(2)
    if rank == 0:
        unseen_send(t, 1)
    elif rank == 1:
        unseen_recv(t, 0)
    dist.barrier()  # one barrier on every rank
    if rank == 0:
        recorder.mark("b")
        (shared_tmp_path / "b").write_text("done")
    if rank == 2:
        wait_for(shared_tmp_path / "b")
        recorder.mark("a")  # after b
    dist.barrier()
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError) as refused:
        tl.assert_happens_before("a@2", "b@0")
    assert "nor torch's flight recorder saw" in " ".join(str(refused.value).split())

@pytest.mark.multirank(world_size=2)
def test_unseen_send_shifts_no_message(rank, recorder, shared_tmp_path):
    t = torch.zeros(2)
    if rank == 0:
        unseen_send(torch.ones(2), 1)  # message 1
        wait_for(shared_tmp_path / "b")
        recorder.mark("a")  # after b
        dist.send(torch.full((2,), 2.0), dst=1)  # message 2
    else:
        dist.recv(t, src=0)  # gets message 1
        recorder.mark("b")
        (shared_tmp_path / "b").write_text("done")
        dist.recv(t, src=0)
    with pytest.raises(TimelineAssertionError):
        recorder.timeline().assert_happens_before("a@0", "b@1")

@pytest.mark.multirank(world_size=3)
def test_dispatcher_monitored_barrier_shifts_nothing(rank, recorder, shared_tmp_path):
    pg = dist.distributed_c10d._get_default_group()
    # inside, rank 0 makes 4 sends and receives, the others 2 each
    torch.ops.c10d.monitored_barrier_(torch.zeros(1), pg.boxed(), [], 30000, False)
    dist.barrier()
    if rank == 0:
        recorder.mark("b")
        (shared_tmp_path / "b").write_text("done")
    dist.barrier()
    if rank == 1:
        wait_for(shared_tmp_path / "b")
        recorder.mark("a")
    dist.barrier()
    with pytest.raises(TimelineAssertionError):
        recorder.timeline().assert_happens_before("a@1", "b@0")

@pytest.mark.multirank(world_size=2)
def test_unseen_send_on_a_thread_inside_a_recorded_barrier_shifts_nothing(rank, recorder, shared_tmp_path):
    # the barrier's count moves by two: its own and the send's, which it must not take for its own
    if rank == 1:
        sending = threading.Thread(target=unseen_send, args=(torch.ones(2), 0))
        sending.start()
        dist.barrier()  # returns only once rank 0 received the unseen message
        sending.join()
    else:
        dist.recv(torch.zeros(2), src=1)
        dist.barrier()
    b_then_a_refused(rank, recorder, shared_tmp_path)

@pytest.mark.multirank(world_size=2)
def test_unseen_send_while_two_recorded_receives_run_shifts_nothing(rank, recorder, shared_tmp_path):
    if rank == 1:
        receivers = [threading.Thread(target=dist.recv, args=(torch.zeros(2), 0), kwargs={"tag": t}) for t in (3, 4)]
        for receiver in receivers:
            receiver.start()
        unseen_send(torch.ones(2), 0)  # while the receives run: the count moves by a call of neither
        for receiver in receivers:
            receiver.join()
    else:
        dist.recv(torch.zeros(2), src=1)  # the unseen message
        dist.send(torch.ones(2), dst=1, tag=3)
        dist.send(torch.ones(2), dst=1, tag=4)
    b_then_a_refused(rank, recorder, shared_tmp_path)

@pytest.mark.multirank(world_size=2)
def test_unseen_send_at_the_end_is_no_hang(rank, recorder):
    # the watch numbers calls as they are made: once the rank judged its count lost, it compares none
    pg = dist.distributed_c10d._get_default_group()
    if rank == 1:
        unseen_send(torch.ones(2), 0)
    else:
        dist.recv(torch.zeros(2), src=1)
    dist.all_reduce(torch.ones(1))
    torch.ops.c10d.barrier(torch.zeros(1), pg.boxed(), [], True, -1).wait()

@pytest.mark.multirank(world_size=2)
def test_unseen_collective_keeps_the_numbering(rank, recorder):
    # a collective the flight recorder holds is a gap, not a shift: later orders still hold
    pg = dist.distributed_c10d._get_default_group()
    torch.ops.c10d.barrier(torch.zeros(1), pg.boxed(), [], True, -1).wait()
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        recorder.mark("prepare")
    dist.barrier()
    recorder.mark("setup")
    tl = recorder.timeline()
    tl.assert_happens_before("prepare@0", "setup@1")
    assert not any(e.info.get("unsure") for e in tl.events)
""",
    )
    result.assert_outcomes(passed=7)


def test_collectives_native_code_issues_are_recorded_and_order_nothing(pytester) -> None:
    """DDP's constructor and reducer issue their collectives from C++: each is recorded once,
    in its place of the group's sequence, and none proves an order (its wait is unseen)."""
    result = run(
        pytester,
        """
from torch.nn.parallel import DistributedDataParallel

@pytest.mark.multirank(world_size=2)
def test_ddp(rank, recorder):
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    for step in range(2):
        if rank == 0:
            recorder.mark(f"before-{step}")
        model(torch.ones(3, 4)).sum().backward()
        recorder.mark(f"after-{step}")
    dist.barrier()
    recorder.mark("synced")
    tl = recorder.timeline()
    native = [e for e in tl.for_rank(rank) if e.phase == "start" and e.info.get("native")]
    ops = [(e.info["op"], e.info["native"]) for e in native]
    assert ("all_reduce", "gloo:all_reduce") in ops, ops  # the gradient buckets
    assert ("broadcast", "gloo:broadcast") in ops, ops  # the constructor's parameter broadcast
    assert all(e.info["api"] == "native" for e in native)
    seqs = [e.info["seq"] for e in tl.for_rank(rank) if e.phase == "start" and e.info.get("seq")]
    assert seqs == list(range(1, len(seqs) + 1)), "every collective has its place: no gap"
    assert tl.collective_mismatches() == [] and tl.never_waited() == []
    with pytest.raises(TimelineAssertionError) as failed:
        tl.assert_happens_before("before-1@0", "after-1@1")
    assert "issued from native code (gloo:all_reduce): its completion cannot be seen, so it orders nothing" in str(
        failed.value
    )
    tl.assert_happens_before("before-1@0", "synced@1")  # the barrier does order it
""",
    )
    result.assert_outcomes(passed=1)


def test_a_native_collective_against_another_call_is_a_desync_found_at_once(pytester) -> None:
    result = run(
        pytester,
        """
from torch.nn.parallel import DistributedDataParallel

@pytest.mark.multirank(world_size=2, timeout=60)
def test_barrier_on_one_rank_only(rank):
    if rank == 0:
        dist.barrier()  # rank 1 goes on to build DDP: its shape check is an all_gather
    DistributedDataParallel(torch.nn.Linear(4, 2))
""",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "desync: collective #1 on the default group: rank 0 barrier(), rank 1 all_gather(int64[1])",
            "hang: the ranks were stopped after * s, not at the 60 s limit:*",
            "  rank 1: waiting in all_gather #1 on the default group, issued from native code (gloo:all_gather), *",
        ]
    )


def test_async_work_orders_from_its_wait(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_waited(rank, recorder):
    if rank == 0:
        recorder.mark("before")
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    recorder.mark("after")
    tl = recorder.timeline()
    tl.assert_happens_before("before@0", "after@1")
    assert tl.never_waited() == []

@pytest.mark.multirank(world_size=2)
def test_method_work_orders_from_its_wait(rank, recorder):
    if rank == 0:
        recorder.mark("before")
    dist.group.WORLD.allreduce([torch.ones(2)]).wait()
    recorder.mark("after")
    recorder.timeline().assert_happens_before("before@0", "after@1")

@pytest.mark.multirank(world_size=2)
def test_never_waited(rank, recorder):
    if rank == 0:
        recorder.mark("before")
    work = dist.all_reduce(torch.ones(2), async_op=True)
    recorder.mark("after")
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError, match="asynchronous on rank 1 and never waited for there"):
        tl.assert_happens_before("before@0", "after@1")
    assert tl.never_waited() == [
        "async all_reduce #1 on rank 0 was never waited",
        "async all_reduce #1 on rank 1 was never waited",
    ]
    work.wait()

@pytest.mark.multirank(world_size=2)
def test_send_recv_async(rank, recorder):
    t = torch.zeros(2)
    if rank == 0:
        recorder.mark("sent")
        dist.isend(t, 1).wait()
    else:
        dist.irecv(t, 0).wait()
        recorder.mark("received")
    recorder.timeline().assert_happens_before("sent@0", "received@1")

@pytest.mark.multirank(world_size=2)
def test_send_recv_refuses_the_receiver_before_the_sender(rank, recorder):
    t = torch.ones(1)
    recorder.mark("before")
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    recorder.mark("after")
    tl = recorder.timeline()
    tl.assert_happens_before("before@0", "after@1")
    with pytest.raises(TimelineAssertionError) as refused:
        tl.assert_happens_before("before@1", "after@0")
    said = "send/recv 0->1 on the default group, which orders only the sender (rank 0) before the receiver (rank 1)"
    assert said in str(refused.value)
    assert "never entered" not in str(refused.value)
""",
    )
    result.assert_outcomes(passed=5)


def test_monitored_barrier_of_a_new_group_orders_like_lightnings_infinite_barrier(pytester) -> None:
    result = run(
        pytester,
        """
class Strategy:
    def barrier(self, group):
        group.monitored_barrier()

@pytest.mark.multirank(world_size=2)
def test_infinite_barrier(rank, recorder):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    group = dist.new_group(backend="gloo")
    if rank == 0:
        recorder.mark("prepare_data")
    strategy.barrier(group)
    recorder.mark("setup")
    tl = recorder.timeline()
    tl.assert_happens_before("prepare_data@0", "setup")
    assert tl.noop_barriers() == []
    api = [e.info.get("api") for e in tl.for_rank(rank) if e.name == "dist.monitored_barrier" and e.phase == "start"]
    assert api == ["ProcessGroup.monitored_barrier"]

@pytest.mark.multirank(world_size=2)
def test_async_barrier_never_waited_is_a_noop(rank, recorder):
    class Strategy:
        def barrier(self):
            self.work = dist.barrier(async_op=True)
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    strategy.barrier()
    found = [str(nb) for nb in recorder.timeline().noop_barriers()]
    assert found == [
        f"no-op barrier: 'barrier' on rank {r} (event #2) issued only asynchronous collectives,"
        " and waited for none of them before it returned"
        for r in (0, 1)
    ]
    strategy.work.wait()

@pytest.mark.multirank(world_size=2)
def test_async_barrier_waited_only_after_it_returned_is_a_noop(rank, recorder):
    class Strategy:
        def barrier(self):
            self.work = dist.all_reduce(torch.ones(1), async_op=True)
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    recorder.mark("before")
    strategy.barrier()
    recorder.mark("after")
    strategy.work.wait()
    tl = recorder.timeline()
    assert [nb.rank for nb in tl.noop_barriers()] == [0, 1]
    with pytest.raises(TimelineAssertionError, match="no-op barrier: 'barrier' on rank 1"):
        tl.assert_happens_before("before@0", "after@1")

@pytest.mark.multirank(world_size=2)
def test_async_barrier_waited_inside_is_no_noop(rank, recorder):
    class Strategy:
        def barrier(self):
            dist.all_reduce(torch.ones(1), async_op=True).wait()
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    recorder.mark("before")
    strategy.barrier()
    recorder.mark("after")
    tl = recorder.timeline()
    assert tl.noop_barriers() == []
    tl.assert_happens_before("before@0", "after@1")
""",
    )
    result.assert_outcomes(passed=4)


def test_an_asynchronous_call_completes_where_python_learns_it_did(pytester) -> None:
    """Polled until ``is_completed()`` (or its future's ``done()``), its future (or one made
    from it) waited for or given to ``torch.futures.wait_all``, its Work waited for after
    ``get_future()``; a functional collective's result used through a view, one result of a
    coalesced call used, an all-gather along dimension 1 (it waits inside): the call completed
    there (it was said never waited, handed out of sight, or a barrier made of it a no-op). A
    poll that found it running completes nothing; a result never used was never waited."""
    result = run(
        pytester,
        """
from datetime import timedelta
import torch.distributed._functional_collectives as funcol

def complete(how):
    group = dist.group.WORLD
    if how.startswith("funcol"):
        if how == "funcol view":
            assert funcol.all_reduce(torch.ones(4), "sum", group)[:2].tolist() == [2.0, 2.0]
        elif how == "funcol coalesced":
            outs = funcol.all_reduce_coalesced([torch.ones(2), torch.ones(3)], "sum", group)
            assert outs[1].tolist() == [2.0] * 3
        else:
            assert funcol.all_gather_tensor(torch.ones(2, 1), 1, group).shape == (2, 2)
        return
    work = dist.all_reduce(torch.ones(2), async_op=True)
    if how == "is_completed":
        while not work.is_completed():
            pass
    elif how == "future.wait":
        work.get_future().wait()
    elif how == "wait_all":
        torch.futures.wait_all([work.get_future()])
    elif how == "then":
        work.get_future().then(lambda future: future.value()).wait()
    elif how == "collect_all":
        torch.futures.collect_all([work.get_future()]).wait()
    elif how == "work.wait after get_future":
        work.get_future()
        work.wait()
    else:
        future = work.get_future()
        while not future.done():
            pass

HOW = ["is_completed", "future.wait", "wait_all", "future.done", "then", "collect_all", "work.wait after get_future"]

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("how", HOW + ["funcol view", "funcol coalesced", "funcol gather_dim_1"])
def test_completed(rank, recorder, how):
    class Strategy:
        def barrier(self):
            complete(how)
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    recorder.mark("a")
    strategy.barrier()
    recorder.mark("b")
    tl = recorder.timeline()
    assert tl.never_waited() == []
    tl.assert_no_noop_barriers()
    tl.assert_happens_before("a@0", "b@1")
    tl.assert_happens_before("a@1", "b@0")

@pytest.mark.multirank(world_size=2)
def test_still_running(rank, recorder):
    other = dist.new_group([0, 1])
    if rank == 1:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        assert work.is_completed() is False  # rank 0 enters it only after the barrier below
        recorder.mark("b")
        dist.barrier(group=other)
        work.wait()
    else:
        dist.barrier(group=other)
        recorder.mark("a")
        dist.all_reduce(torch.ones(2))
    tl = recorder.timeline()
    assert not tl.happens_before("a@0", "b@1")
    waits = [e for e in tl.for_rank(1) if e.name == "dist.all_reduce.wait" and e.phase == "start"]
    assert len(waits) == 1  # work.wait(), not the poll

@pytest.mark.multirank(world_size=2, timeout=30)
def test_failed_poll(rank, recorder):
    # done, with an error (rank 1 never enters it, the group times out): no completion
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 0:
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        while not work.is_completed():
            pass
        assert work.exception() is not None
    tl = recorder.timeline()
    assert not [e for e in tl.for_rank(0) if e.name == "dist.all_reduce.wait"]
    if rank == 0:
        with pytest.raises(Exception):
            work.wait()

@pytest.mark.multirank(world_size=2)
def test_unused(rank, recorder):
    out = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
    recorder.mark("after")
    tl = recorder.timeline()
    assert tl.never_waited() == [f"async all_reduce #1 on rank {r} was never waited" for r in (0, 1)]
    out.wait()

@pytest.mark.multirank(world_size=2)
def test_poll_prints_nothing(rank, recorder, capfd):
    # how the recorder tells a Work that ended well is no deprecated call torch warns of
    work = dist.all_reduce(torch.ones(2), async_op=True)
    while not work.is_completed():
        pass
    assert [e.name for e in recorder.timeline().for_rank(rank) if e.phase == "start"][-1] == "dist.all_reduce.wait"
    assert capfd.readouterr().err == ""
""",
    )
    result.assert_outcomes(passed=14)


def test_a_functional_result_first_used_inside_a_recorded_call_completes_there(pytester) -> None:
    """torch waits for a functional collective where its result is first used: inside
    ``dist.broadcast(r)`` that wait was dropped with the calls a recorded call makes, so the
    all-reduce was named never waited and ordered nothing. Here only the all-reduce orders a@0
    before b@1 (the broadcast is on a group of the rank alone); unused, it orders nothing."""
    result = run(
        pytester,
        """
import torch.distributed._functional_collectives as funcol

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("used", [True, False])
def test_first_use(rank, recorder, used):
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    if rank == 0:
        recorder.mark("a")
    r = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    if used:
        dist.broadcast(r, src=rank, group=alone)
    if rank == 1:
        recorder.mark("b")
    tl = recorder.timeline()
    if used:
        assert tl.never_waited() == []
        tl.assert_happens_before("a@0", "b@1")
    else:
        assert not tl.happens_before("a@0", "b@1")
        r.wait()
""",
    )
    result.assert_outcomes(passed=2)


def test_torch_compile_of_code_that_calls_collectives_runs_as_without_the_plugin(pytester) -> None:
    """dynamo once traced into the recorder's wrappers and failed (an opaque group object,
    a function it skips); the compiled graph's collectives are read as native ones."""
    result = run(
        pytester,
        """
import torch.distributed._functional_collectives as funcol

def with_c10d(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1

def with_funcol(x):
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

@pytest.mark.multirank(world_size=2, timeout=200)
@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled(rank, recorder, fullgraph):
    if not fullgraph:
        assert torch.compile(with_c10d, backend="eager")(torch.ones(2)).tolist() == [5.0, 5.0]
    assert torch.compile(with_funcol, backend="eager", fullgraph=fullgraph)(torch.ones(2)).tolist() == [5.0, 5.0]
    assert not any("recorder_error" in e.info for e in recorder.timeline().events)
""",
    )
    result.assert_outcomes(passed=2)


def test_calls_a_coalescing_manager_queues_order_nothing_its_coalesced_call_does(pytester) -> None:
    """Inside ``dist._coalescing_manager`` an all-reduce or all-gather only queues: the manager
    issues them as one coalesced call at its exit. Recorded as collectives of their own, the
    queued calls proved an order although torch raised at the exit and nothing was sent."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("async_ops", [False, True])
def test_coalesced(rank, recorder, async_ops):
    recorder.mark("before")
    with dist._coalescing_manager(async_ops=async_ops) as manager:
        dist.all_reduce(torch.ones(2), async_op=async_ops)
        dist.all_reduce(torch.ones(3), async_op=async_ops)
    if async_ops:
        manager.wait()
    recorder.mark("after")
    tl = recorder.timeline()
    assert tl.never_waited() == []
    tl.assert_happens_before("before@0", "after@1")  # through the coalesced call
    assert "= all_reduce (queued)" in tl.swimlanes() and "= all_reduce_coalesced #1" in tl.swimlanes()

@pytest.mark.multirank(world_size=2)
def test_never_issued(rank, recorder):
    a, out = torch.ones(2), torch.zeros(4)
    recorder.mark("before")
    with pytest.raises(RuntimeError, match="same type"):
        with dist._coalescing_manager():
            dist.all_reduce(a)
            dist.all_gather_into_tensor(out, torch.ones(2))
    assert a.tolist() == [1.0, 1.0]  # nothing was sent
    recorder.mark("after")
    tl = recorder.timeline()
    with pytest.raises(TimelineAssertionError, match="only queued by a coalescing manager"):
        tl.assert_happens_before("before@0", "after@1")
""",
    )
    result.assert_outcomes(passed=3)


def test_a_shape_that_differs_only_in_view_is_no_desync(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2, timeout=20)
def test_views(rank, recorder):
    t = torch.ones(2, 2)
    dist.all_reduce(t.view(-1) if rank == 0 else t)
    dist.group.WORLD.allreduce([t]).wait()
    assert recorder.timeline().collective_mismatches() == []

@pytest.mark.multirank(world_size=2, timeout=5)
def test_element_counts_differ(rank, recorder):
    dist.all_reduce(torch.ones(4 if rank == 0 else 3))

@pytest.mark.multirank(world_size=2, timeout=20)
def test_gather_counts_differ(rank, recorder):
    n = 2 if rank == 0 else 3
    dist.all_gather([torch.zeros(n), torch.zeros(n)], torch.ones(n))
""",
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        ["desync: collective #1 on the default group: rank 0 all_reduce(float32[[]4]), rank 1 all_reduce(float32[[]3])"]
    )
    # gloo refuses a list all-gather whose members' inputs differ in size (NCCL would take it)
    result.stdout.fnmatch_lines(
        ["desync: collective #1 on the default group: rank 0 all_gather(float32[[]2]), rank 1 all_gather(float32[[]3])"]
    )


def test_a_mismatch_the_test_looks_at_itself_is_expected(pytester) -> None:
    """A mismatch gloo runs (a reduce op that differs) failed every test as a desync, also one
    that provoked it to check ``collective_mismatches()``: such a test could never pass. One the
    body finds itself is its to judge; one it did not look at, or that a rank then failed on,
    is the desync it was."""
    result = run(
        pytester,
        """
def differing_ops(rank):
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)

@pytest.mark.multirank(world_size=2)
def test_looked_at(rank, recorder):
    differing_ops(rank)
    tl = recorder.timeline()
    (found,) = tl.collective_mismatches()
    assert (found.group, found.seq) == ("default", 1)
    with pytest.raises(TimelineAssertionError, match="op=MAX"):
        tl.assert_collectives_match()
    assert pickle.loads(pickle.dumps(tl)).collective_mismatches() == [found]  # what it tells the recorder is not kept

@pytest.mark.multirank(world_size=2)
def test_a_second_one_it_was_not_given(rank, recorder):
    differing_ops(rank)
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MIN if rank == 0 else dist.ReduceOp.SUM)
    (found,) = recorder.timeline().collective_mismatches()  # each group's first only
    assert found.seq == 1

@pytest.mark.multirank(world_size=2)
def test_never_completed(rank, recorder):
    work = dist.broadcast(torch.ones(4), src=rank, async_op=True)  # from each rank itself: no one receives
    assert len(recorder.timeline().collective_mismatches()) == 1

@pytest.mark.multirank(world_size=3)
def test_a_member_came_after_the_look(rank, recorder):
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
    work = dist.all_reduce(torch.ones(4), op=ops[rank], async_op=True) if rank < 2 else None
    (found,) = recorder.timeline().collective_mismatches()
    assert found.calls[2] is None
    if rank == 2:  # enters it after the look, calling yet another thing
        dist.all_reduce(torch.ones(4), op=ops[rank])
    else:
        work.wait()

@pytest.mark.multirank(world_size=2)
def test_not_looked_at(rank, recorder):
    differing_ops(rank)
    recorder.timeline()

@pytest.mark.multirank(world_size=2)
def test_asserted(rank, recorder):
    differing_ops(rank)
    recorder.timeline().assert_collectives_match()

@pytest.mark.multirank(world_size=2)
def test_looked_at_one_of_two(rank, recorder):
    differing_ops(rank)
    assert len(recorder.timeline().collective_mismatches()) == 1
    differing_ops(1 - rank)  # a second one, after the body looked
""",
    )
    result.assert_outcomes(passed=1, failed=6)
    result.stdout.fnmatch_lines(["*_ test_a_second_one_it_was_not_given _*", "desync: collective #1 on the default *"])
    result.stdout.fnmatch_lines(["*_ test_never_completed _*", "desync: collective #1 on the default group: *"])
    result.stdout.fnmatch_lines(["*_ test_a_member_came_after_the_look _*", "desync: collective #1 on *"])
    desync = (
        "desync: collective #1 on the default group:"
        " rank 0 all_reduce(float32[[]4]), rank 1 all_reduce(float32[[]4], op=MAX)"
    )
    for test in ("test_not_looked_at", "test_asserted", "test_looked_at_one_of_two"):
        result.stdout.fnmatch_lines([f"*_ {test} _*", desync])


def test_a_collective_that_raised_before_reaching_the_group_takes_no_place_in_its_sequence(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("who", ["rank0", "both"])
def test_bad_root(rank, recorder, who):
    if who == "both" or rank == 0:
        with pytest.raises(RuntimeError):
            dist.broadcast(torch.ones(1), src=5)  # no rank 5: refused before any message
    recorder.mark("a")
    dist.all_reduce(torch.ones(1))
    recorder.mark("b")
    tl = recorder.timeline()
    tl.assert_happens_before("a@0", "b@1")
    tl.assert_happens_before("a@1", "b@0")
    assert tl.collective_mismatches() == []
""",
    )
    result.assert_outcomes(passed=2)


def test_instrumenting_twice_records_once(pytester) -> None:
    result = run(
        pytester,
        """
class Hooks:
    def setup(self):
        pass

@pytest.fixture
def hooks(recorder):
    return recorder.instrument(Hooks())

def test_twice(hooks, recorder):
    recorder.instrument(hooks, "setup")
    recorder.instrument(Hooks, "setup")
    recorder.instrument(hooks, "setup", prefix="again")
    hooks.setup()
    names = [e.name for e in recorder.timeline().events if e.phase == "start"]
    assert names == ["again.setup", "setup"] or names == ["setup", "again.setup"]
""",
    )
    result.assert_outcomes(passed=1)


def test_a_timeline_larger_than_the_stores_payload_limit(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2, timeout=120)
def test_big(rank, recorder):
    for i in range(150_000):
        recorder.mark("tick", i=i)
    tl = recorder.timeline()
    assert len(tl.events) == 300_000 + 2 * 2  # and each rank's group creation
""",
    )
    result.assert_outcomes(passed=1)


def test_a_hang_in_a_method_barrier_names_the_group_the_op_and_who_never_came(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2, timeout=20)
def test_hangs(rank):
    group = dist.new_group(backend="gloo")
    if rank == 0:
        group.monitored_barrier()

@pytest.mark.multirank(world_size=2, timeout=20)
def test_hangs_in_a_wait(rank, shared_tmp_path):
    issued = shared_tmp_path / "issued"
    if rank == 0:
        work = dist.group.WORLD.allreduce([torch.ones(2)])
        issued.touch()
        work.wait()
    else:  # leaves once rank 0 is past the issue: what it waits in is then the wait
        while not issued.exists():
            time.sleep(0.01)
""",
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_hangs _*",
            "hang: the ranks were stopped after * s, not at the 20 s limit: they wait for ranks that finished the test",
            "  rank 0: blocked in monitored_barrier #1 on group 1 (ranks 0,1) for *",
            "    ranks that never entered monitored_barrier #1: 1",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_hangs_in_a_wait _*",
            "hang: the ranks were stopped after * s, not at the 20 s limit: they wait for ranks that finished the test",
            "  rank 0: blocked in the wait of all_reduce #1 on the default group for *",
            "    ranks that never entered all_reduce #1: 1",
        ]
    )


def test_a_passing_test_that_never_waited_for_async_work_is_warned_about(pytester) -> None:
    result = run(
        pytester,
        """
KEEP = []

@pytest.mark.multirank(world_size=2)
def test_forgets_to_wait(rank):
    KEEP.append(dist.all_reduce(torch.ones(2), async_op=True))
    dist.barrier()

@pytest.mark.multirank(world_size=2)
def test_waits(rank):
    dist.all_reduce(torch.ones(2), async_op=True).wait()
""",
    )
    result.assert_outcomes(passed=2, warnings=2)
    result.stdout.fnmatch_lines(
        [
            "*test_apis.py::test_forgets_to_wait",
            "*NeverWaitedWarning: async all_reduce #1 on rank 0 was never waited",
            "*NeverWaitedWarning: async all_reduce #1 on rank 1 was never waited",
        ]
    )
    result.stdout.no_fnmatch_line("*test_waits*")


def test_work_handed_to_a_future_is_neither_unwaited_nor_an_order(pytester) -> None:
    # DDP's Python comm hooks hand each bucket's all-reduce to the reducer through get_future(),
    # which waits for it in C++ (here: a future of torch's own that collects it, waited for)
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_future(rank, recorder):
    if rank == 0:
        recorder.mark("before")
    future = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    torch._C._collect_all([future]).wait()
    recorder.mark("after")
    tl = recorder.timeline()
    assert tl.never_waited() == []
    with pytest.raises(TimelineAssertionError, match="handed to a future .Work.get_future.*orders nothing"):
        tl.assert_happens_before("before@0", "after@1")
""",
    )
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*NeverWaitedWarning*")


WAIT_TIMED_OUT = """
from datetime import timedelta


def enter_after_a_timed_out_wait(rank, shared_tmp_path):
    # rank 1 enters only once rank 0's first wait has timed out: that wait cannot succeed
    signal = shared_tmp_path / "timed out"
    if rank == 0:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        with pytest.raises(RuntimeError):
            work.wait(timeout=timedelta(milliseconds=50))
        signal.touch()
        return work
    while not signal.exists():
        time.sleep(0.01)
    recorder_mark("before")
    dist.all_reduce(torch.ones(2))
    return None
"""


def test_a_wait_after_one_that_timed_out_completes_the_call(pytester) -> None:
    result = run(
        pytester,
        WAIT_TIMED_OUT.replace("recorder_mark", "RECORDER.mark")
        + """
RECORDER = None

@pytest.mark.multirank(world_size=2)
def test_waits_again(rank, recorder, shared_tmp_path):
    global RECORDER
    RECORDER = recorder
    work = enter_after_a_timed_out_wait(rank, shared_tmp_path)
    if rank == 0:
        work.wait()
        recorder.mark("after")
    tl = recorder.timeline()
    tl.assert_happens_before("before@1", "after@0")
    assert tl.never_waited() == []
    waits = [e for e in tl.for_rank(0) if e.name == "dist.all_reduce.wait" and e.phase == "end"]
    assert [bool(e.info.get("error")) for e in waits] == [True, False], "the time-out, then the wait"

@pytest.mark.multirank(world_size=2)
def test_never_waits_again(rank, recorder, shared_tmp_path):
    global RECORDER
    RECORDER = recorder
    KEEP.append(enter_after_a_timed_out_wait(rank, shared_tmp_path))
    recorder.mark("after")
    tl = recorder.timeline()
    assert tl.never_waited() == ["async all_reduce #1 on rank 0 was never waited"]
    with pytest.raises(TimelineAssertionError, match="asynchronous on rank 0 and never waited for there"):
        tl.assert_happens_before("before@1", "after@0")

KEEP = []
""",
    )
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*NeverWaitedWarning: async all_reduce #1 on rank 0 was never waited"])


def test_joins_notification_handed_to_the_reducer_is_not_unwaited(pytester) -> None:
    # with uneven inputs, Join's all-reduce each step is waited for by DDP's reducer, in C++
    result = run(
        pytester,
        """
from torch.distributed.algorithms.join import Join

@pytest.mark.multirank(world_size=2)
def test_uneven_inputs(rank, recorder):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    with Join([model]):
        for _ in range(3 if rank == 0 else 2):
            model(torch.ones(2, 4)).sum().backward()
    tl = recorder.timeline()
    assert tl.never_waited() == []
    handed = [e for e in tl.for_rank(rank) if e.name == "dist.all_reduce.to_reducer" and e.phase == "start"]
    assert handed and all(e.info.get("future") for e in handed)
    # DDP's own all-reduce for the joined ranks, which a rank that has not joined never waits for
    left = [e for e in tl.for_rank(rank) if e.name == "dist.all_reduce.left_running" and e.phase == "start"]
    assert left and all(e.info.get("future") for e in left)
    tl.assert_collectives_match()
""",
    )
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*NeverWaitedWarning*")


def test_a_barrier_whose_collective_raised_and_was_swallowed_is_a_noop(pytester) -> None:
    result = run(
        pytester,
        """
class Strategy:
    def barrier(self, root):
        try:
            dist.broadcast(torch.zeros(1), src=root)
        except (RuntimeError, ValueError):
            pass  # a framework that logs and goes on

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("root", [0, 5])
def test_swallowed(rank, recorder, root):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    strategy.barrier(root)
    found = recorder.timeline().noop_barriers()
    if root == 0:
        assert found == []
    else:
        assert [nb.reason for nb in found] == [
            "issued no collective: the ones it called raised before they reached the group"
        ] * 2
""",
    )
    result.assert_outcomes(passed=2)


def test_a_collective_on_an_empty_tensor_orders_nothing(pytester) -> None:
    """gloo returns from an all-reduce of no element at once, without the other ranks: a
    framework barrier made of one is a no-op, and no order is proven through it. The same
    barrier on one element orders (silent)."""
    result = run(
        pytester,
        """
class Strategy:
    def __init__(self, elements, how):
        self.elements, self.how = elements, how

    def barrier(self):
        t = torch.zeros(self.elements)
        pg = dist.group.WORLD
        if self.how == "function":
            dist.all_reduce(t)
        elif self.how == "method":
            pg.allreduce([t]).wait()
        elif self.how == "method by keyword":  # the payload read from the keyword too
            pg.allreduce(tensors=[t]).wait()
        else:
            pg.allgather(output_tensors=[[torch.zeros_like(t), torch.zeros_like(t)]], input_tensors=[t]).wait()

@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("elements", [0, 1])
@pytest.mark.parametrize("how", ["function", "method", "method by keyword", "all-gather by keyword"])
def test_barrier_of(rank, recorder, elements, how):
    strategy = Strategy(elements, how)
    recorder.instrument_barrier(strategy, "barrier")
    if rank == 0:
        recorder.mark("prepare_data")
    strategy.barrier()
    recorder.mark("setup")
    tl = recorder.timeline()
    if elements:
        tl.assert_happens_before("prepare_data@0", "setup")
        assert tl.noop_barriers() == []
        return
    with pytest.raises(TimelineAssertionError, match="on a tensor with no element: gloo returns from it"):
        tl.assert_happens_before("prepare_data@0", "setup@1")
    assert [nb.reason for nb in tl.noop_barriers()] == [
        "issued only collectives on tensors with no element, which wait for nobody"
    ] * 2
""",
    )
    result.assert_outcomes(passed=8)


def test_a_barrier_that_only_queued_or_only_posted_a_receive_is_a_noop(pytester) -> None:
    result = run(
        pytester,
        """
from torch.distributed.distributed_c10d import _coalescing_manager

class Strategy:
    def __init__(self, rank):
        self.rank, self.work = rank, None

    def queueing(self):
        dist.all_reduce(torch.ones(1))  # inside an open coalescing manager: only queued

    def posting(self):
        if self.rank == 1:
            self.work = dist.irecv(torch.zeros(1), src=0)  # not waited inside
        else:
            self.work = dist.isend(torch.ones(1), dst=1)

    def receiving(self):
        if self.rank == 1:
            dist.irecv(torch.zeros(1), src=0).wait()
        else:
            dist.send(torch.ones(1), dst=1)

@pytest.mark.multirank(world_size=2)
def test_only_queued(rank, recorder):
    strategy = Strategy(rank)
    recorder.instrument_barrier(strategy, "queueing")
    with _coalescing_manager():
        strategy.queueing()
        dist.all_reduce(torch.ones(1))
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [
        "issued no collective: it only queued some in a coalescing manager, which issued them after it returned"
    ] * 2

@pytest.mark.multirank(world_size=2)
def test_only_posted(rank, recorder):
    strategy = Strategy(rank)
    recorder.instrument_barrier(strategy, "posting")
    strategy.posting()
    strategy.work.wait()
    assert [nb.reason for nb in recorder.timeline().noop_barriers()] == [
        "issued only asynchronous sends or receives, and waited for none of them before it returned"
    ] * 2

@pytest.mark.multirank(world_size=2)
def test_a_receive_waited_inside_is_no_noop_for_the_receiver(rank, recorder):
    strategy = Strategy(rank)
    recorder.instrument_barrier(strategy, "receiving")
    strategy.receiving()
    # the sender's barrier waits for nobody in gloo's eyes either way: only the receiver is judged here
    assert 1 not in [nb.rank for nb in recorder.timeline().noop_barriers()]
""",
    )
    result.assert_outcomes(passed=3)


def test_a_barrier_issued_through_the_dispatcher_is_no_noop(pytester) -> None:
    """Its collective is found in the flight recorder (native): it waited out of sight, as DDP's do."""
    result = run(
        pytester,
        """
class Strategy:
    def barrier(self):
        pg = dist.distributed_c10d._get_default_group()
        torch.ops.c10d.barrier(torch.zeros(1), pg.boxed(), [], True, -1).wait()

    def idle(self):
        pass

@pytest.mark.multirank(world_size=2)
def test_dispatcher_barrier(rank, recorder):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    recorder.instrument_barrier(strategy, "idle")
    strategy.barrier()
    strategy.idle()
    dist.barrier()
    tl = recorder.timeline()
    assert "barrier #1 (native)" in tl.swimlanes()
    assert [(nb.rank, nb.name) for nb in tl.noop_barriers()] == [(0, "idle"), (1, "idle")]
""",
    )
    result.assert_outcomes(passed=1)
