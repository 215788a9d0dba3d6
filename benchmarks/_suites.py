"""The test files the benchmarks generate: each is a template for ``.format(n=N)``."""

MULTIRANK_TEST = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.multirank(world_size=2)
@pytest.mark.parametrize("i", range({n}))
def test_multirank(i):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
"""
