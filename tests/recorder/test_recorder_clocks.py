"""Happens-before from vector clocks: the rule of each kind of torch.distributed call.

Each rank writes a mark ``pre<r>`` before the call and ``post<r>`` after it; the question is
always which ``pre`` reaches which ``post``. Timestamps grow in writing order and every
rank's ``post`` is written after every ``pre``, so a timestamp-based answer would always
say yes: the clocks alone must decide.
"""

from __future__ import annotations

import itertools

import pytest
from synth import Sim

from pytest_ddphooks.recorder import Timeline, TimelineAssertionError
from pytest_ddphooks.recorder.clocks import Clocks

ALL_SYNC = [
    ("barrier", None, None),
    ("monitored_barrier", None, None),
    ("all_reduce", "float32[4]", "SUM"),
    ("all_gather", "float32[4]", None),
    ("all_gather_into_tensor", "float32[4]", None),
    ("all_gather_object", "object", None),
    ("reduce_scatter", "float32[4]", "SUM"),
    ("reduce_scatter_tensor", "float32[4]", "SUM"),
    ("all_to_all", "[float32[2] x3]", None),
    ("all_to_all_single", "float32[6]", None),
]


def around(sim: Sim, ranks: list[int], body) -> Timeline:
    for r in ranks:
        sim.mark(r, f"pre{r}")
    body()
    for r in ranks:
        sim.mark(r, f"post{r}")
    return sim.timeline()


def reach(tl: Timeline, ranks: list[int]) -> set[tuple[int, int]]:
    """Every (a, b), a != b, where pre<a> happens before post<b>."""
    return {(a, b) for a, b in itertools.permutations(ranks, 2) if tl.happens_before(f"pre{a}", f"post{b}")}


def pairs(ranks: list[int]) -> set[tuple[int, int]]:
    return set(itertools.permutations(ranks, 2))


# -- all members synchronise ------------------------------------------------------------------


@pytest.mark.parametrize(("op", "payload", "reduce_op"), ALL_SYNC, ids=[o for o, _, _ in ALL_SYNC])
def test_all_sync_orders_every_member_before_every_other(op: str, payload: str | None, reduce_op: str | None) -> None:
    sim = Sim(3)
    tl = around(sim, [0, 1, 2], lambda: sim.coll(op, payload=payload, reduce_op=reduce_op))
    assert reach(tl, [0, 1, 2]) == pairs([0, 1, 2])
    tl.assert_happens_before("pre0", "post2")
    tl.assert_happens_before("pre2", "post0")
    # after the collective, nothing reaches back before it
    assert not tl.happens_before("post1", "pre0")


def test_all_sync_does_not_order_what_comes_after_the_collective() -> None:
    sim = Sim(2)
    sim.coll("barrier", payload=None)
    sim.mark(0, "later0")
    sim.mark(1, "later1")
    tl = sim.timeline()
    assert not tl.happens_before("later0", "later1")
    assert not tl.happens_before("later1", "later0")
    with pytest.raises(TimelineAssertionError, match="no collective connects them"):
        tl.assert_happens_before("later0@0", "later1@1")


# -- from the root ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["broadcast", "scatter", "broadcast_object_list", "scatter_object_list"])
@pytest.mark.parametrize("src", [0, 1])
def test_from_root_orders_only_the_roots_past_before_the_others(op: str, src: int) -> None:
    sim = Sim(3)
    payload = "objects x2" if op == "broadcast_object_list" else "float32[4]"
    tl = around(sim, [0, 1, 2], lambda: sim.coll(op, payload=payload, root=src))
    others = [r for r in (0, 1, 2) if r != src]
    assert reach(tl, [0, 1, 2]) == {(src, r) for r in others}
    for r in others:
        tl.assert_happens_before(f"pre{src}", f"post{r}")
        with pytest.raises(TimelineAssertionError) as err:
            tl.assert_happens_before(f"pre{r}", f"post{src}")
        assert f"whose root is rank {src}: it orders only the root before the others" in str(err.value)


# -- to the root ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["reduce", "gather", "gather_object"])
@pytest.mark.parametrize("dst", [0, 2])
def test_to_root_orders_the_others_before_the_root_only(op: str, dst: int) -> None:
    sim = Sim(3)
    tl = around(sim, [0, 1, 2], lambda: sim.coll(op, root=dst, reduce_op="SUM" if op == "reduce" else None))
    others = [r for r in (0, 1, 2) if r != dst]
    assert reach(tl, [0, 1, 2]) == {(r, dst) for r in others}
    tl.assert_happens_before(f"pre{others[0]}", f"post{dst}")
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before(f"pre{dst}", f"post{others[0]}")
    assert f"orders the others before its root (rank {dst}) only" in str(err.value)


# -- send / recv ------------------------------------------------------------------------------


def test_send_start_happens_before_recv_end() -> None:
    sim = Sim(2)

    def body() -> None:
        s = sim.send_start(0, 1)
        r = sim.recv_start(1, 0)
        sim.cend(s)
        sim.recv_end(r)

    tl = around(sim, [0, 1], body)
    assert reach(tl, [0, 1]) == {(0, 1)}
    tl.assert_happens_before("pre0", "post1")
    with pytest.raises(TimelineAssertionError):
        tl.assert_happens_before("pre1", "post0")


def test_recv_from_any_source_is_matched_by_the_source_known_at_its_end() -> None:
    sim = Sim(3)

    def body() -> None:
        s = sim.send_start(2, 0)
        r = sim.recv_start(0, None)  # src=None: whoever sends first
        sim.cend(s)
        sim.recv_end(r, actual_src=2)

    tl = around(sim, [0, 1, 2], body)
    assert reach(tl, [0, 1, 2]) == {(2, 0)}


def test_sends_and_recvs_pair_up_in_order_per_peer_and_tag() -> None:
    sim = Sim(2)
    for i in range(3):
        sim.mark(0, f"before_send{i}")
        s = sim.send_start(0, 1, tag=7)
        sim.cend(s)
    for i in range(3):
        r = sim.recv_start(1, 0, tag=7)
        sim.recv_end(r)
        sim.mark(1, f"after_recv{i}")
    tl = sim.timeline()
    for i in range(3):
        assert tl.happens_before(f"before_send{i}", f"after_recv{i}")
    # the first recv got the first send: the later sends reach only the later recvs
    assert not tl.happens_before("before_send2", "after_recv0")
    assert not tl.happens_before("before_send1", "after_recv0")


def test_a_send_with_another_tag_is_not_a_match() -> None:
    sim = Sim(2)
    sim.mark(0, "pre0")
    s = sim.send_start(0, 1, tag=1)
    r = sim.recv_start(1, 0, tag=2)
    sim.cend(s)
    sim.recv_end(r)
    sim.mark(1, "post1")
    assert not sim.timeline().happens_before("pre0", "post1")


# -- sub-groups and chains --------------------------------------------------------------------


def test_a_sub_group_orders_its_members_only() -> None:
    sim = Sim(4)
    tl = around(sim, [0, 1, 2, 3], lambda: sim.coll("all_reduce", [0, 2], group="g02", reduce_op="SUM"))
    assert reach(tl, [0, 1, 2, 3]) == {(0, 2), (2, 0)}
    tl.assert_happens_before("pre0", "post2")
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("pre0", "post1")
    assert "rank 1 took part in no collective with rank 0" in str(err.value)


def test_happens_before_is_transitive_across_a_chain_of_collectives() -> None:
    sim = Sim(4)
    sim.mark(0, "start")
    sim.coll("barrier", [0, 1], group="g01", payload=None)
    sim.coll("all_reduce", [1, 2], group="g12", reduce_op="SUM")
    s = sim.send_start(2, 3)
    r = sim.recv_start(3, 2)
    sim.cend(s)
    sim.recv_end(r)
    sim.mark(3, "finish")
    tl = sim.timeline()
    tl.assert_happens_before("start@0", "finish@3")
    assert not tl.happens_before("finish@3", "start@0")


def test_a_chain_through_a_root_only_goes_the_roots_way() -> None:
    sim = Sim(3)
    sim.mark(2, "start")
    sim.coll("gather", root=1)  # 2 -> 1
    sim.coll("broadcast", root=1)  # 1 -> 0, 2
    sim.mark(0, "finish")
    sim.mark(1, "late1")
    tl = sim.timeline()
    tl.assert_happens_before("start@2", "finish@0")
    assert not tl.happens_before("late1", "finish@0")


# -- what adds no edge ------------------------------------------------------------------------


def test_different_collectives_on_the_same_seq_add_no_edge() -> None:
    sim = Sim(2)

    def body() -> None:
        a = sim.cstart(0, "all_reduce", reduce_op="SUM")
        b = sim.cstart(1, "broadcast", root=0)
        sim.cend(a)
        sim.cend(b)

    tl = around(sim, [0, 1], body)
    assert reach(tl, [0, 1]) == set()
    with pytest.raises(TimelineAssertionError, match="where the ranks called different collectives"):
        tl.assert_happens_before("pre0", "post1")


def test_ops_that_agree_on_payload_and_root_are_still_different_ops() -> None:
    # broadcast and scatter look alike (float32[4], src=0): the op itself must be compared
    sim = Sim(2)

    def body() -> None:
        a = sim.cstart(0, "broadcast", root=0)
        b = sim.cstart(1, "scatter", root=0)
        sim.cend(a)
        sim.cend(b)

    tl = around(sim, [0, 1], body)
    assert reach(tl, [0, 1]) == set()
    assert len(tl.collective_mismatches()) == 1


def test_a_payload_mismatch_adds_no_edge() -> None:
    sim = Sim(2)

    def body() -> None:
        a = sim.cstart(0, "all_reduce", payload="float32[4]", reduce_op="SUM")
        b = sim.cstart(1, "all_reduce", payload="float32[8]", reduce_op="SUM")
        sim.cend(a)
        sim.cend(b)

    assert reach(around(sim, [0, 1], body), [0, 1]) == set()


@pytest.mark.parametrize(("op", "root"), [("barrier", None), ("broadcast", 0), ("reduce", 1)])
def test_a_collective_a_member_never_entered_adds_no_edge(op: str, root: int | None) -> None:
    sim = Sim(3)

    def body() -> None:
        hs = [sim.cstart(r, op, root=root, payload=None if op == "barrier" else "float32[4]") for r in (0, 1)]
        for h in hs:
            sim.cend(h)

    tl = around(sim, [0, 1, 2], body)
    assert reach(tl, [0, 1, 2]) == set()
    with pytest.raises(TimelineAssertionError, match="which rank 2 never entered"):
        tl.assert_happens_before("pre0", "post1")


def test_a_collective_that_raised_adds_no_edge() -> None:
    sim = Sim(2)

    def body() -> None:
        a = sim.cstart(0, "barrier", payload=None)
        b = sim.cstart(1, "barrier", payload=None)
        sim.cend(a)
        sim.cend(b, error="RuntimeError: Connection closed by peer")

    tl = around(sim, [0, 1], body)
    assert reach(tl, [0, 1]) == set()
    with pytest.raises(TimelineAssertionError, match="which raised on rank 1"):
        tl.assert_happens_before("pre1", "post0")


EMPTY = [
    ("all_reduce", "float32[0]", "SUM", None),
    ("all_gather_into_tensor", "float32[0,4]", None, None),
    ("all_gather", "[float32[0] x2]", None, None),
    ("reduce", "float32[0]", "SUM", 1),
    ("broadcast", "int64[0]", None, 0),
]


@pytest.mark.parametrize(("op", "payload", "reduce_op", "root"), EMPTY, ids=[e[0] for e in EMPTY])
def test_a_collective_on_a_tensor_with_no_element_adds_no_edge(
    op: str, payload: str, reduce_op: str | None, root: int | None
) -> None:
    """gloo returns from an all-reduce (an all-gather, a reduce's root) of no element without
    hearing from the others: such a call orders nothing, whichever op it is."""
    sim = Sim(2)
    tl = around(sim, [0, 1], lambda: sim.coll(op, payload=payload, reduce_op=reduce_op, root=root))
    assert reach(tl, [0, 1]) == set()
    with pytest.raises(TimelineAssertionError, match="on a tensor with no element: gloo returns from it without"):
        tl.assert_happens_before("pre0", "post1")


def test_a_collective_on_a_tensor_with_elements_still_orders() -> None:
    sim = Sim(2)
    tl = around(sim, [0, 1], lambda: sim.coll("all_reduce", payload="float32[0,4]", reduce_op="SUM"))
    assert reach(tl, [0, 1]) == set()
    sim = Sim(2)
    tl = around(sim, [0, 1], lambda: sim.coll("all_reduce", payload="float32[1,4]", reduce_op="SUM"))
    assert reach(tl, [0, 1]) == pairs([0, 1])


def test_a_recv_that_raised_adds_no_edge() -> None:
    sim = Sim(2)

    def body() -> None:
        s = sim.send_start(0, 1)
        r = sim.recv_start(1, 0)
        sim.cend(s)
        sim.recv_end(r, error="RuntimeError: timed out")

    assert reach(around(sim, [0, 1], body), [0, 1]) == set()


def test_an_async_collective_has_no_incoming_edge_but_its_start_is_a_source() -> None:
    sim = Sim(2)

    def body() -> None:
        a = sim.cstart(0, "all_reduce", reduce_op="SUM", async_op=True)
        b = sim.cstart(1, "all_reduce", reduce_op="SUM")
        sim.cend(a)
        sim.cend(b)

    tl = around(sim, [0, 1], body)
    assert reach(tl, [0, 1]) == {(0, 1)}
    with pytest.raises(TimelineAssertionError, match="asynchronous on rank 0"):
        tl.assert_happens_before("pre1", "post0")


def test_isend_is_a_source_and_irecv_has_no_incoming_edge() -> None:
    sim = Sim(2)
    sim.mark(0, "pre0")
    s = sim.send_start(0, 1, op="isend")
    r = sim.recv_start(1, 0)
    sim.cend(s)
    sim.recv_end(r)
    sim.mark(1, "post1")
    s = sim.send_start(1, 0)
    r = sim.recv_start(0, 1, op="irecv")
    sim.cend(s)
    sim.recv_end(r)
    sim.mark(0, "post0")
    tl = sim.timeline()
    assert tl.happens_before("pre0", "post1")
    assert not tl.happens_before("post1", "post0")


def test_a_collective_on_no_group_adds_no_edge() -> None:
    sim = Sim(2)

    def body() -> None:
        hs = [sim.cstart(r, "barrier", effective=False) for r in (0, 1)]
        for h in hs:
            sim.cend(h, error="ValueError: Default process group has not been initialized")

    assert reach(around(sim, [0, 1], body), [0, 1]) == set()


# -- lanes, cycles, edge cases ----------------------------------------------------------------


def test_threads_of_one_rank_are_not_ordered_without_synchronisation() -> None:
    sim = Sim(1)
    sim.mark(0, "main_first", lane=0)
    sim.mark(0, "worker_later", lane=1)
    sim.mark(0, "main_later", lane=0)
    tl = sim.timeline()
    assert tl.happens_before("main_first", "main_later")
    assert not tl.happens_before("main_first", "worker_later")


def test_a_collective_on_a_worker_thread_orders_that_thread() -> None:
    sim = Sim(2)
    sim.mark(0, "pre", lane=1)
    hs = [sim.cstart(0, "barrier", payload=None, lane=1), sim.cstart(1, "barrier", payload=None)]
    for h in hs:
        sim.cend(h)
    sim.mark(1, "post")
    sim.mark(0, "main")
    tl = sim.timeline()
    assert tl.happens_before("pre@0", "post@1")
    assert not tl.happens_before("main@0", "post@1")


def test_contradictory_records_do_not_hang_the_clocks() -> None:
    # rank 0 enters g then h, rank 1 enters h then g: each end waits for a start after it
    sim = Sim(2)
    g0 = sim.cstart(0, "barrier", group="g", ranks=[0, 1], payload=None)
    h1 = sim.cstart(1, "barrier", group="h", ranks=[0, 1], payload=None)
    sim.cend(g0)
    sim.cend(h1)
    h0 = sim.cstart(0, "barrier", group="h", ranks=[0, 1], payload=None)
    g1 = sim.cstart(1, "barrier", group="g", ranks=[0, 1], payload=None)
    sim.cend(h0)
    sim.cend(g1)
    tl = sim.timeline()
    assert len(tl.clocks.lanes) == 2
    tl.swimlanes()


def test_a_span_that_never_ended_is_not_before_anything() -> None:
    sim = Sim(2)
    sim.start(0, "stuck")
    sim.coll("barrier", payload=None)
    sim.call(1, "after")
    tl = sim.timeline()
    assert not tl.happens_before("stuck", "after")
    with pytest.raises(TimelineAssertionError, match=r"stuck on rank 0 \(event #0\) never ended"):
        tl.assert_happens_before("stuck", "after")


def test_happens_before_is_false_and_the_assertion_says_so_when_nothing_is_selected() -> None:
    sim = Sim(2)
    sim.call(0, "a")
    tl = sim.timeline()
    assert not tl.happens_before("a", "missing")
    assert not tl.happens_before("missing", "a")
    with pytest.raises(TimelineAssertionError, match="no 'missing' was recorded on any rank"):
        tl.assert_happens_before("a", "missing")
    with pytest.raises(TimelineAssertionError, match="no 'a' was recorded on rank 1"):
        tl.assert_happens_before("a@1", "a")


def test_same_lane_order_is_explained() -> None:
    sim = Sim(1)
    sim.call(0, "second_expected")
    sim.call(0, "first_expected")
    tl = sim.timeline()
    with pytest.raises(
        TimelineAssertionError,
        match=r"second_expected started on rank 0 \(event #0\) before first_expected ended there",
    ):
        tl.assert_happens_before("first_expected", "second_expected")


def test_clocks_answer_for_events_directly() -> None:
    sim = Sim(2)
    sim.mark(0, "a")
    sim.coll("barrier", payload=None)
    sim.mark(1, "b")
    tl = sim.timeline()
    clocks = Clocks({r: tl.for_rank(r) for r in tl.ranks})
    a = next(e for e in tl.events if e.name == "a")
    b = next(e for e in tl.events if e.name == "b")
    assert clocks.happens_before(a, b)
    assert not clocks.happens_before(b, a)
    assert not clocks.happens_before(a, a)
    assert clocks.lane_of(b) == (1, 0)


def test_a_claim_refused_because_of_threads_says_so() -> None:
    sim = Sim(2)
    sim.call(0, "worker_step", lane=1)  # a worker thread of rank 0, joined before the barrier (not recorded)
    sim.barrier_all()
    sim.call(1, "after")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as failed:
        tl.assert_happens_before("worker_step@0", "after@1")
    assert (
        "barrier #1 on the default group (issued in wait_for_everyone), which rank 0 entered on thread lane 0"
        " (event #3), not on lane 1, where worker_step ran: what orders threads of one process (a join, a lock,"
        " a queue) is not recorded, so it does not order them"
    ) in str(failed.value)


def test_a_collective_entered_on_another_thread_before_the_event_ended_is_said_to_be_on_that_thread() -> None:
    # the collective began first, on a worker thread: "entered before x ended" would suggest it
    # could have ordered x had it come later, and it could not
    sim = Sim(2)
    worker = sim.cstart(0, "barrier", lane=1)
    sim.call(0, "x")
    main = sim.cstart(1, "barrier")
    sim.cend(worker)
    sim.cend(main)
    sim.mark(1, "after")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as failed:
        tl.assert_happens_before("x@0", "after@1")
    text = str(failed.value)
    assert "barrier #1 on the default group, which rank 0 entered on thread lane 1 (event #0), not on lane 0" in text
    assert "before x ended" not in text
    # the same collective on x's own thread after it: an order
    sim = Sim(2)
    sim.call(0, "x")
    sim.coll("barrier")
    sim.mark(1, "after")
    sim.timeline().assert_happens_before("x@0", "after@1")


def test_called_once_of_a_name_with_an_at_says_how_to_select_it() -> None:
    sim = Sim(2)
    sim.mark(0, "epoch@1")
    sim.mark(1, "epoch@1")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError, match=r"an event named 'epoch@1' was recorded"):
        tl.assert_called_once("epoch@1")
    tl.assert_called_once("epoch@1@0,1")
