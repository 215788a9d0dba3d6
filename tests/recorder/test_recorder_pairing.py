"""Collectives are paired across ranks only where their place in the group's sequence is
certain: whatever moves one rank's count of a group (a send or receive through any API, a
call another thread is running, a group created again under an old name, a call that raised
before it reached the group) never shifts the pairing, so no order is proven wrongly. Each
case here once made two different collectives one, and proved an order that did not hold."""

from __future__ import annotations

import pytest

PRELUDE = """
import sys
import threading
import time
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pytest_ddphooks import TimelineAssertionError

def seqs(tl, rank, name):
    return [e.info.get("seq") for e in tl.for_rank(rank) if e.name == name and e.phase == "start"]

def inside(thread, function):  # whether the thread is inside a call of that function now
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None

def refused(tl, a, b):
    with pytest.raises(TimelineAssertionError, match=f"'{a}' does not happen before '{b}'") as failed:
        tl.assert_happens_before(a, b)
    return str(failed.value)
"""


def run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makepyfile(test_pairing=PRELUDE + body)
    return pytester.runpytest("-p", "no:cacheprovider")


def test_receives_through_any_api_are_counted_as_the_ranks_own(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("how", ["anysource", "backend"])
def test_receive(rank, recorder, how):
    pg, t, x = dist.group.WORLD, torch.ones(3), torch.ones(1)
    if rank == 0:
        pg.send([t], 1, 0).wait()
    elif how == "anysource":
        pg.recv_anysource([t], 0).wait()
    else:
        pg._get_backend(torch.device("cpu")).recv([t], 0, 0).wait()
    recorder.mark("before")
    dist.all_reduce(x)
    recorder.mark("a" if rank == 0 else "b")  # between the same two all-reduces: unordered
    dist.all_reduce(x)
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == seqs(tl, 1, "dist.all_reduce") == [1, 2]
    refused(tl, "a@0", "b@1")
    refused(tl, "b@1", "a@0")
    tl.assert_happens_before("before@0", "b@1")  # the first all-reduce orders it
    api = "ProcessGroup.recv_anysource" if how == "anysource" else "Backend.recv"
    assert [e.info.get("api") for e in tl.for_rank(1) if e.name == "dist.recv" and e.phase == "start"] == [api]
""",
    )
    result.assert_outcomes(passed=2)


def test_a_collective_issued_while_another_thread_is_inside_a_receive_pairs_with_nothing(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_thread(rank, recorder):
    x, t = torch.ones(1), torch.zeros(2)
    if rank == 0:
        receiver = threading.Thread(target=dist.recv, args=(t,), kwargs={"src": 1})
        receiver.start()
        while not inside(receiver, "recv"):  # its receive has begun (it waits for rank 1's send)
            time.sleep(0.005)
        dist.all_reduce(x)  # counted before or after the receive: nobody can know
        receiver.join()
        recorder.mark("a")
        dist.all_reduce(x)
        recorder.mark("c")
    else:
        dist.all_reduce(x)
        recorder.mark("b")
        dist.send(t, 0)
        dist.all_reduce(x)
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == [None, 2] and seqs(tl, 1, "dist.all_reduce") == [1, 2]
    text = refused(tl, "a@0", "b@1")
    assert "it is paired with nothing" in text and "another thread of the rank was inside a call" in text
    assert "= all_reduce #? (unpaired)" in tl.swimlanes()
    tl.assert_happens_before("b@1", "c@0")  # the second all-reduce, paired by its certain number
""",
    )
    result.assert_outcomes(passed=1)


def test_a_collective_another_threads_call_overtakes_after_it_was_numbered_pairs_with_nothing(pytester) -> None:
    """A thread's all-reduce is numbered #1 as it begins, alone on the group; before it reaches
    torch the main thread's all-reduce overtakes it, and gloo matches the thread's with rank 1's
    second. Paired by its number, it proved an order no synchronisation made."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_overtaken(rank, recorder):
    if rank == 0:
        numbered = threading.Event()
        def hold(frame, event, arg):  # numbered, not yet issued: the main thread goes first
            if event == "call" and frame.f_code.co_name == "begin" and not numbered.is_set():
                numbered.set()
                time.sleep(0.3)
        got = []
        def body():
            sys.setprofile(hold)
            recorder.mark("before")
            x = torch.tensor([1.0])
            dist.all_reduce(x)
            sys.setprofile(None)
            got.append(x.item())
        thread = threading.Thread(target=body)
        thread.start()
        numbered.wait()
        dist.all_reduce(torch.tensor([100.0]))
        thread.join()
        assert got == [4.0]  # the thread's met rank 1's second all-reduce (1 + 3)
    else:
        dist.all_reduce(torch.tensor([2.0]))
        recorder.mark("between")
        dist.all_reduce(torch.tensor([3.0]))
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == [None, None] and seqs(tl, 1, "dist.all_reduce") == [1, 2]
    text = refused(tl, "before@0", "between@1")
    assert "another thread of the rank began a collective on the group before it returned" in text
    assert tl.swimlanes().count("= all_reduce #? (unpaired)") == 2
""",
    )
    result.assert_outcomes(passed=1)


def test_a_collective_that_ran_alone_keeps_its_number_beside_threads_calls_on_other_groups(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_alone(rank, recorder):
    other = dist.new_group([0, 1])
    if rank == 0:
        started = threading.Event()
        def on_other():
            started.set()
            dist.all_reduce(torch.ones(1), group=other)  # waits for rank 1's, after 'between'
        recorder.mark("before")
        dist.all_reduce(torch.ones(1))
        thread = threading.Thread(target=on_other)
        thread.start()
        started.wait()
        dist.all_reduce(torch.ones(1))
        thread.join()
    else:
        dist.all_reduce(torch.ones(1))
        recorder.mark("between")
        dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1), group=other)
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == [1, 1, 2] or seqs(tl, 0, "dist.all_reduce") == [1, 2, 1]
    tl.assert_happens_before("before@0", "between@1")
    assert "#? (unpaired)" not in tl.swimlanes()
""",
    )
    result.assert_outcomes(passed=1)


def test_a_send_another_thread_begins_beside_a_collective_leaves_it_paired(pytester) -> None:
    """A send moves the rank's own count, not the collective's place among the group's
    collectives: the collective keeps its number, proves its order, and a desync of it is one."""
    result = run(
        pytester,
        """
def send_beside():
    main = threading.main_thread()
    def send():
        while not inside(main, "all_reduce"):  # the main thread's collective has begun: send now
            time.sleep(0.005)
        dist.send(torch.ones(1), dst=1)
    thread = threading.Thread(target=send)
    thread.start()
    return thread

@pytest.mark.multirank(world_size=2, timeout=20)
def test_paired(rank, recorder):
    if rank == 0:
        thread = send_beside()
        dist.all_reduce(torch.ones(1))  # returns once rank 1 received, then entered its own
        recorder.mark("after")
        thread.join()
    else:
        recorder.mark("before")
        dist.recv(torch.zeros(1), src=0)
        dist.all_reduce(torch.ones(1))
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == seqs(tl, 1, "dist.all_reduce") == [1]
    tl.assert_happens_before("before@1", "after@0")

@pytest.mark.multirank(world_size=2, timeout=20)
def test_desync(rank):
    if rank == 0:
        thread = send_beside()
        dist.all_reduce(torch.ones(1))
        thread.join()
    else:
        dist.recv(torch.zeros(1), src=0)
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX)
""",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["desync: collective #1 on the default group: rank 0 all_reduce(*), rank 1 *op=MAX)"])


def test_a_collective_another_thread_counted_already_is_no_unseen_call(pytester) -> None:
    """A thread's all-reduce has moved the group's counter when the main thread's begins: that
    move was once taken for a call the recorder did not see, and the flight recorder's entry of
    the thread's own all-reduce was added again as a native call."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_two_threads(rank, recorder):
    x = torch.ones(1)
    if rank == 0:
        worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(1),))
        worker.start()
        group = dist.distributed_c10d._get_default_group()
        while group._get_sequence_number_for_group() < 1:  # the worker's call has counted
            time.sleep(0.005)
        dist.all_reduce(x)
        worker.join()
    else:
        dist.all_reduce(x)
        dist.all_reduce(x)
    tl = recorder.timeline()
    calls = [e for e in tl.for_rank(0) if e.name == "dist.all_reduce" and e.phase == "start"]
    assert len(calls) == 2 and not any(e.info.get("native") for e in calls)
    assert "(native)" not in tl.swimlanes()
    assert not any(e.info.get("unseen") for e in tl.for_rank(0))  # no call counted as unseen
""",
    )
    result.assert_outcomes(passed=1)


def test_a_group_created_again_under_its_old_name_starts_a_sequence_of_its_own(pytester) -> None:
    result = run(
        pytester,
        """
def again(group, rank, n):
    name = group.group_name
    dist.destroy_process_group(group)
    dist.barrier()
    if rank == 0:  # torch's own rendezvous would read the old group's keys
        for r in range(n):
            dist.distributed_c10d._get_default_store().delete_key(f"{name}//cpu//0/{r}")
    dist.barrier()
    second = dist.new_group(list(range(n)), use_local_synchronization=True)
    assert second.group_name == name
    return second

@pytest.mark.multirank(world_size=3, timeout=60)
def test_again(rank, recorder):
    first = dist.new_group([0, 1, 2], use_local_synchronization=True)
    t, x = torch.ones(2), torch.ones(1)
    if rank == 0:
        dist.send(t, 1, group=first)
    elif rank == 1:
        dist.recv(t, 0, group=first)
    second = again(first, rank, 3)
    dist.all_reduce(x, group=second)
    recorder.mark("a" if rank == 0 else "b")
    dist.all_reduce(x, group=second)
    tl = recorder.timeline()
    refused(tl, "a@0", "b@2")
    groups = {e.info["group"] for e in tl.for_rank(rank) if e.name == "dist.all_reduce" and e.phase == "start"}
    assert len(groups) == 1 and next(iter(groups)).endswith("+2")
    assert seqs(tl, rank, "dist.all_reduce") == [1, 2]
    assert tl.collective_mismatches() == []
""",
    )
    result.assert_outcomes(passed=1)


def test_a_monitored_barrier_that_raised_before_sending_gives_its_number_back(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_monitored(rank, recorder):
    if rank == 1:
        with pytest.raises(TypeError):
            dist.monitored_barrier(timeout=30)  # a number, not a timedelta: nothing was sent
    dist.monitored_barrier()
    recorder.mark("a" if rank == 0 else "b")
    dist.monitored_barrier()
    tl = recorder.timeline()
    refused(tl, "a@0", "b@1")
    assert [s for s in seqs(tl, 1, "dist.monitored_barrier")][-2:] == seqs(tl, 0, "dist.monitored_barrier") == [1, 2]
""",
    )
    result.assert_outcomes(passed=1)


def test_the_same_collective_through_two_apis_is_no_desync(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("pair", ["reduce_scatter", "all_gather", "all_reduce"])
def test_two_apis(rank, recorder, pair):
    if pair == "reduce_scatter":
        data = torch.arange(4.0)
        if rank == 0:
            out = torch.empty(2)
            dist.reduce_scatter_tensor(out, data)
        else:
            out = funcol.reduce_scatter_tensor(data, "sum", 0, dist.group.WORLD) + 0
        assert out.tolist() == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
    elif pair == "all_gather":
        mine = torch.full((2,), float(rank))
        if rank == 0:
            parts = [torch.empty(2), torch.empty(2)]
            dist.all_gather(parts, mine)
            out = torch.cat(parts)
        else:
            out = torch.empty(4)
            dist.all_gather_into_tensor(out, mine)
        assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
    else:
        t = torch.ones(3)
        dist.all_reduce(t) if rank == 0 else dist.all_reduce_coalesced([t])
        assert t.tolist() == [2.0] * 3
    assert recorder.timeline().collective_mismatches() == []

@pytest.mark.multirank(world_size=2)
def test_a_real_desync_still_is_one(rank):
    t = torch.ones(3) if rank == 0 else torch.ones(3, dtype=torch.float64)
    dist.all_reduce(t)
""",
    )
    result.assert_outcomes(passed=3, failed=1)
    desync = "desync: collective #1 on the default group: rank 0 all_reduce(float32[3]), rank 1 all_reduce(float64[3])"
    assert desync in result.stdout.str()


def test_an_isend_never_waited_is_named_as_an_irecv_is(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("wait", [False, True])
def test_isend(rank, recorder, wait):
    t = torch.ones(2)
    if rank == 0:
        recorder.mark("before")
        work = dist.isend(t, 1)
        if wait:
            work.wait()
    else:
        dist.recv(t, 0)
        recorder.mark("after")
    dist.barrier()
    tl = recorder.timeline()
    assert tl.never_waited() == ([] if wait else ["async send/recv 0->1 on rank 0 was never waited"])
    tl.assert_happens_before("before@0", "after@1")  # the send's start, received
""",
    )
    result.assert_outcomes(passed=2)


# How one rank's log numbers a group's collectives when its threads interleave calls on the
# group (what the counter read before each call can and cannot tell), without ranks.


def _log():
    from pytest_ddphooks.recorder.log import EventLog

    log = EventLog(rank=0, world_size=2)
    log.group_created("default", None, 0)
    return log


def test_a_send_of_one_thread_never_shifts_the_numbers_of_the_next_collectives() -> None:
    log = _log()
    log.opened("default", collective=False)
    log.counted("default", 0, 1, p2p=True, ops=1)  # a send: the counter moved by one
    log.opened("default", collective=True)
    assert log.collective_seq("default", 1) == (1, 0, None)


def test_a_collective_read_beside_another_threads_call_has_no_number() -> None:
    log = _log()
    log.opened("default", collective=False)  # thread B: a receive, its counter read, not returned yet
    log.opened("default", collective=True)  # thread A: a collective
    _, _, unsure = log.collective_seq("default", 1)
    assert unsure == "it was issued while another thread of the rank was inside a call on the group"
    assert log.counted("default", 1, 2, p2p=False)  # a collective began beside B's receive
    assert log.counted("default", 0, 2, p2p=True, ops=1)  # B's receive returns: it counts one, whatever moved
    log.opened("default", collective=True)
    assert log.collective_seq("default", 2) == (1 + 1, 0, None)  # counter 2 less one receive, plus one


def test_a_collective_a_send_began_beside_keeps_its_number_one_a_collective_began_beside_loses_it() -> None:
    log = _log()
    log.opened("default", collective=True)  # thread A's collective, alone: numbered as it begins
    assert log.collective_seq("default", 0)[2] is None
    log.opened("default", collective=False)  # thread B's send: it moves the rank's own count only
    assert not log.counted("default", 0, 1, p2p=True, ops=1)
    assert not log.counted("default", 0, 2, p2p=False)  # A's place among the collectives is sure
    log.opened("default", collective=True)  # A again
    log.collective_seq("default", 2)
    log.opened("default", collective=True)  # B's collective: which reached the group first?
    assert log.counted("default", 2, 4, p2p=False)  # A's number cannot be trusted
    assert log.counted("default", 2, 4, p2p=False)  # nor B's, which began beside it


@pytest.mark.parametrize("ops, failed", [(None, False), (1, True)])
def test_a_call_whose_own_share_of_the_counter_is_unknown_beside_another_leaves_no_number_to_trust(
    ops: int | None, failed: bool
) -> None:
    # a monitored barrier (its parts are sends and receives) or a send that raised (did it reach
    # the group?), while another thread's collective moved the counter too
    log = _log()
    log.opened("default", collective=False)
    log.opened("default", collective=True)
    assert log.collective_seq("default", 1)[2] is not None
    log.counted("default", 1, 2, p2p=False)
    log.counted("default", 1, 3, p2p=True, ops=ops, failed=failed)
    log.opened("default", collective=True)
    _, _, unsure = log.collective_seq("default", 3)
    assert unsure is not None and "beside another thread's call" in unsure


def test_a_backend_call_with_arguments_it_refuses_raises_its_own_error(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("tensors", [[], [torch.ones(1), torch.ones(1)]], ids=["none", "two"])
def test_refused(rank, recorder, tensors):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="takes a single tensor"):
        backend.send(tensors, 1 - rank, 0)
""",
    )
    result.assert_outcomes(passed=2)


def test_a_fault_raised_as_a_collective_begins_leaves_the_groups_numbers_certain(pytester) -> None:
    result = run(
        pytester,
        """
from pytest_ddphooks import InjectedFault

@pytest.mark.multirank(world_size=2)
def test_raised_at_start(rank, recorder, faults):
    faults.raise_(0, "dist.all_reduce#1")
    if rank == 0:
        with pytest.raises(InjectedFault):
            dist.all_reduce(torch.ones(1))  # never ran: rank 1 makes no such call
    dist.barrier()
    recorder.mark("a")
    dist.barrier()
    recorder.mark("b")
    tl = recorder.timeline()
    tl.assert_happens_before("a@0", "b@1")
    assert seqs(tl, 0, "dist.barrier") == seqs(tl, 1, "dist.barrier") == [1, 2]
""",
    )
    result.assert_outcomes(passed=1)


def test_an_irecv_issued_and_never_waited_is_said_so_not_never_entered(pytester) -> None:
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
def test_irecv(rank, recorder):
    t = torch.ones(2)
    if rank == 1:
        work = dist.irecv(t, 0)
        recorder.mark("a")
    else:
        dist.send(t, 1)
        recorder.mark("b")
    tl = recorder.timeline()
    text = refused(tl, "a@1", "b@0")
    assert "send/recv 0->1 on the default group, which rank 1 issued at event #" in text
    assert "and never waited for" in text and "never entered" not in text
    if rank == 1:
        work.wait()
""",
    )
    result.assert_outcomes(passed=1)


def test_ranks_the_code_under_test_chose_itself_are_ordered_by_the_lane_they_ran_on(pytester) -> None:
    """``init_process_group(rank=...)`` with ranks other than the launcher's: a root, a peer
    and a sub-group's members are named by group rank; the timeline's lanes are the
    launcher's. A broadcast's root was once taken for the other lane, and the order the
    broadcast gives was proven backwards. A group initialised before, with places of its own
    and destroyed, changes nothing: each group's ranks are read with its own places (they
    were once read with the first group's)."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=3, init_process_group=False)
@pytest.mark.parametrize("before", [None, "identity", "reversed"])
def test_rotated(rank, recorder, shared_tmp_path, before):
    if before is not None:
        place = rank if before == "identity" else 2 - rank
        dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/first", rank=place, world_size=3)
        dist.barrier()
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=(rank + 1) % 3, world_size=3)
    me = dist.get_rank()
    lane_of = {(r + 1) % 3: r for r in range(3)}
    recorder.mark(f"a{me}")
    dist.broadcast(torch.ones(1), src=0)
    recorder.mark(f"b{me}")
    tl = recorder.timeline()
    root, other = lane_of[0], lane_of[1]
    tl.assert_happens_before(f"a0@{root}", f"b1@{other}")  # the root's past reaches the others
    refused(tl, f"a1@{other}", f"b0@{root}")  # and never the other way
    # a sub-group of group ranks 1 and 2: only its members are ordered by its collectives
    sub = dist.new_group([1, 2])
    recorder.mark(f"c{me}")
    if me in (1, 2):
        dist.all_reduce(torch.ones(1), group=sub)
    recorder.mark(f"d{me}")
    # a send from group rank 2 to group rank 0
    if me == 2:
        dist.send(torch.ones(1), dst=0)
    elif me == 0:
        dist.recv(torch.ones(1), src=2)
    recorder.mark(f"e{me}")
    tl = recorder.timeline()
    tl.assert_happens_before(f"c1@{lane_of[1]}", f"d2@{lane_of[2]}")
    refused(tl, f"c0@{lane_of[0]}", f"d1@{lane_of[1]}")
    tl.assert_happens_before(f"d2@{lane_of[2]}", f"e0@{lane_of[0]}")
    refused(tl, f"d0@{lane_of[0]}", f"e2@{lane_of[2]}")


@pytest.mark.multirank(world_size=2, init_process_group=False, timeout=60)
@pytest.mark.parametrize("before", [False, True])
def test_rotated_stall(rank, shared_tmp_path, before):
    if before:  # a group of the launcher's places first
        dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/first", rank=rank, world_size=2)
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=1 - rank, world_size=2)
    if dist.get_rank() == 0:
        dist.recv(torch.ones(1), src=1)  # group rank 1 leaves without sending
""",
    )
    result.assert_outcomes(passed=3, failed=2)
    # group rank 0 is lane 1: it waits for lane 0, which finished
    for before in ("False", "True"):
        result.stdout.fnmatch_lines(
            [
                f"*_ test_rotated_stall[[]{before}[]] _*",
                "*rank 0 finished the test without a send to rank 1; rank 1 waits in recv from rank 0",
                "*rank 1: blocked in recv (peer 0) for*",
            ]
        )


def test_receives_two_threads_have_in_flight_from_one_peer_pair_with_nothing(pytester) -> None:
    """gloo gives messages to receives in the order they were posted, inside torch; the
    recorder numbers a receive as it returns. A blocking recv on one thread and an irecv on
    another, in flight together, may take each other's numbers: paired so, rank 1's recv of
    the first message would seem to wait for the second send (after 'a'), and prove an order
    that did not hold. Overlapping, both pair with nothing; one after the other, they pair."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("overlapping", [True, False])
def test_receivers(rank, recorder, overlapping, shared_tmp_path):
    go = shared_tmp_path / "posted"
    if rank == 0:
        while not go.exists():  # both receives are in flight on rank 1
            time.sleep(0.005)
        dist.send(torch.ones(1), 1)
        recorder.mark("a")
        dist.send(torch.full((1,), 2.0), 1)
    else:
        first, second = torch.zeros(1), torch.zeros(1)
        if overlapping:
            receiver = threading.Thread(target=dist.recv, args=(first,), kwargs={"src": 0})
            receiver.start()
            while not inside(receiver, "recv"):
                time.sleep(0.005)
            work = dist.irecv(second, src=0)
            go.touch()
            receiver.join()
            work.wait()
        else:
            go.touch()
            dist.recv(first, src=0)
            dist.recv(second, src=0)
        recorder.mark("b")
    tl = recorder.timeline()
    ends = [e for e in tl.for_rank(1) if e.kind == "p2p" and e.phase == "end"]
    if overlapping:
        assert [bool(e.info.get("unsure")) for e in ends] == [True, True]
        refused(tl, "a@0", "b@1")
        assert "(unpaired)" in tl.swimlanes()
    else:
        assert not any(e.info.get("unsure") for e in ends)
        tl.assert_happens_before("a@0", "b@1")  # the second recv waited for the send after 'a'
""",
    )
    result.assert_outcomes(passed=2)


def test_ranks_that_re_form_as_separate_worlds_share_no_collective(pytester) -> None:
    """After destroy_process_group, each rank starts a world of its own: both name their group
    'default' (incarnation 2) and number its first all-reduce #1, yet neither waits for the
    other. Re-formed as one world again, they pair (silent)."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("separate", [True, False])
def test_reformed(rank, recorder, shared_tmp_path, separate):
    dist.destroy_process_group()
    if separate:
        store = f"file://{shared_tmp_path}/alone{rank}"
        dist.init_process_group("gloo", init_method=store, world_size=1, rank=0)
    else:
        dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/again", world_size=2, rank=rank)
    if rank == 0:
        recorder.mark("a")
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        recorder.mark("b")
    tl = recorder.timeline()
    if separate:
        refused(tl, "a@0", "b@1")
    else:
        tl.assert_happens_before("a@0", "b@1")
    dist.destroy_process_group()
""",
    )
    result.assert_outcomes(passed=2)


def test_jobs_the_recorded_places_cannot_tell_apart_pair_nothing_across_them(pytester) -> None:
    """Two jobs of two (lanes 0,2 and 1,3, each at places 0,1): both jobs' sends are 'send 0->1
    #1 on the default group', and lane 0's paired with lane 1's own send, proving a@0 -> b@1
    between lanes that never met. Which lanes share a job is not recorded: nothing pairs across
    them. Ranks that each form a world of one call what they like (no desync); a pair and a
    rank alone (world 3): the pair's calls still pair."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=4, init_process_group=False)
def test_two_jobs_of_two(rank, recorder, shared_tmp_path):
    job, me = rank % 2, rank // 2
    dist.init_process_group("gloo", rank=me, world_size=2, init_method=f"file://{shared_tmp_path}/job{job}")
    if rank == 0:
        recorder.mark("a")
    if me == 0:
        dist.send(torch.ones(1), dst=1)
        dist.all_reduce(torch.ones(2 + job))
    else:
        dist.recv(torch.ones(1), src=0)
        dist.all_reduce(torch.ones(2 + job))
    if rank == 1:
        recorder.mark("b")
    dist.destroy_process_group()
    tl = recorder.timeline()
    assert "which rank 1 called in a world apart from the other ranks'" in refused(tl, "a@0", "b@1")
    assert tl.collective_mismatches() == []


@pytest.mark.multirank(world_size=2)
def test_each_rank_its_own_world(rank, recorder, shared_tmp_path):
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/alone{rank}", world_size=1, rank=0)
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        dist.barrier()
    dist.destroy_process_group()
    assert recorder.timeline().collective_mismatches() == []


@pytest.mark.multirank(world_size=3)
def test_a_pair_and_a_rank_alone(rank, recorder, shared_tmp_path):
    dist.destroy_process_group()
    if rank < 2:
        dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/pair", world_size=2, rank=rank)
    else:
        dist.init_process_group("gloo", init_method=f"file://{shared_tmp_path}/alone", world_size=1, rank=0)
    recorder.mark(f"m{rank}")
    dist.barrier()
    recorder.mark(f"after{rank}")
    dist.destroy_process_group()
    tl = recorder.timeline()
    tl.assert_happens_before("m0@0", "after1@1")
    refused(tl, "m2@2", "after0@0")
    refused(tl, "m0@0", "after2@2")
""",
    )
    result.assert_outcomes(passed=3)


def test_collectives_of_a_backend_that_waits_for_nobody_order_nothing(pytester) -> None:
    """A group of torch's 'fake' backend (FakeProcessGroup: a program of many ranks traced in
    one process) returns from every collective at once: its barrier proved a@0 -> b@1 although
    rank 1 marked b a second before rank 0 marked a, and a strategy barrier on it was no no-op.
    The same barrier on a gloo group still orders and is no no-op (silent)."""
    result = run(
        pytester,
        """
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch.testing._internal.distributed.fake_pg import FakeStore


class Strategy:
    def __init__(self, group):
        self.group = group

    def barrier(self):
        dist.barrier(group=self.group)


@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("backend", ["fake", "gloo"])
def test_subgroup(rank, recorder, backend):
    strategy = Strategy(dist.new_group([0, 1], backend=backend))
    recorder.instrument_barrier(strategy, "barrier")
    if rank == 0:
        recorder.mark("a")
    strategy.barrier()
    if rank == 1:
        recorder.mark("b")
    tl = recorder.timeline()
    if backend == "gloo":
        tl.assert_happens_before("a@0", "b@1")
        assert tl.noop_barriers() == []
        return
    why = refused(tl, "a@0", "b@1")
    assert "on a group of backend 'fake', which returns without waiting for anyone" in why, why
    assert [nb.reason for nb in tl.noop_barriers()] == [
        "issued only collectives on groups whose backend returns without waiting for anyone ('fake')"
    ] * 2


@pytest.mark.multirank(world_size=2, init_process_group=False)
def test_fake_world(rank, recorder):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    if rank == 0:
        recorder.mark("a")
    dist.barrier()
    if rank == 1:
        recorder.mark("b")
    refused(recorder.timeline(), "a@0", "b@1")
    dist.destroy_process_group()
""",
    )
    result.assert_outcomes(passed=3)


def test_an_irecv_from_any_source_pairs_where_its_wait_learns_the_sender(pytester) -> None:
    """dist.irecv(src=None) knows its sender only once it completed: it paired with nothing, and
    a@0 -> b@1 through it was refused. Learned at its wait, it orders the send before the wait;
    an order against the message's direction is still refused."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=3)
def test_any_source(rank, recorder):
    if rank == 2:
        recorder.mark("a")
        dist.send(torch.ones(1), dst=1)
    elif rank == 1:
        recorder.mark("c")
        work = dist.irecv(torch.zeros(1))
        work.wait()
        recorder.mark("b")
    tl = recorder.timeline()
    tl.assert_happens_before("a@2", "b@1")
    refused(tl, "c@1", "a@2")
""",
    )
    result.assert_outcomes(passed=1)


def test_a_barrier_that_leaves_its_collective_to_a_thread_it_does_not_wait_for_is_named_for_it(pytester) -> None:
    """Its thread's barrier had not completed when it returned: named a no-op, and for that
    reason (it said 'no collective was called')."""
    result = run(
        pytester,
        """
class Strategy:
    def barrier(self):
        self.thread = threading.Thread(target=dist.barrier)
        self.thread.start()
        while self.thread.is_alive() and not inside(self.thread, "barrier"):
            time.sleep(0.01)


@pytest.mark.multirank(world_size=2)
def test_left_to_a_thread(rank, recorder, shared_tmp_path):
    strategy = Strategy()
    recorder.instrument_barrier(strategy, "barrier")
    returned = shared_tmp_path / "returned"
    while rank == 1 and not returned.exists():
        time.sleep(0.01)  # rank 1 enters once rank 0's barrier returned
    strategy.barrier()
    if rank == 0:
        returned.write_text("x")
    strategy.thread.join()
    reasons = [nb.reason for nb in recorder.timeline().noop_barriers() if nb.rank == 0]
    assert reasons == ["issued only collectives on threads it started, and waited for none of them before it returned"]
""",
    )
    result.assert_outcomes(passed=1)


def test_functional_sends_and_receives_are_counted_so_later_collectives_pair_as_they_ran(pytester) -> None:
    """funcol.isend_inplace / irecv_inplace and batch_p2p_ops_inplace move the group's count on
    the two ranks they join alone: unseen, rank 1's first all-reduce paired with rank 0's second
    and proved a@0 -> b@1 although b ran first. Recorded (or counted, for a batch), each
    all-reduce pairs with its own, and a send after them pairs with its own message."""
    result = run(
        pytester,
        """
@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("how", ["inplace", "batch"])
def test_shift(rank, recorder, how):
    t = torch.ones(4)
    if how == "inplace":
        if rank == 1:
            funcol.wait_tensor(funcol.isend_inplace(t, dst=0))
        else:
            dist.recv(t, src=1)
    else:
        peer = 1 - rank
        funcol.batch_p2p_ops_inplace(["isend", "irecv"], [peer, peer], [0, 0], [torch.ones(4), t], "")
    dist.all_reduce(torch.ones(4))
    recorder.mark("a" if rank == 0 else "b")
    dist.all_reduce(torch.ones(4))
    recorder.mark("after")
    if rank == 1:
        dist.send(torch.ones(1), 0)
    else:
        dist.recv(torch.zeros(1), src=1)
        recorder.mark("got")
    tl = recorder.timeline()
    assert seqs(tl, 0, "dist.all_reduce") == seqs(tl, 1, "dist.all_reduce") == [1, 2]
    refused(tl, "a@0", "b@1")
    tl.assert_happens_before("b@1", "after@0")
    tl.assert_happens_before("b@1", "got@0")
""",
    )
    result.assert_outcomes(passed=2)
