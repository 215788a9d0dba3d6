"""A suite run under torchrun on 2 simulated nodes x 2 ranks (see ci/torchrun_two_nodes.sh)."""

import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.multirank(world_size=4, nodes=2)
def test_runs_on_the_launched_ranks(rank, world_size, recorder):
    assert (rank, world_size) == (int(os.environ["RANK"]), 4)
    assert os.environ["LOCAL_RANK"] == str(rank % 2) and os.environ["GROUP_RANK"] == str(rank // 2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == 6.0
    recorder.mark("reduced")
    assert recorder.timeline().ranks == [0, 1, 2, 3]


@pytest.mark.multirank(world_size=4)
def test_barrier_orders_ranks(rank, recorder):
    if rank == 0:
        recorder.mark("first")
    dist.barrier()
    recorder.mark("then")
    recorder.timeline().assert_happens_before("first@0", "then")


@pytest.mark.multirank(world_size=2)
def test_other_size_is_deselected(rank):
    raise AssertionError("a world_size=2 test must not run on 4 launched ranks")


def test_plain_runs_on_rank_0_only():
    assert os.environ["RANK"] == "0"
