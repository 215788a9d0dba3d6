"""The case the recorder exists for: rank 0 prepares data, a framework barrier, every rank sets up.

Only a real collective inside the barrier orders rank 0's ``prepare_data`` before the other
ranks' ``setup``; timestamps saying so are not enough.
"""

from __future__ import annotations

import pytest
from synth import Handle, Sim

from pytest_ddphooks.recorder import NoopBarrier, TimelineAssertionError, events


def scenario(world: int = 2, *, collective: bool = True, group_existed: bool = True, barrier: bool = True) -> Sim:
    sim = Sim(world)
    sim.call(0, "prepare_data")
    if barrier:
        sim.barrier_all(collective=collective, group_existed=group_existed)
    for r in range(world):
        sim.call(r, "setup")
    return sim


def by_timestamps_prepare_ends_before_any_setup(sim: Sim) -> bool:
    tl = sim.timeline()
    prepared = max(e.t_ns for e in tl.events if e.name == "prepare_data")
    first_setup = min(e.t_ns for e in tl.events if e.name == "setup")
    return prepared < first_setup


@pytest.mark.parametrize("world", [2, 4])
def test_a_real_barrier_orders_prepare_data_before_every_setup(world: int) -> None:
    tl = scenario(world).timeline()
    tl.assert_happens_before("prepare_data@0", "setup")
    assert tl.happens_before("prepare_data", "setup")
    assert tl.noop_barriers() == []
    tl.assert_no_noop_barriers()
    # and not the other way round
    assert not tl.happens_before("setup@1", "prepare_data@0")


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ({"collective": False, "group_existed": True}, "no collective was called"),
        ({"collective": False, "group_existed": False}, "no process group existed"),
    ],
    ids=["group-but-no-collective", "no-group"],
)
def test_a_noop_barrier_does_not_order_them_whatever_the_timestamps(kind: dict[str, bool], reason: str) -> None:
    sim = scenario(**kind)
    assert by_timestamps_prepare_ends_before_any_setup(sim)
    tl = sim.timeline()
    assert not tl.happens_before("prepare_data@0", "setup")
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("prepare_data@0", "setup")
    text = str(err.value)
    assert text.startswith("'prepare_data@0' does not happen before 'setup':")
    # which events, which ranks
    assert "prepare_data ended on rank 0 (event #1) and setup started on rank 1 (event #2)" in text
    assert "no collective connects them" in text
    assert "rank 1 took part in no collective with rank 0 before event #2" in text
    # the no-op barriers are named, with why they are no-ops
    assert "no-op barrier: 'wait_for_everyone' on rank 0 (event #2) issued no collective: " in text
    assert "no-op barrier: 'wait_for_everyone' on rank 1 (event #0) issued no collective: " in text
    assert reason in text
    # rank 0 itself is fine: program order
    tl.assert_happens_before("prepare_data@0", "setup@0")
    # the swimlanes are drawn under the message
    assert "rank 0" in text.split("\n\n", 1)[1]
    assert "(no-op)" in text


def test_a_missing_barrier_does_not_order_them_whatever_the_timestamps() -> None:
    sim = scenario(barrier=False)
    assert by_timestamps_prepare_ends_before_any_setup(sim)
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("prepare_data@0", "setup")
    text = str(err.value)
    assert "prepare_data ended on rank 0 (event #1) and setup started on rank 1 (event #0)" in text
    assert "no collective connects them" in text
    assert "no-op barrier" not in text


def test_a_barrier_rank_0_passes_before_prepare_data_does_not_order_it() -> None:
    sim = Sim(2)
    sim.barrier_all()  # misplaced: before prepare_data on rank 0
    sim.call(0, "prepare_data")
    for r in range(2):
        sim.call(r, "setup")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("prepare_data@0", "setup")
    text = str(err.value)
    assert "prepare_data ended on rank 0 (event #5) and setup started on rank 1 (event #4)" in text
    assert "no collective connects them; before event #4 rank 1 passed:" in text
    assert (
        "barrier #1 on the default group (issued in wait_for_everyone), which rank 0 entered at event #1,"
        " before prepare_data ended"
    ) in text


def test_only_the_ranks_that_missed_the_barrier_are_reported() -> None:
    sim = Sim(3)
    sim.call(0, "prepare_data")
    hs = [sim.fw_barrier(r) for r in (0, 1)]
    for h in hs:
        sim.fw_barrier_end(h)
    for r in range(3):
        sim.call(r, "setup")
    tl = sim.timeline()
    with pytest.raises(TimelineAssertionError) as err:
        tl.assert_happens_before("prepare_data@0", "setup")
    text = str(err.value)
    # the barrier was incomplete (rank 2 never came), so it orders nobody
    assert "setup started on rank 1" in text
    assert "setup started on rank 2" in text
    assert "which rank 2 never entered" in text


# -- no-op barriers ---------------------------------------------------------------------------


def test_noop_barriers_name_the_reason() -> None:
    sim = Sim(2)
    sim.barrier_all("early", collective=False, group_existed=False)
    sim.barrier_all("late", collective=False, group_existed=True)
    sim.barrier_all("real")
    found = sim.timeline().noop_barriers()
    assert [(nb.rank, nb.name) for nb in found] == [(0, "early"), (0, "late"), (1, "early"), (1, "late")]
    assert all(isinstance(nb, NoopBarrier) for nb in found)
    early, late = found[0], found[1]
    assert early.reason == "issued no collective: no process group existed"
    assert late.reason == "issued no collective: the process group existed but no collective was called"
    assert str(early) == "no-op barrier: 'early' on rank 0 (event #0) issued no collective: no process group existed"


def test_assert_no_noop_barriers_fires_and_is_silent() -> None:
    sim = Sim(2)
    sim.barrier_all("real")
    sim.timeline().assert_no_noop_barriers()
    sim.barrier_all("fake", collective=False)
    with pytest.raises(TimelineAssertionError) as err:
        sim.timeline().assert_no_noop_barriers()
    first = str(err.value).splitlines()
    assert first[0] == (
        "no-op barrier: 'fake' on rank 0 (event #4) issued no collective:"
        " the process group existed but no collective was called"
    )
    assert first[1].startswith("no-op barrier: 'fake' on rank 1")


def _barrier_through_a_worker_thread(sim: Sim, rank: int, *, before: bool = False, after: bool = False) -> Handle:
    """A framework barrier whose collective a worker thread (lane 1) runs; ``before``: the
    worker entered it before the barrier began, ``after``: completed it after it returned."""
    if before:
        worker = sim.cstart(rank, "barrier", lane=1)
    outer = sim.start(rank, "barrier", events.BARRIER, {"qualname": "Strategy.barrier"})
    if not before:
        worker = sim.cstart(rank, "barrier", lane=1)
    if not after:
        sim.cend(worker)
    sim.end(outer, {"collectives": 0})  # none on the barrier's own thread
    return worker


@pytest.mark.parametrize(("before", "after"), [(False, False), (True, False), (False, True)])
def test_a_barrier_a_worker_thread_synchronised_for_is_no_noop(before: bool, after: bool) -> None:
    sim = Sim(2)
    late = [_barrier_through_a_worker_thread(sim, rank, before=before, after=after) for rank in range(2)]
    if after:
        for worker in late:
            sim.cend(worker)
    found = sim.timeline().noop_barriers()
    if before or after:  # not the barrier's doing, or not waited for by it
        assert [nb.rank for nb in found] == [0, 1]
        if after:  # its thread's collective had not completed when it returned
            reason = "issued only collectives on threads it started, and waited for none of them before it returned"
        else:
            reason = "issued no collective: the process group existed but no collective was called"
        assert found[0].reason == reason
    else:
        assert found == []
        sim.timeline().assert_no_noop_barriers()


def test_a_thread_that_was_there_before_the_barrier_does_not_synchronise_for_it() -> None:
    """A background thread (a logger's, a prefetcher's) whose collective happens to complete
    while a barrier that calls none runs: chance, not the barrier's wait."""
    sim = Sim(2)
    for rank in range(2):
        sim.mark(rank, "background started", lane=1)
    for rank in range(2):
        outer = sim.start(rank, "barrier", events.BARRIER, {"qualname": "Strategy.barrier"})
        worker = sim.cstart(rank, "all_reduce", lane=1)
        sim.cend(worker)
        sim.end(outer, {"collectives": 0})
    found = sim.timeline().noop_barriers()
    assert [nb.rank for nb in found] == [0, 1]


def test_a_barrier_whose_collectives_raised_is_a_noop() -> None:
    sim = Sim(2)
    for rank in range(2):
        outer = sim.start(rank, "barrier", events.BARRIER, {"qualname": "Strategy.barrier"})
        sim.cend(sim.cstart(rank, "all_reduce"), error="RuntimeError: Connection closed by peer")
        sim.end(outer, {"collectives": 1})
    assert [nb.reason for nb in sim.timeline().noop_barriers()] == [
        "issued only collectives that raised, which synchronise nobody"
    ] * 2


def test_a_barrier_on_a_group_of_its_rank_alone_is_a_noop_but_not_in_a_world_of_one() -> None:
    """The per-node group of a node with one rank: its barrier waits for nobody."""
    for world in (2, 1):
        sim = Sim(world)
        for rank in range(world):
            outer = sim.start(rank, "barrier", events.BARRIER, {"qualname": "Strategy.barrier"})
            if world > 1:
                sim.coll("barrier", [rank], group=f"node{rank}", payload=None)
            else:
                sim.coll("barrier")
            sim.end(outer, {"collectives": 1})
        found = sim.timeline().noop_barriers()
        if world == 1:
            assert found == []
        else:
            assert [nb.reason for nb in found] == [
                "issued only collectives on groups of this rank alone, which wait for nobody"
            ] * 2


def test_a_barrier_that_never_returned_is_not_called_a_noop() -> None:
    sim = Sim(2)
    sim.fw_barrier(0, collective=False)
    assert sim.timeline().noop_barriers() == []
