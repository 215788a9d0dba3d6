"""The decisive test: "rank 0 prepares data, then every rank sets up", proven by causality.

Each variant runs on real gloo ranks. Where the barrier is missing or a no-op, the other ranks
sleep until rank 0 is done, so every timestamp says "prepare_data ended first" — and the
assertion still fails, because no collective connects the two.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from pytest_ddphooks import TimelineAssertionError


class Strategy:
    """A framework-level barrier: a no-op while no process group exists (the historic bug)."""

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


class Hooks:
    def prepare_data(self, path) -> None:
        (path / "data.txt").write_text("ready")

    def setup(self, path) -> str:
        return (path / "data.txt").read_text()


def _lifecycle(rank, recorder, path, barrier: bool) -> None:
    hooks = recorder.instrument(Hooks())
    strategy = recorder.instrument_barrier(Strategy(), "barrier")
    if rank == 0:
        hooks.prepare_data(path)
    if barrier:
        strategy.barrier()
    else:
        time.sleep(0.3)  # the others "wait" by luck of timing, which is what must not count
    if rank != 0 and not barrier:
        time.sleep(0.3)
    assert hooks.setup(path) == "ready"


def _timestamps_look_right(timeline) -> bool:
    ended = max(s.end.t_ns for s in timeline.spans("prepare_data", [0]))
    return all(s.start.t_ns > ended for s in timeline.spans("setup"))


@pytest.mark.multirank(world_size=3)
def test_with_a_real_barrier_the_order_is_proven(rank, recorder, shared_tmp_path) -> None:
    _lifecycle(rank, recorder, shared_tmp_path, barrier=True)
    timeline = recorder.timeline()
    timeline.assert_happens_before("prepare_data@0", "setup")
    timeline.assert_no_noop_barriers()
    timeline.assert_collectives_match()


@pytest.mark.multirank(world_size=3)
def test_without_the_barrier_it_fails_although_timestamps_look_right(rank, recorder, shared_tmp_path) -> None:
    _lifecycle(rank, recorder, shared_tmp_path, barrier=False)
    timeline = recorder.timeline()
    assert _timestamps_look_right(timeline)
    with pytest.raises(TimelineAssertionError) as failure:
        timeline.assert_happens_before("prepare_data@0", "setup")
    message = str(failure.value)
    assert "'prepare_data@0' does not happen before 'setup':" in message
    assert "prepare_data ended on rank 0" in message and "setup started on rank 1" in message
    assert "no collective connects them" in message
    assert "| rank 1" in message and "| rank 2" in message  # the swimlanes follow


@pytest.mark.multirank(world_size=3, init_process_group=False)
def test_a_barrier_before_the_group_exists_is_a_noop_and_the_order_fails(rank, recorder, shared_tmp_path) -> None:
    hooks = recorder.instrument(Hooks())
    strategy = recorder.instrument_barrier(Strategy(), "barrier")
    if rank == 0:
        hooks.prepare_data(shared_tmp_path)
    strategy.barrier()  # no group yet: returns at once
    dist.init_process_group("gloo")  # created only now, as the buggy trainer did
    if rank != 0:
        time.sleep(0.3)
    hooks.setup(shared_tmp_path)
    timeline = recorder.timeline()
    assert _timestamps_look_right(timeline)
    with pytest.raises(TimelineAssertionError, match="no collective connects them"):
        timeline.assert_happens_before("prepare_data@0", "setup")
    noops = timeline.noop_barriers()
    assert sorted(nb.rank for nb in noops) == [0, 1, 2]
    assert all("no process group existed" in str(nb) for nb in noops)
    with pytest.raises(TimelineAssertionError, match="no-op barrier: 'barrier' on rank 1"):
        timeline.assert_no_noop_barriers()
    dist.destroy_process_group()


@pytest.mark.multirank(world_size=3)
def test_a_barrier_on_the_wrong_side_of_prepare_data_is_named(rank, recorder, shared_tmp_path) -> None:
    hooks = recorder.instrument(Hooks())
    strategy = recorder.instrument_barrier(Strategy(), "barrier")
    strategy.barrier()  # placed before prepare_data: it orders nothing that matters
    if rank == 0:
        hooks.prepare_data(shared_tmp_path)
    else:
        time.sleep(0.3)
    hooks.setup(shared_tmp_path)
    timeline = recorder.timeline()
    with pytest.raises(TimelineAssertionError) as failure:
        timeline.assert_happens_before("prepare_data@0", "setup")
    assert "which rank 0 entered at event #" in str(failure.value)
    assert "before prepare_data ended" in str(failure.value)
